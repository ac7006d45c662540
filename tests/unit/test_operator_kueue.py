"""The operator as Kueue's job integration for RLJob: the Workload, spec.suspend as the lever, eviction, finishing.

A fake API server holds what Kueue would write (its admission of the Workload, an eviction); the e2e test
``test_operator_gang.py::test_..._with_kueue`` (``make e2e-kueue``) runs real Kueue v0.17.0.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync_operator import admission, kueue
from weightsync_operator.reconciling import Memory, Settings, reconcile

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BODY = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
KUEUE = Settings(kueue=True)


class FakeApi:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.patches: list[tuple[str, str, dict[str, Any]]] = []

    def get(self, kind: str, namespace: str, name: str, timeout: float = 0) -> dict[str, Any] | None:
        if kind == "ResourceFlavor":
            return {"spec": {"nodeLabels": {"pool": name}}}
        return copy.deepcopy(self.objects.get((kind, name)))

    def list(self, kind: str, namespace: str, label_selector: str, field_selector: str = "") -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (k, _), o in self.objects.items() if k == kind]

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.objects[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        return obj

    def create(self, obj: dict[str, Any]) -> bool:
        self.objects[(obj["kind"], obj["metadata"]["name"])] = copy.deepcopy(obj)
        return True

    def delete(self, kind: str, namespace: str, name: str, propagation: str = "Background") -> bool:
        return self.objects.pop((kind, name), None) is not None

    def patch(
        self, kind: str, namespace: str, name: str, body: dict[str, Any], rv: str | None = None, sub: str = ""
    ) -> None:
        self.patches.append((kind, sub, body))

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any], rv: str | None) -> None:
        self.patches.append((kind, "/status", status))


def _job(suspend: bool = False, status: dict[str, Any] | None = None) -> dict[str, Any]:
    body = copy.deepcopy(BODY)
    body["metadata"] |= {"namespace": "ns", "uid": "abcdef12", "generation": 1, "labels": {kueue.QUEUE_LABEL: "gpu"}}
    body["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    body["spec"]["suspend"] = suspend
    body["status"] = status or {}
    return body


def _workload(api: FakeApi) -> dict[str, Any]:
    return next(o for (k, _), o in api.objects.items() if k == "Workload")


def _admit(api: FakeApi, flavor: str = "h100") -> None:
    wl = _workload(api)
    wl["metadata"]["resourceVersion"] = "7"
    wl["status"] = {
        "conditions": [
            {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "reserved"},
            {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "The workload is admitted"},
        ],
        "admission": {
            "clusterQueue": "cq",
            "podSetAssignments": [{"name": c, "flavors": {"nvidia.com/gpu": flavor}} for c in ("inference", "trainer")],
        },
    }


def test_a_queued_job_gets_its_workload_and_is_suspended_until_kueue_admits_it() -> None:
    api = FakeApi()
    out = reconcile(api, _job(), KUEUE, memory=Memory())  # type: ignore[arg-type]
    wl = _workload(api)
    assert wl["metadata"]["name"] == "rljob-grpo-qwen-abcde" and wl["spec"]["queueName"] == "gpu"
    assert wl["metadata"]["ownerReferences"][0]["uid"] == "abcdef12" and wl["metadata"]["labels"]["weightsync.io/job"]
    assert {p["name"]: p["count"] for p in wl["spec"]["podSets"]} == {"coordinator": 1, "inference": 2, "trainer": 2}
    trainer = next(p for p in wl["spec"]["podSets"] if p["name"] == "trainer")["template"]["spec"]
    assert trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert ("RLJob", "", {"spec": {"suspend": True}}) in api.patches  # the lever
    assert not [k for k, _ in api.objects if k == "Pod"]
    admitted = next(c for c in out.status.conditions if c.type == "Admitted")
    assert admitted.status == "False" and admitted.reason == "Queued"

    # Kueue admits it: unsuspended, and its pods go to the nodes of the flavor Kueue assigned
    _admit(api)
    api.patches.clear()
    out = reconcile(api, _job(suspend=True), KUEUE, memory=Memory())  # type: ignore[arg-type]
    assert ("RLJob", "", {"spec": {"suspend": False}}) in api.patches
    admitted = next(c for c in out.status.conditions if c.type == "Admitted")
    assert admitted.status == "True" and "rljob-grpo-qwen-abcde" in admitted.message
    out = reconcile(api, _job(suspend=False), KUEUE, memory=Memory())  # type: ignore[arg-type]
    sts = api.objects[("StatefulSet", "grpo-qwen-inference")]
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["template"]["spec"]["nodeSelector"]["pool"] == "h100"


def test_kueue_s_reason_is_quoted_while_it_waits() -> None:
    seen = kueue.Seen(
        "w",
        "ns",
        ({"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": "insufficient quota"},),
        None,
        "1",
    )
    assert kueue.decision(seen) == admission.Decision(False, "Kueue: insufficient quota")


def test_an_evicted_job_is_suspended_and_gives_its_quota_back_once_its_pods_are_gone() -> None:
    api = FakeApi()
    reconcile(api, _job(), KUEUE, memory=Memory())  # type: ignore[arg-type]
    _admit(api)
    _workload(api)["status"]["conditions"].append(
        {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "preempted by a higher priority job"}
    )
    api.patches.clear()
    reconcile(api, _job(suspend=False), KUEUE, memory=Memory())  # type: ignore[arg-type]
    assert ("RLJob", "", {"spec": {"suspend": True}}) in api.patches
    status = next(body for kind, sub, body in api.patches if kind == "Workload" and sub == "/status")
    assert status["admission"] is None
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False" and conds["Admitted"]["status"] == "False"
    assert conds["Requeued"]["status"] == "True" and conds["Evicted"]["status"] == "True"


def test_a_finished_job_marks_its_workload_finished() -> None:
    api = FakeApi()
    reconcile(api, _job(), KUEUE, memory=Memory())  # type: ignore[arg-type]
    _admit(api)
    done = {"conditions": [{"type": "Succeeded", "status": "True", "reason": "TrainerCompleted", "message": "",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}  # fmt: skip
    api.patches.clear()
    reconcile(api, _job(status=done), KUEUE, memory=Memory())  # type: ignore[arg-type]
    status = next(body for kind, sub, body in api.patches if kind == "Workload" and sub == "/status")
    finished = next(c for c in status["conditions"] if c["type"] == "Finished")
    assert finished["status"] == "True" and finished["reason"] == "Succeeded"
    assert not [p for p in api.patches if p[0] == "RLJob" and p[1] == ""]  # a finished job's suspend is left alone


def test_without_the_integration_a_queue_label_changes_nothing() -> None:
    api = FakeApi()
    reconcile(api, _job(), Settings(), memory=Memory())  # type: ignore[arg-type]
    assert not [k for k, _ in api.objects if k == "Workload"] and not api.patches[1:]
