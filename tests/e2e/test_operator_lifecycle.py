"""The operator on the real control plane: helm install, an RLJob's life, and the operator's own RBAC.

The operator runs under the chart's ServiceAccount (:mod:`tests.e2e.chart`), and this test
writes WeightVersion objects with the token of the job's coordinator ServiceAccount, as the
coordinator would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.chart import EXAMPLE_JOB, REPO, Operator, children, example, operator_requests, rljob, wait_phase
from tests.e2e.conftest import Kube, Timeouts
from weightsync_operator.kubeapi import KINDS

pytestmark = pytest.mark.e2e

JOB = EXAMPLE_JOB


def _children(kube: Kube, namespace: str) -> dict[str, list[str]]:
    return children(kube, namespace, JOB)


def _version(kube: Kube, kubeconfig: Path, namespace: str, version: int, phase: str) -> None:
    """Create and finish a WeightVersion as the job's coordinator ServiceAccount."""
    wv: dict[str, Any] = {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightVersion",
        "metadata": {"name": f"{JOB}-v{version}", "labels": {"weightsync.io/job": JOB}},
        "spec": {
            "job": JOB,
            "version": version,
            "step": 4 * version,
            "bytes": 3_441_000_000,
            "channelPlan": [{"channel": "nccl", "replicas": 2}],
        },
    }
    env = ["--kubeconfig", str(kubeconfig), "-n", namespace]
    kube.kubectl(*env, "apply", "--server-side", "--field-manager", "coordinator", "-f", "-", input=json.dumps(wv))
    status = {
        "status": {
            "phase": phase,
            "durable": True,
            "replicasLoaded": 2 if phase == "Ready" else 0,
            "replicasFailed": 0 if phase == "Ready" else 2,
            "phaseSeconds": {"transfer": 0.0096, "total": 0.25},
            "message": "" if phase == "Ready" else "2 replicas timed out",
        }
    }
    kube.kubectl(
        *env,
        "patch",
        "wv",
        wv["metadata"]["name"],
        "--subresource",
        "status",
        "--type",
        "merge",
        "-p",
        json.dumps(status),
    )


def test_rljob_lifecycle(kube: Kube, namespace: str, operator: Operator, tmp_path: Path) -> None:
    kube.prebind_checkpoint_volume(namespace, JOB)
    kube.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "rljob.yaml"))
    job = wait_phase(kube, namespace, JOB, "Running")
    assert job["status"]["ready"] == "2/2" and job["status"]["trainerReady"] == 2

    # children: GPU requests, scheduled on the fake GPU nodes, policies accepted
    pods = kube.core.list_namespaced_pod(namespace, label_selector=f"weightsync.io/job={JOB}").items
    gpu_pods = [p for p in pods if p.metadata.labels["app.kubernetes.io/component"] != "coordinator"]
    assert len(gpu_pods) == 4
    for pod in gpu_pods:
        assert pod.spec.node_name.startswith("gpu-node-"), pod.metadata.name
        main = pod.spec.containers[0]
        assert main.resources.limits["nvidia.com/gpu"] == "1"
    before = _children(kube, namespace)
    assert before["NetworkPolicy"] == [f"{JOB}-coordinator", f"{JOB}-inference", f"{JOB}-trainer"]
    assert f"{JOB}-openai" in before["Service"]
    # trainer pods are told the job's OpenAI endpoint: the Service the API server holds, on the port it serves
    openai = kube.core.read_namespaced_service(f"{JOB}-openai", namespace)
    url = f"http://{JOB}-openai.{namespace}.svc:{openai.spec.ports[0].port}"
    for pod in (p for p in gpu_pods if p.metadata.labels["app.kubernetes.io/component"] == "trainer"):
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["WEIGHTSYNC_OPENAI_URL"] == url, pod.metadata.name

    # versions written by the coordinator's ServiceAccount are reflected; old ones pruned (retention 3)
    coordinator = kube.coordinator_kubeconfig(namespace, JOB, tmp_path / "coordinator")
    for version in range(1, 6):
        _version(kube, coordinator, namespace, version, "Failed" if version == 5 else "Ready")
    kube.wait_for(
        lambda: rljob(kube, namespace, JOB)["status"].get("lastFailedVersion") == 5,
        Timeouts.POD_RUNNING,
        "version 5 reflected",
    )
    status = rljob(kube, namespace, JOB)["status"]
    assert status["currentVersion"] == 4 and status["replicasLoaded"] == 2 and status["lastSyncSeconds"] == 0.25
    kube.wait_for(
        lambda: (
            len(
                kube.custom.list_namespaced_custom_object("weightsync.io", "v1alpha1", namespace, "weightversions")[
                    "items"
                ]
            )
            == 3
        ),
        Timeouts.DELETE,
        "retention",
    )
    table = kube.kubectl("get", "rlj", JOB, "-n", namespace).stdout
    assert table.split()[:5] == ["NAME", "PHASE", "READY", "VERSION", "LAST"] and "Running   2/2     4" in table
    reasons = kube.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.kind=RLJob",
        "-o",
        "jsonpath={.items[*].reason}",
    ).stdout.split()
    assert {"PhaseRunning", "VersionReady", "VersionFailed"} <= set(reasons)

    # suspend removes every pod; resume brings them back
    kube.kubectl("patch", "rlj", JOB, "-n", namespace, "--type", "merge", "-p", '{"spec": {"suspend": true}}')
    wait_phase(kube, namespace, JOB, "Suspended")
    kube.wait_for(
        lambda: not kube.core.list_namespaced_pod(namespace, label_selector=f"weightsync.io/job={JOB}").items,
        Timeouts.DELETE,
        "pods gone",
    )
    kube.kubectl("patch", "rlj", JOB, "-n", namespace, "--type", "merge", "-p", '{"spec": {"suspend": false}}')
    wait_phase(kube, namespace, JOB, "Running")
    # kopf keeps no copy of the handled spec on the job (no handler reads a diff), so a spec change is not
    # written back to the RLJob (one PATCH per change, each waking the reconcile again)
    annotations = kube.kubectl("get", "rlj", JOB, "-n", namespace, "-o", "jsonpath={.metadata.annotations}").stdout
    handled = json.loads(annotations or "{}").get("weightsync.io/last-handled") or "{}"
    assert json.loads(handled) == {}, annotations

    # the TLS Secret: a CA and the coordinator's certificate, owned by the job, mounted by every pod
    tls = kube.core.read_namespaced_secret(f"{JOB}-tls", namespace)
    assert tls.type == "kubernetes.io/tls" and set(tls.data) == {"tls.crt", "tls.key", "ca.crt"}
    assert tls.metadata.owner_references[0].kind == "RLJob" and tls.metadata.owner_references[0].name == JOB
    coordinator_pod = kube.core.list_namespaced_pod(
        namespace, label_selector=f"weightsync.io/job={JOB},app.kubernetes.io/component=coordinator"
    ).items[0]
    assert "--tls-cert" in coordinator_pod.spec.containers[0].command

    # an operator restarted mid-reconcile converges without duplicates, and keeps the TLS material; its start reads
    # the children from its watches (kopf lists every kind before any pass), not with a GET of each per job
    kube.kubectl("delete", "deploy", f"{JOB}-coordinator", "-n", namespace, "--wait=false")
    watched = [k.plural for k in KINDS.values() if k.kind not in ("Secret", "RLJob")]
    with operator_requests(kube, operator, ["get"], watched) as child_gets:
        operator.stop()
        operator.start()
        time.sleep(3)
        kube.wait_for(
            lambda: _children(kube, namespace).keys() == before.keys() and len(_children(kube, namespace)["Pod"]) == 5,
            Timeouts.POD_RUNNING,
            "children back",
        )
        wait_phase(kube, namespace, JOB, "Running")
        assert child_gets() == 0
    after = _children(kube, namespace)
    assert {k: v for k, v in after.items() if k != "Pod"} == {k: v for k, v in before.items() if k != "Pod"}
    kept = kube.core.read_namespaced_secret(f"{JOB}-tls", namespace)
    assert kept.metadata.uid == tls.metadata.uid and kept.data == tls.data
    assert rljob(kube, namespace, JOB)["status"]["restarts"] == 0

    # deleting the RLJob removes every child (and its WeightVersions, via the finalizer)
    kube.kubectl("delete", "rlj", JOB, "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")
    kube.wait_for(lambda: not _children(kube, namespace), Timeouts.DELETE, "children deleted")
    assert (
        kube.custom.list_namespaced_custom_object("weightsync.io", "v1alpha1", namespace, "weightversions")["items"]
        == []
    )
    kube.kubectl("delete", "pv", f"{namespace}-{JOB}", "--wait=false", check=False)


def _condition(kube: Kube, namespace: str, job: str, ctype: str) -> dict[str, Any] | None:
    conds = rljob(kube, namespace, job).get("status", {}).get("conditions", [])
    return next((c for c in conds if c["type"] == ctype), None)


def test_a_job_bigger_than_any_node_waits_whole_saying_why(kube: Kube, namespace: str, operator: Operator) -> None:
    """The built-in gang admission queues it: no pod of it is created (none could run without the others)."""
    body = example("too-big")
    body["spec"]["inference"]["gpusPerReplica"] = 16
    kube.prebind_checkpoint_volume(namespace, "too-big")
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))

    def queued() -> dict[str, Any] | None:
        cond = _condition(kube, namespace, "too-big", "Admitted")
        return cond if cond is not None and cond["status"] == "False" else None

    cond = kube.wait_for(queued, Timeouts.POD_UNSCHEDULABLE, "Admitted=False")
    assert cond["reason"] == "Queued", cond
    assert "pod too-big-inference-0 asks for" in cond["message"] and "16 nvidia.com/gpu" in cond["message"], cond
    assert "more than any node it may use has allocatable" in cond["message"], cond
    status = rljob(kube, namespace, "too-big")["status"]
    assert status["phase"] == "Pending"
    scheduled = _condition(kube, namespace, "too-big", "Scheduled")
    assert scheduled is not None and scheduled["status"] == "False" and scheduled["reason"] == "Queued", scheduled
    assert not kube.core.list_namespaced_pod(namespace, label_selector="weightsync.io/job=too-big").items
    kube.kubectl("delete", "pv", f"{namespace}-too-big", "--wait=false", check=False)


def test_a_pod_the_scheduler_cannot_place_says_why(kube: Kube, namespace: str, operator: Operator) -> None:
    """What the admission's model of the nodes does not see (here: a checkpoint claim no volume binds) the scheduler
    does, and its words fill ``Scheduled``."""
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(example("unbound")))

    def scheduled_false() -> dict[str, Any] | None:
        cond = _condition(kube, namespace, "unbound", "Scheduled")
        return cond if cond is not None and cond["reason"] == "Unschedulable" else None

    cond = kube.wait_for(scheduled_false, Timeouts.POD_UNSCHEDULABLE, "Scheduled=False Unschedulable")
    assert cond["status"] == "False" and "pod unbound-" in cond["message"], cond
    assert "unbound immediate PersistentVolumeClaims" in cond["message"], cond
    assert rljob(kube, namespace, "unbound")["status"]["phase"] == "Pending"
