"""Every RLJob the API server accepts runs or says why, on the real control plane.

- A job named at the limit the CRD computes from its children's names runs (its replica pods carry the StatefulSet
  controller's revision label, the longest name made from the job's); one character more is refused at apply,
  naming ``metadata.name``.
- A child refused for a reason the CRD cannot check shows as ``Applied=False`` and a ``Refused`` event quoting the
  API server, within one reconcile: the replica pods of a colocated IPC job in a namespace whose PodSecurity level
  forbids host namespaces (refused to the StatefulSet's controller), and a StatefulSet that an object of the same
  name, not the job's, makes the API server refuse (HTTP 422, refused to the operator itself: not retried until the
  spec changes).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.e2e.chart import Operator, example, rljob, wait_phase
from tests.e2e.conftest import Kube, Timeouts
from weightsync.resources.naming import NAME_LIMIT

pytestmark = pytest.mark.e2e


def _apply(kube: Kube, namespace: str, body: dict[str, Any], check: bool = True) -> Any:
    kube.prebind_checkpoint_volume(namespace, body["metadata"]["name"])
    return kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body), check=check)


def _condition(kube: Kube, namespace: str, job: str, ctype: str) -> dict[str, Any] | None:
    conds = rljob(kube, namespace, job).get("status", {}).get("conditions", [])
    return next((c for c in conds if c["type"] == ctype), None)


def _refused(kube: Kube, namespace: str, job: str) -> dict[str, Any] | None:
    cond = _condition(kube, namespace, job, "Applied")
    return cond if cond is not None and cond["status"] == "False" else None


def _events(kube: Kube, namespace: str, job: str, reason: str) -> list[str]:
    out = kube.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.kind=RLJob,involvedObject.name={job},reason={reason}",
    ).stdout  # fmt: skip
    return [e["message"] for e in json.loads(out)["items"]]


def _refused_writes(kube: Kube, resource: str) -> float:
    """Writes of ``resource`` the API server answered 422 so far (its own count)."""
    total = 0.0
    for line in kube.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        if line.startswith("apiserver_request_total{") and f'resource="{resource}"' in line and 'code="422"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_name_at_the_limit_runs_and_one_more_is_refused(kube: Kube, namespace: str, operator: Operator) -> None:
    longest = "l" * NAME_LIMIT
    _apply(kube, namespace, example(longest))
    wait_phase(kube, namespace, longest, "Running")
    pods = kube.core.list_namespaced_pod(namespace, label_selector=f"weightsync.io/job={longest}").items
    revisions = {p.metadata.labels.get("controller-revision-hash", "") for p in pods}
    assert max(len(r) for r in revisions) <= 63 and any(r.startswith(f"{longest}-inference-") for r in revisions)
    refused = _apply(kube, namespace, example(longest + "l"), check=False)
    assert refused.returncode != 0 and f"metadata.name: Invalid value: may have at most {NAME_LIMIT}" in refused.stderr
    kube.kubectl("delete", "rlj", longest, "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")


def test_pods_a_namespace_policy_refuses_show_as_a_condition_and_an_event(
    kube: Kube, namespace: str, operator: Operator
) -> None:
    """Colocate with the ipc channel gives the GPU pods hostIPC (docs/kubernetes.md), which PodSecurity's baseline
    level forbids; the CRD cannot know the namespace's level."""
    kube.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline")
    body = example("colo")
    body["spec"]["placement"]["mode"] = "Colocate"
    body["spec"]["sync"]["channels"] = ["ipc", "nccl", "volume"]
    _apply(kube, namespace, body)
    cond = kube.wait_for(lambda: _refused(kube, namespace, "colo"), Timeouts.POD_RUNNING, "Applied=False")
    assert cond["reason"] == "Refused", cond
    assert "StatefulSet colo-inference could not create its pods" in cond["message"], cond
    assert 'violates PodSecurity "baseline:latest": host namespaces (hostIPC=true)' in cond["message"], cond
    running = _condition(kube, namespace, "colo", "Running")
    assert running is not None and running["reason"] == "Refused", running
    assert rljob(kube, namespace, "colo")["status"]["phase"] == "Pending"
    events = kube.wait_for(lambda: _events(kube, namespace, "colo", "Refused"), 30, "a Refused event")
    assert "violates PodSecurity" in events[0], events
    kube.kubectl("delete", "rlj", "colo", "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")


def test_a_child_the_api_server_refuses_is_not_retried_until_the_spec_changes(
    kube: Kube, namespace: str, operator: Operator
) -> None:
    """A StatefulSet named as the job's replicas but not the job's (another selector, immutable): applying the job's
    over it is refused with 422, which no retry of the same spec changes."""
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "clash-inference"},
        "spec": {
            "replicas": 0,
            "serviceName": "other",
            "selector": {"matchLabels": {"app": "other"}},
            "template": {
                "metadata": {"labels": {"app": "other"}},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(foreign))
    before = _refused_writes(kube, "statefulsets")
    _apply(kube, namespace, example("clash"))
    cond = kube.wait_for(lambda: _refused(kube, namespace, "clash"), Timeouts.POD_RUNNING, "Applied=False")
    assert "the API server refused StatefulSet clash-inference" in cond["message"], cond
    assert "spec: Forbidden: updates to statefulset spec" in cond["message"], cond
    assert "not retried until the spec changes" in cond["message"], cond
    events = kube.wait_for(lambda: _events(kube, namespace, "clash", "Refused"), 30, "a Refused event")
    assert "spec: Forbidden" in events[0]
    refused = _refused_writes(kube, "statefulsets") - before
    assert refused >= 1

    # woken again with the same spec (a label on the job, the StatefulSet's owner gone): no new try
    kube.kubectl("delete", "sts", "clash-inference", "-n", namespace)
    kube.kubectl("label", "rlj", "clash", "-n", namespace, "poke=1")
    time.sleep(5)
    assert _refused_writes(kube, "statefulsets") - before == refused
    assert _refused(kube, namespace, "clash") is not None
    assert len(_events(kube, namespace, "clash", "Refused")) == 1

    # a new spec is tried: the StatefulSet is the job's now, and the job runs
    patch = {"spec": {"inference": {"vllmArgs": ["--dtype", "bfloat16"]}}}
    kube.kubectl("patch", "rlj", "clash", "-n", namespace, "--type", "merge", "-p", json.dumps(patch))
    wait_phase(kube, namespace, "clash", "Running")
    applied = _condition(kube, namespace, "clash", "Applied")
    assert applied is not None and applied["status"] == "True", applied
    kube.kubectl("delete", "rlj", "clash", "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")
