"""A child the API server refuses: a condition and an event quoting it in the same pass, and no endless retry.

A fake API server refuses one child with the answer the real one gives (the e2e test ``test_operator_validation.py``
makes the real one refuse): 422 is not retried until the spec changes, 403 is retried with a growing delay. The
StatefulSet controller's refusals come from its FailedCreate events; ``Scheduled`` never says "every pod has a node"
for a job that has none.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync.resources.conditions import find
from weightsync.resources.rljob import RLJobSpec, RLJobStatus
from weightsync_operator import refusals, status, versions
from weightsync_operator.kubeapi import ApiError
from weightsync_operator.reconciling import Memory, Settings, reconcile
from weightsync_operator.status import Observed, Verdict

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BODY = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
MESSAGE = (
    'StatefulSet.apps "j-inference" is invalid: spec: Forbidden: updates to statefulset spec for fields other than ...'
)


class FakeApi:
    """Accepts every write but those of ``refuse`` (kind -> HTTP status), which it answers as the API server does."""

    def __init__(self, refuse: dict[str, int]) -> None:
        self.refuse, self.applied, self.patches = refuse, list[str](), list[dict[str, Any]]()

    def get(self, kind: str, namespace: str, name: str) -> None:
        return None

    def list(self, kind: str, namespace: str, label_selector: str, field_selector: str = "") -> list[Any]:
        return []

    def _write(self, obj: dict[str, Any]) -> None:
        self.applied.append(obj["kind"])
        code = self.refuse.get(obj["kind"])
        if code:
            reason = {422: "Invalid", 403: "Forbidden"}[code]
            raise ApiError(code, "PATCH", "/x", json.dumps({"reason": reason, "message": MESSAGE}))

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._write(obj)
        return obj

    def create(self, obj: dict[str, Any]) -> bool:
        self._write(obj)
        return True

    def delete(self, kind: str, namespace: str, name: str, propagation: str = "Background") -> bool:
        return True

    def patch_status(self, kind: str, namespace: str, name: str, body: dict[str, Any], rv: str | None) -> None:
        self.patches.append(body)


def _body(generation: int = 1, status_: dict[str, Any] | None = None) -> dict[str, Any]:
    body = copy.deepcopy(BODY)
    body["metadata"] |= {"namespace": "ns", "uid": "u1", "generation": generation, "name": "j"}
    body["status"] = status_ or {}
    return body


def test_a_refused_child_is_a_condition_and_an_event_quoting_the_api_server_and_is_not_retried() -> None:
    api, memory = FakeApi({"StatefulSet": 422}), Memory()
    first = reconcile(api, _body(), Settings(), memory=memory)  # type: ignore[arg-type]
    applied = find(first.status.conditions, "Applied")
    assert applied is not None and applied.status == "False" and applied.reason == "Refused"
    assert "the API server refused StatefulSet j-inference" in applied.message and MESSAGE in applied.message
    assert "not retried until the spec changes" in applied.message
    running = find(first.status.conditions, "Running")
    assert running is not None and running.reason == "Refused"
    assert ("Warning", "Refused", applied.message) in first.events
    assert api.patches[-1]["phase"] == "Pending" and first.retry_after is None
    assert "Pod" not in api.applied  # no trainer rank for a job whose replicas were refused

    # the same spec again (an event, a resync): nothing is written, the status says the same, no second event
    writes = len(api.applied)
    again = reconcile(api, _body(status_=first.status.to_wire()), Settings(), memory=memory)  # type: ignore[arg-type]
    assert len(api.applied) == writes and not [e for e in again.events if e[1] == "Refused"]
    assert again.status.to_wire() == first.status.to_wire()

    # a new spec is tried again
    api.refuse = {}
    fixed = reconcile(api, _body(2, first.status.to_wire()), Settings(), memory=memory)  # type: ignore[arg-type]
    assert "StatefulSet" in api.applied[writes:]
    applied = find(fixed.status.conditions, "Applied")
    assert applied is not None and applied.status == "True"


def test_a_forbidden_child_is_retried_later_with_a_growing_delay() -> None:
    api, memory = FakeApi({"Deployment": 403}), Memory()
    first = reconcile(api, _body(), Settings(), memory=memory)  # type: ignore[arg-type]
    assert first.retry_after == refusals.RETRY_S[0]
    assert "; retrying" in find(first.status.conditions, "Applied").message  # type: ignore[union-attr]
    second = reconcile(api, _body(status_=first.status.to_wire()), Settings(), memory=memory)  # type: ignore[arg-type]
    assert second.retry_after == 2 * refusals.RETRY_S[0] and api.applied.count("Deployment") == 2
    api.refuse = {}
    third = reconcile(api, _body(status_=second.status.to_wire()), Settings(), memory=memory)  # type: ignore[arg-type]
    assert third.retry_after is None and find(third.status.conditions, "Applied").status == "True"  # type: ignore[union-attr]


def test_trouble_that_is_no_refusal_still_fails_the_pass() -> None:
    api = FakeApi({"StatefulSet": 422})
    api.refuse = {}
    err = ApiError(503, "PATCH", "/x", "unavailable")
    assert refusals.of(err, {"kind": "Pod", "metadata": {"name": "p"}}, 1) is None


def _sts(replicas: int, have: int, observed: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": "j-inference", "namespace": "ns", "generation": 1},
        "spec": {"replicas": replicas},
        "status": {"observedGeneration": observed, "replicas": have},
    }


def test_the_statefulset_controllers_refusal_comes_from_its_newest_failedcreate_event() -> None:
    events = [
        {"reason": "FailedCreate", "lastTimestamp": "2026-01-01T00:00:01Z", "message": "old"},
        {"reason": "FailedCreate", "lastTimestamp": "2026-01-01T00:00:09Z", "message": "pods are forbidden: quota"},
    ]
    found = refusals.of_statefulset(_sts(2, 0), events, 3)
    assert found is not None and found.by_controller and "pods are forbidden: quota" in found.text
    assert refusals.of_statefulset(_sts(2, 2), events, 3) is None  # it has its pods
    assert refusals.of_statefulset(_sts(2, 0, observed=0), events, 3) is None  # it has not seen its spec yet
    deploy = {
        "metadata": {"name": "j-coordinator"},
        "status": {"conditions": [{"type": "ReplicaFailure", "status": "True", "message": "forbidden"}]},
    }
    assert refusals.of_deployment(deploy, 1) is not None


SPEC = RLJobSpec.model_validate(BODY["spec"])


@pytest.mark.parametrize(
    ("suspend", "verdict", "reason"),
    [(True, Verdict.PARK, "Suspended"), (False, Verdict.QUEUE, "Queued"), (False, Verdict.RUN, "Waiting")],
)
def test_scheduled_is_never_true_for_a_job_without_pods(suspend: bool, verdict: Verdict, reason: str) -> None:
    spec = SPEC.model_copy(update={"suspend": suspend})
    stale = status.next_status(
        SPEC, RLJobStatus(), Observed(1, pods=[_stuck()]), Verdict.RUN, versions.VersionSummary()
    )  # a pod the scheduler could not place, now gone
    new = status.next_status(spec, stale, Observed(2), verdict, versions.VersionSummary())
    cond = find(new.conditions, "Scheduled")
    assert cond is not None and cond.status == "False" and cond.reason == reason, cond
    assert "j-inference-0" not in cond.message


def _stuck() -> status.PodView:
    return status.PodView("j-inference-0", "Pending", False, False, "0/3 nodes are available", component="inference")
