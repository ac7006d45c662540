"""A trainer failure counts against the restart budget once, even when the failed rank is seen again.

The status patch that counts a gang restart is written before the ranks are deleted. A reconcile that then sees
the failed rank again (the operator died in between, or its watch cache of pods lags the status it wrote) must
delete it without counting it a second time: each rank carries the count it was created under.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync.resources.rljob import RLJobSpec, RLJobStatus
from weightsync_operator import names, reconciling, status
from weightsync_operator.status import PodView, Verdict

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BODY = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())


def _spec(max_restarts: int) -> dict[str, Any]:
    spec = copy.deepcopy(BODY["spec"])
    spec["trainer"]["worldSize"] = 1
    spec["failurePolicy"] = {"maxRestarts": max_restarts}
    return spec


def _failed(restart: int | None) -> PodView:
    return PodView(name="j-trainer-0", phase="Failed", ready=False, deleting=False, unschedulable=None, rank=0,
                   restart=restart)  # fmt: skip


def test_a_rank_created_before_the_last_counted_restart_is_cleared_not_counted() -> None:
    spec = RLJobSpec.model_validate(_spec(3))
    assert status.decide_trainer(spec, RLJobStatus(restarts=1), [_failed(1)], 2) == Verdict.RESTART
    assert status.decide_trainer(spec, RLJobStatus(restarts=1), [_failed(0)], 2) == Verdict.CLEAR
    assert status.decide_trainer(spec, RLJobStatus(restarts=1), [_failed(None)], 2) == Verdict.RESTART  # unmarked
    last = RLJobSpec.model_validate(_spec(1))
    assert status.decide_trainer(last, RLJobStatus(restarts=1), [_failed(0)], 2) == Verdict.CLEAR  # not FAIL
    assert status.decide_trainer(last, RLJobStatus(restarts=1), [_failed(1)], 2) == Verdict.FAIL


class _Crash(Exception):
    pass


class FakeApi:
    """Pods in a list, every other write accepted; ``crash`` kills the operator at its next pod deletion."""

    def __init__(self) -> None:
        self.pods = [self._replica(i) for i in range(2)]
        self.status: dict[str, Any] = {}
        self.crash = False

    @staticmethod
    def _replica(i: int) -> dict[str, Any]:
        labels = {names.JOB_LABEL: "j", names.COMPONENT_LABEL: "inference"}
        return {"metadata": {"name": f"j-inference-{i}", "labels": labels}, "spec": {"nodeName": "n"}, "status": {}}

    def get(self, kind: str, namespace: str, name: str) -> None:
        return None

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self.pods) if kind == "Pod" else []

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return obj

    def create(self, obj: dict[str, Any]) -> bool:
        if obj["kind"] == "Pod":
            self.pods.append(copy.deepcopy(obj) | {"spec": {"nodeName": "n"}, "status": {"phase": "Running"}})
        return True

    def delete(self, kind: str, namespace: str, name: str, propagation: str = "Background") -> bool:
        if kind == "Pod" and self.crash:
            raise _Crash(name)
        self.pods = [p for p in self.pods if p["metadata"]["name"] != name]
        return True

    def patch_status(self, kind: str, namespace: str, name: str, status: Any, resource_version: str | None) -> None:
        self.status = status


def test_an_operator_that_dies_between_counting_and_deleting_counts_the_failure_once() -> None:
    api = FakeApi()
    body = {"metadata": {"name": "j", "namespace": "ml", "uid": "u", "generation": 1}, "spec": _spec(1)}

    def reconcile() -> reconciling.Outcome:
        body["status"] = copy.deepcopy(api.status)
        return reconciling.reconcile(api, body, reconciling.Settings())  # type: ignore[arg-type]

    reconcile()
    rank = next(p for p in api.pods if p["metadata"]["name"] == "j-trainer-0")
    assert rank["metadata"]["annotations"][names.RESTART_ANNOTATION] == "0"
    rank["status"]["phase"] = "Failed"
    api.crash = True
    with pytest.raises(_Crash):
        reconcile()
    assert api.status["restarts"] == 1
    api.crash = False
    again = reconcile()  # the restarted operator sees the failed rank again
    assert again.status.restarts == 1 and again.status.phase != "Failed", again.status
    assert not [e for e in again.events if e[1] == "TrainerRestarted"]
    reconcile()
    ranks = [p for p in api.pods if p["metadata"]["name"] == "j-trainer-0"]
    assert [r["metadata"]["annotations"][names.RESTART_ANNOTATION] for r in ranks] == ["1"]


def test_a_pass_that_fails_after_its_status_patch_landed_leaves_its_events_to_the_next() -> None:
    """The job's Failed phase is announced once, by the pass after one that patched it and then failed.

    The fake's deletion that fails stands in for any write after the patch that fails (an API error or a timeout
    whose write was applied anyway), which the real control plane gives only at random."""
    api, memory = FakeApi(), reconciling.Memory()
    body = {"metadata": {"name": "j", "namespace": "ml", "uid": "u", "generation": 1}, "spec": _spec(0)}

    def reconcile() -> reconciling.Outcome:
        body["status"] = copy.deepcopy(api.status)
        return reconciling.reconcile(api, body, reconciling.Settings(), memory=memory)  # type: ignore[arg-type]

    reconcile()
    rank = next(p for p in api.pods if p["metadata"]["name"] == "j-trainer-0")
    rank["status"]["phase"] = "Failed"
    api.crash = True
    with pytest.raises(_Crash):
        reconcile()
    assert api.status["phase"] == "Failed"
    api.crash = False
    again = reconcile()
    assert not again.patched and ("Warning", "PhaseFailed") in [e[:2] for e in again.events], again
    assert not reconcile().events  # announced once
