"""All-or-nothing versions on the core (no gRPC): replicas stage, the coordinator commits, or nobody switches.

The replicas' side is their reports (``Progress.STAGED``, acks); the events the core sends them are read from
their watch queues. Time is a ``ManualClock``.
"""

from __future__ import annotations

import queue

import pytest

from tests.unit.test_coordinator_lifecycle import TABLE, failed, fleet, latest, next_event, ok, sent, statuses
from weightsync.coordinator.clock import ManualClock
from weightsync.coordinator.models import Assignment, EventKind, JobPolicy, Progress
from weightsync.vocabulary import ReplicaState, VersionState

pytestmark = pytest.mark.unit

ATOMIC = JobPolicy(all_or_nothing=True)


def drained(events: queue.SimpleQueue[Assignment | None]) -> list[tuple[EventKind, int]]:
    out = []
    while not events.empty():
        event = events.get_nowait()
        assert event is not None
        out.append((event.kind, event.version))
    return out


def test_every_replica_switches_only_once_all_staged() -> None:
    core, t, (r0, r1) = fleet(2, ATOMIC)
    e0, e1 = core.subscribe(r0), core.subscribe(r1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assign = next_event(e0)
    assert assign.kind is EventKind.ASSIGN and assign.await_commit
    next_event(e1)
    sent(core, t, v)
    core.report_progress(r0, v, Progress.STAGED)
    assert drained(e0) == [] and statuses(latest(core))["r0"] is ReplicaState.STAGED
    assert latest(core).state is VersionState.STAGING
    core.report_progress(r1, v, Progress.STAGED)  # the last one the policy needs: commit
    assert drained(e0) == [(EventKind.COMMIT, v)] and drained(e1) == [(EventKind.COMMIT, v)]
    assert core.ack(r0, ok(v)) is VersionState.STAGING
    assert core.ack(r1, ok(v)) is VersionState.READY
    assert statuses(latest(core)) == {"r0": ReplicaState.LOADED, "r1": ReplicaState.LOADED}


def test_no_commit_before_the_trainer_reported_what_it_sent() -> None:
    core, t, (r0,) = fleet(1, ATOMIC)
    e0 = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.report_progress(r0, v, Progress.STAGED)
    assert drained(e0) == [(EventKind.ASSIGN, v)]
    sent(core, t, v)
    assert drained(e0) == [(EventKind.COMMIT, v)]


def test_a_failed_stage_fails_the_version_and_no_replica_switches_then_the_next_goes_through() -> None:
    core, t, (r0, r1) = fleet(2, ATOMIC)
    e0 = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v)
    core.report_progress(r0, v, Progress.STAGED)
    core.ack(r1, failed(v, "cannot allocate 1.00 GB on cpu to stage version 1"))
    info = latest(core)
    assert info.state is VersionState.FAILED
    assert "not committed, no replica switched it (all-or-nothing)" in info.reason and "cannot allocate" in info.reason
    assert drained(e0) == [(EventKind.ASSIGN, v), (EventKind.ABORT, v)]  # r0 drops its stage, never a COMMIT
    v2 = core.open_version(t, "job", "t1", 2, TABLE).version
    sent(core, t, v2)
    for r in (r0, r1):
        core.report_progress(r, v2, Progress.STAGED)
    assert (EventKind.COMMIT, v2) in drained(e0)
    core.ack(r0, ok(v2))
    assert core.ack(r1, ok(v2)) is VersionState.READY


def test_the_timeout_fails_a_version_some_replica_never_staged() -> None:
    clock = ManualClock()
    core, t, (r0, _r1) = fleet(2, JobPolicy(version_timeout_s=10.0, all_or_nothing=True), clock=clock)
    e0 = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v)
    core.report_progress(r0, v, Progress.STAGED)
    clock.advance(10.5)
    core.tick()
    info = latest(core)
    assert info.state is VersionState.FAILED and "timed out" in info.reason
    assert drained(e0) == [(EventKind.ASSIGN, v), (EventKind.ABORT, v)]


def test_a_quorum_commits_and_a_replica_that_stages_later_switches_at_once() -> None:
    core, t, (r0, r1) = fleet(2, JobPolicy(ack_quorum=1, all_or_nothing=True))
    e0, e1 = core.subscribe(r0), core.subscribe(r1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v)
    core.report_progress(r0, v, Progress.STAGED)
    assert drained(e0) == [(EventKind.ASSIGN, v), (EventKind.COMMIT, v)]
    assert drained(e1) == [(EventKind.ASSIGN, v)]
    core.report_progress(r1, v, Progress.STAGED)
    assert drained(e1) == [(EventKind.COMMIT, v)]
    assert core.ack(r1, ok(v)) is VersionState.READY


def test_a_reconnecting_replica_gets_its_assignment_again_before_the_commit_and_the_commit_after() -> None:
    core, t, (r0, r1) = fleet(2, ATOMIC)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v)
    core.report_progress(r0, v, Progress.STAGED)
    e0 = core.subscribe(r0)
    again = next_event(e0)
    assert (again.kind, again.await_commit) == (EventKind.ASSIGN, True)  # it reports staged again, or re-stages
    assert drained(e0) == [(EventKind.ASSIGN, v)]  # the first one, carried over from the queue nobody read
    core.report_progress(r0, v, Progress.STAGED)  # re-reported: no double count, still waiting for r1
    assert latest(core).state is VersionState.STAGING and drained(e0) == []
    core.report_progress(r1, v, Progress.STAGED)
    assert drained(e0) == [(EventKind.COMMIT, v)]
    assert drained(core.subscribe(r0)) == [(EventKind.COMMIT, v)]  # a stream opened after the commit


def test_without_all_or_nothing_assignments_do_not_wait_and_staged_reports_change_nothing() -> None:
    core, t, (r0,) = fleet(1)
    e0 = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert not next_event(e0).await_commit
    sent(core, t, v)
    core.report_progress(r0, v, Progress.STAGED)
    assert drained(e0) == [] and statuses(latest(core))["r0"] is ReplicaState.PLANNED
