"""The operator keeps what it owns, and jobs keep to themselves, on the real control plane.

With the chart installed and the operator running under the chart's ServiceAccount
(:mod:`tests.e2e.chart`; no short resync, so every reaction here comes from an
event): a child changed by hand is put back; a job deleted while it is being
reconciled goes at once; one job's coordinator cannot write another job's
WeightVersions (the chart's ValidatingAdmissionPolicy, enforced by the API server);
a namespace user with the built-in ``edit`` role can run a job but not write versions
or a job's status.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.chart import Operator, example, rljob, wait_phase
from tests.e2e.conftest import Kube, Timeouts

pytestmark = pytest.mark.e2e


def _apply(kube: Kube, namespace: str, name: str, kubeconfig: Path | None = None) -> None:
    body = example(name)
    kube.prebind_checkpoint_volume(namespace, name)
    auth = ["--kubeconfig", str(kubeconfig)] if kubeconfig else []
    kube.kubectl(*auth, "apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def _version(name: str, job: str, version: int, label: str | None = None) -> dict[str, Any]:
    labels = {"weightsync.io/job": label} if label else {}
    return {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightVersion",
        "metadata": {"name": name, "labels": labels},
        "spec": {"job": job, "version": version, "step": version, "bytes": 1, "channelPlan": []},
    }


def _as(kube: Kube, kubeconfig: Path, namespace: str, *args: str, body: dict[str, Any] | None = None) -> Any:
    return kube.kubectl(
        "--kubeconfig", str(kubeconfig), "-n", namespace, *args,
        check=False, input=json.dumps(body) if body is not None else None,
    )  # fmt: skip


def test_children_changed_by_hand_are_put_back(kube: Kube, namespace: str, operator: Operator) -> None:
    _apply(kube, namespace, "drift")
    wait_phase(kube, namespace, "drift", "Running")
    kube.kubectl("scale", "sts", "drift-inference", "-n", namespace, "--replicas=5")
    kube.kubectl("set", "image", "deploy/drift-coordinator", "coordinator=evil:latest", "-n", namespace)
    started = time.monotonic()

    def restored() -> bool:
        sts = kube.apps.read_namespaced_stateful_set("drift-inference", namespace)
        deploy = kube.apps.read_namespaced_deployment("drift-coordinator", namespace)
        return bool(sts.spec.replicas == 2 and deploy.spec.template.spec.containers[0].image != "evil:latest")

    kube.wait_for(restored, 30, "the operator put the children back")
    assert time.monotonic() - started < 30
    kube.kubectl("delete", "rlj", "drift", "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")


def test_a_job_deleted_mid_reconcile_goes_at_once(kube: Kube, namespace: str, operator: Operator) -> None:
    for i in range(3):
        name = f"brief-{i}"
        _apply(kube, namespace, name)
        time.sleep(0.3)  # the operator is creating its children
        started = time.monotonic()
        kube.kubectl("delete", "rlj", name, "-n", namespace, "--timeout", "60s")
        took = time.monotonic() - started
        assert took < 10, f"{name}: deleting took {took:.1f}s"


def test_one_jobs_coordinator_cannot_write_another_jobs_versions(
    kube: Kube, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    for job in ("alpha", "beta"):
        _apply(kube, namespace, job)
    wait_phase(kube, namespace, "alpha", "Running")
    wait_phase(kube, namespace, "beta", "Running")
    alpha = kube.service_account_kubeconfig(namespace, "alpha-coordinator", tmp_path / "alpha")
    beta = kube.service_account_kubeconfig(namespace, "beta-coordinator", tmp_path / "beta")

    ok = _as(kube, alpha, namespace, "create", "-f", "-", body=_version("alpha-v1", "alpha", 1, "alpha"))
    assert ok.returncode == 0, ok.stderr
    ok = _as(kube, beta, namespace, "create", "-f", "-", body=_version("beta-v1", "beta", 1, "beta"))
    assert ok.returncode == 0, ok.stderr
    spoofs = {
        "another job's version": _version("beta-v2", "beta", 2, "beta"),
        "an unlabelled version": _version("beta-v3", "beta", 3),
        "a mislabelled version": _version("beta-v4", "beta", 4, "alpha"),
    }
    for what, body in spoofs.items():
        denied = _as(kube, alpha, namespace, "create", "-f", "-", body=body)
        assert denied.returncode != 0 and "ValidatingAdmissionPolicy" in denied.stderr, (what, denied.stderr)
    status = json.dumps({"status": {"phase": "Ready", "replicasLoaded": 2}})
    patch = _as(
        kube, alpha, namespace, "patch", "wv", "beta-v1", "--subresource", "status", "--type", "merge", "-p", status
    )
    assert patch.returncode != 0 and "may write only the WeightVersions of its own job" in patch.stderr, patch.stderr
    relabel = _as(kube, beta, namespace, "label", "wv", "beta-v1", "weightsync.io/job=alpha", "--overwrite")
    assert relabel.returncode != 0, relabel.stderr
    # beta's status never shows a version beta's coordinator did not write
    time.sleep(2)
    assert rljob(kube, namespace, "beta")["status"].get("currentVersion") is None
    for job in ("alpha", "beta"):
        kube.kubectl("delete", "rlj", job, "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")


def test_uninstall_is_refused_while_jobs_exist(kube: Kube, namespace: str, operator: Operator) -> None:
    """The chart's pre-delete hook command, run as the operator's ServiceAccount (as the hook's Job runs it; KWOK
    only marks a Job's pod complete, so this test runs its command): it names the live job and fails, and passes
    once the job is gone."""
    _apply(kube, namespace, "kept")
    wait_phase(kube, namespace, "kept", "Running")
    refused = operator.check_uninstall(namespace)
    assert refused.returncode == 1 and f"{namespace}/kept" in refused.stderr, refused.stderr
    assert "Delete them first" in refused.stderr
    kube.kubectl("delete", "rlj", "kept", "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")
    passed = operator.check_uninstall(namespace)
    assert passed.returncode == 0, passed.stderr


def test_a_namespace_editor_runs_jobs_without_cluster_admin(
    kube: Kube, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    kube.kubectl("create", "serviceaccount", "alice", "-n", namespace)
    kube.kubectl(
        "create",
        "rolebinding",
        "alice-edit",
        "--clusterrole=edit",
        "--serviceaccount",
        f"{namespace}:alice",
        "-n",
        namespace,
    )
    alice = kube.service_account_kubeconfig(namespace, "alice", tmp_path / "alice")

    def can_apply() -> bool:  # the aggregation controller folds the chart's roles into edit
        return _as(kube, alice, namespace, "apply", "-f", "-", body=example("alices")).returncode == 0

    kube.prebind_checkpoint_volume(namespace, "alices")
    kube.wait_for(can_apply, 30, "an editor can apply an RLJob")
    wait_phase(kube, namespace, "alices", "Running")
    assert _as(kube, alice, namespace, "get", "wv").returncode == 0
    denied = _as(kube, alice, namespace, "create", "-f", "-", body=_version("alices-v1", "alices", 1, "alices"))
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    status = json.dumps({"status": {"phase": "Succeeded"}})
    denied = _as(
        kube, alice, namespace, "patch", "rlj", "alices", "--subresource", "status", "--type", "merge", "-p", status
    )
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    assert _as(kube, alice, namespace, "delete", "rlj", "alices", "--timeout", "120s").returncode == 0
