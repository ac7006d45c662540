"""Status rules: conditions first, phase derived; sticky terminal states; a restart budget that only grows."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from weightsync.resources.conditions import find
from weightsync.resources.rljob import RLJobSpec, RLJobStatus
from weightsync_operator import status, versions
from weightsync_operator.status import Observed, PodView, Verdict

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SPEC = RLJobSpec.model_validate(yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())["spec"])
NONE = versions.VersionSummary()


def _pod(rank: int, phase: str = "Running", ready: bool = True, unschedulable: str | None = None) -> PodView:
    return PodView(
        name=f"j-trainer-{rank}", phase=phase, ready=ready, deleting=False, unschedulable=unschedulable, rank=rank
    )


def _all_up() -> Observed:
    trainer = [_pod(0), _pod(1)]
    return Observed(generation=1, coordinator_ready=1, inference_ready=2, trainer=trainer, pods=trainer)


def test_running_when_every_child_is_ready_and_stable_after() -> None:
    first = status.next_status(SPEC, RLJobStatus(), _all_up(), Verdict.RUN, NONE)
    assert first.phase == "Running" and first.ready == "2/2" and first.trainer_ready == 2
    again = status.next_status(SPEC, first, _all_up(), Verdict.RUN, NONE)
    assert again.to_wire() == first.to_wire()  # nothing changed: nothing to patch


def test_pending_until_replicas_ready() -> None:
    seen = _all_up()
    seen.inference_ready = 1
    new = status.next_status(SPEC, RLJobStatus(), seen, Verdict.RUN, NONE)
    assert new.phase == "Pending" and "replicas 1/2" in find(new.conditions, "Running").message  # type: ignore[union-attr]


def test_unschedulable_pod_gives_a_condition_with_the_schedulers_words() -> None:
    seen = _all_up()
    seen.pods = [_pod(0, "Pending", False, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")]
    cond = find(status.next_status(SPEC, RLJobStatus(), seen, Verdict.RUN, NONE).conditions, "Scheduled")
    assert cond is not None and cond.status == "False" and cond.reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond.message and "j-trainer-0" in cond.message


def test_failed_rank_restarts_the_gang_until_the_budget_is_spent() -> None:
    old = RLJobStatus()
    failed = [_pod(0, "Failed", False), _pod(1)]
    for expected in range(1, SPEC.failure_policy.max_restarts + 1):
        verdict = status.decide_trainer(SPEC, old, failed, 2)
        assert verdict == Verdict.RESTART
        old = status.next_status(SPEC, old, _all_up(), verdict, NONE)
        assert old.restarts == expected
    assert status.decide_trainer(SPEC, old, failed, 2) == Verdict.FAIL
    final = status.next_status(SPEC, old, _all_up(), Verdict.FAIL, NONE)
    assert final.phase == "Failed" and final.restarts == SPEC.failure_policy.max_restarts


def test_the_trainer_waits_for_every_replica_to_have_a_node() -> None:
    assert status.decide_trainer(SPEC, RLJobStatus(), [], 1) == Verdict.WAIT
    assert status.decide_trainer(SPEC, RLJobStatus(), [], 2) == Verdict.RUN
    assert status.decide_trainer(SPEC, RLJobStatus(), [_pod(0)], 0) == Verdict.RUN  # running ranks stay
    seen = _all_up()
    seen.trainer, seen.inference_ready = [], 0
    waiting = status.next_status(SPEC, RLJobStatus(), seen, Verdict.WAIT, NONE)
    running = find(waiting.conditions, "Running")
    assert waiting.phase == "Pending" and running is not None and running.reason == "WaitingForReplicas"


def test_terminal_is_sticky_and_parks_the_job() -> None:
    done = status.next_status(SPEC, RLJobStatus(), _all_up(), Verdict.SUCCEED, NONE)
    assert done.phase == "Succeeded"
    assert status.decide_trainer(SPEC, done, [_pod(0, "Failed", False)], 2) == Verdict.PARK
    later = status.next_status(SPEC, done, _all_up(), Verdict.PARK, NONE)
    assert later.phase == "Succeeded" and find(later.conditions, "Running").status == "False"  # type: ignore[union-attr]


def test_suspend_and_resume() -> None:
    spec = SPEC.model_copy(deep=True)
    spec.suspend = True
    assert status.decide_trainer(spec, RLJobStatus(), [_pod(0)], 2) == Verdict.PARK
    suspended = status.next_status(spec, RLJobStatus(), Observed(generation=2), Verdict.PARK, NONE)
    assert suspended.phase == "Suspended"
    resumed = status.next_status(SPEC, suspended, _all_up(), Verdict.RUN, NONE)
    assert resumed.phase == "Running" and find(resumed.conditions, "Suspended").status == "False"  # type: ignore[union-attr]


def _wv(version: int, phase: str, loaded: int = 0, total: float | None = None) -> dict[str, object]:
    return {
        "metadata": {"name": f"j-v{version}", "labels": {"weightsync.io/job": "j"}},
        "spec": {"job": "j", "version": version, "step": version * 4, "bytes": 10},
        "status": {"phase": phase, "replicasLoaded": loaded, "phaseSeconds": {"total": total}},
    }


def test_versions_reflect_current_and_prune_beyond_retention() -> None:
    items = [
        _wv(1, "Superseded"),
        _wv(2, "Superseded"),
        _wv(3, "Ready", 2, 0.25),
        _wv(4, "Failed"),
        _wv(5, "Staging"),
        {"metadata": {"name": "other"}, "spec": {"job": "k", "version": 9, "step": 0, "bytes": 0}},
    ]
    seen = versions.parse("j", items)
    summary = versions.summarize(seen)
    assert (summary.current, summary.replicas_loaded, summary.last_sync_seconds) == (3, 2, 0.25)
    assert [s.spec.version for s in seen] == [5, 4, 3, 2, 1]
    assert (summary.newest, summary.newest_phase, summary.last_failed) == (5, "Staging", 4)
    assert versions.beyond_retention(seen, 2) == ["j-v2", "j-v1"]  # v3 is current: kept
    new = status.next_status(SPEC, RLJobStatus(), _all_up(), Verdict.RUN, summary)
    assert new.current_version == 3 and find(new.conditions, "Synced").status == "False"  # type: ignore[union-attr]
    reasons = [e[1] for e in versions.events(None, None, summary)]
    assert reasons == ["VersionReady", "VersionFailed"] and versions.events(3, 4, summary) == []


def test_a_version_counts_only_when_it_belongs_to_the_job_in_every_way() -> None:
    """Another job's coordinator (or a leftover of an earlier job of the same name) cannot pass a version off."""
    mine = _wv(7, "Ready", 2)
    owned = {**mine, "metadata": {**mine["metadata"], "ownerReferences": [{"kind": "RLJob", "name": "j", "uid": "u1"}]}}  # type: ignore[dict-item]
    assert [s.spec.version for s in versions.parse("j", [owned], uid="u1")] == [7]
    fakes = [
        {**mine, "metadata": {"name": "j-v7", "labels": {"weightsync.io/job": "k"}}},  # another job's label
        {**mine, "metadata": {"name": "j-v7"}},  # no label
        {**mine, "metadata": {"name": "k-v7", "labels": {"weightsync.io/job": "j"}}},  # not <job>-v<version>
        {**mine, "metadata": {"name": "j-v8", "labels": {"weightsync.io/job": "j"}}},  # the name names v8
        {**owned, "metadata": {**owned["metadata"], "ownerReferences": [{"kind": "RLJob", "name": "j", "uid": "old"}]}},  # type: ignore[dict-item]
        {**owned, "metadata": {**owned["metadata"], "ownerReferences": [{"kind": "RLJob", "name": "k", "uid": "u1"}]}},  # type: ignore[dict-item]
    ]
    for fake in fakes:
        assert versions.parse("j", [fake], uid="u1") == [], fake
