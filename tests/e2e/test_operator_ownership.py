"""The operator keeps what it owns, and jobs keep to themselves, on the real control plane.

With the chart installed and the operator running under the chart's ServiceAccount
(:mod:`tests.e2e.chart`; no short resync, so every reaction here comes from an
event): a child changed by hand is put back; a job deleted while it is being
reconciled goes at once; one job's coordinator cannot write another job's
WeightVersions (the chart's ValidatingAdmissionPolicy, enforced by the API server);
a namespace user with the built-in ``edit`` role can run a job but not write versions
or a job's status, and acting as a job's coordinator is refused the casual ways and
not with a token bound to the coordinator's pod, as docs/kubernetes.md says ("Who can
do what"). (The uninstall check: ``test_operator_uninstall.py``.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

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
    alpha = kube.coordinator_kubeconfig(namespace, "alpha", tmp_path / "alpha")
    beta = kube.coordinator_kubeconfig(namespace, "beta", tmp_path / "beta")

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


def _editor(kube: Kube, namespace: str, tmp_path: Path) -> Path:
    """A kubeconfig of ``alice``, bound to the built-in ``edit`` role in ``namespace``."""
    kube.kubectl("create", "serviceaccount", "alice", "-n", namespace)
    kube.kubectl(
        "create", "rolebinding", "alice-edit", "--clusterrole=edit", "--serviceaccount", f"{namespace}:alice",
        "-n", namespace,
    )  # fmt: skip
    return kube.service_account_kubeconfig(namespace, "alice", tmp_path / "alice")


def test_a_namespace_editor_runs_jobs_without_cluster_admin(
    kube: Kube, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    alice = _editor(kube, namespace, tmp_path)

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


def _with_token(kube: Kube, kubeconfig: Path, token: str, path: Path) -> Path:
    """``kubeconfig`` with its user's credentials replaced by ``token``."""
    config = yaml.safe_load(kubeconfig.read_text())
    config["users"][0]["user"] = {"token": token}
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_editor_acting_as_a_coordinator_is_refused_the_casual_ways_and_not_with_its_pods_token(
    kube: Kube, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    """docs/kubernetes.md, "Who can do what": a namespace editor may act as any ServiceAccount of the namespace. The
    admission policy wants the token of the job's coordinator pod, so the two casual ways of acting as the
    coordinator (impersonation, a token bound to no pod) are refused; a token the editor binds to the coordinator's
    own pod is not (nor exec into that pod): the namespace is the trust boundary, as the docs say."""
    alice = _editor(kube, namespace, tmp_path)
    _apply(kube, namespace, "beta")
    wait_phase(kube, namespace, "beta", "Running")
    forged = _version("beta-v7", "beta", 7, "beta")
    account = f"system:serviceaccount:{namespace}:beta-coordinator"

    impersonated = _as(kube, alice, namespace, "--as", account, "create", "-f", "-", body=forged)
    assert impersonated.returncode != 0 and "a token bound to no pod" in impersonated.stderr, impersonated.stderr

    unbound = _as(kube, alice, namespace, "create", "token", "beta-coordinator")
    assert unbound.returncode == 0, unbound.stderr  # edit may mint the ServiceAccount's tokens
    as_unbound = _with_token(kube, alice, unbound.stdout.strip(), tmp_path / "unbound")
    denied = _as(kube, as_unbound, namespace, "create", "-f", "-", body=forged)
    assert denied.returncode != 0 and "a token bound to no pod" in denied.stderr, denied.stderr

    pod = kube.core.list_namespaced_pod(
        namespace, label_selector="weightsync.io/job=beta,app.kubernetes.io/component=coordinator"
    ).items[0]
    bound = _as(
        kube, alice, namespace, "create", "token", "beta-coordinator", "--bound-object-kind", "Pod",
        "--bound-object-name", pod.metadata.name, "--bound-object-uid", pod.metadata.uid,
    )  # fmt: skip
    assert bound.returncode == 0, bound.stderr
    as_pod = _with_token(kube, alice, bound.stdout.strip(), tmp_path / "bound")
    created = _as(kube, as_pod, namespace, "create", "-f", "-", body=forged)
    assert created.returncode == 0, created.stderr  # not closed: the docs say so
    ready = json.dumps({"status": {"phase": "Ready", "replicasLoaded": 2}})
    patch = _as(
        kube, as_pod, namespace, "patch", "wv", "beta-v7", "--subresource", "status", "--type", "merge", "-p", ready
    )
    assert patch.returncode == 0, patch.stderr
    kube.wait_for(
        lambda: rljob(kube, namespace, "beta")["status"].get("currentVersion") == 7,
        Timeouts.POD_RUNNING,
        "the version written with the pod's token reflected",
    )
    kube.kubectl("delete", "rlj", "beta", "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")
