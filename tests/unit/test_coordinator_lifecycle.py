"""Version lifecycle and leases on the core (no gRPC): ack policies, drops, failures, idempotency."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from weightsync import metrics
from weightsync.coordinator import faults
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import (
    AckReport,
    Capabilities,
    EventKind,
    JobPolicy,
    Progress,
    Role,
    SenderOffer,
    TableSummary,
    WaitFor,
)
from weightsync.coordinator.store import MemoryStore
from weightsync.vocabulary import Channel, SyncPhase, VersionState

pytestmark = pytest.mark.unit

TABLE = TableSummary(3, 3000, "sha256:t")
CPU = Capabilities(host="n", channels=(Channel.CPU, Channel.VOLUME), volume_id="vol", volume_mount="/ckpt")
OFFER = SenderOffer(Channel.CPU, "127.0.0.1", 29500)


def fleet(
    n: int, policy: JobPolicy | None = None, ttl: float = 30.0, registry: CollectorRegistry | None = None
) -> tuple[Coordinator, str, list[str]]:
    core = Coordinator(
        lease_ttl_s=ttl, store=MemoryStore(), metrics=metrics.CoordinatorMetrics.create(registry) if registry else None
    )
    trainer = core.register("job", Role.TRAINER, "trainer", "t1", CPU, policy=policy, offers=[OFFER]).lease_id
    replicas = [core.register("job", Role.REPLICA, f"r{i}", f"i{i}", CPU).lease_id for i in range(n)]
    return core, trainer, replicas


def ok(version: int, **kw: object) -> AckReport:
    return AckReport(version, TABLE.table_digest, True, {SyncPhase.TOTAL: 0.01}, **kw)  # type: ignore[arg-type]


def test_all_live_policy_and_superseded() -> None:
    core, t, (r0, r1) = fleet(2)
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, ok(v1)) is VersionState.STAGING
    assert core.ack(r1, ok(v1)) is VersionState.READY
    v2 = core.open_version(t, "job", "t1", 2, TABLE).version
    assert v2 == v1 + 1
    core.ack(r0, ok(v2))
    core.ack(r1, ok(v2))
    states = {v.version: v.state for v in core.list_versions("job")}
    assert states == {v1: VersionState.SUPERSEDED, v2: VersionState.READY}


def test_quorum_policy() -> None:
    core, t, (r0, _r1, _r2) = fleet(3, JobPolicy(ack_quorum=1))
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, ok(v)) is VersionState.READY


def test_failed_ack_fails_all_live_policy_and_names_the_replica() -> None:
    core, t, (r0, _r1) = fleet(2)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.ack(r0, AckReport(v, TABLE.table_digest, ok=False, error="digest mismatch in layer 3"))
    info = core.list_versions("job")[0]
    assert info.state is VersionState.FAILED and "r0: digest mismatch in layer 3" in info.reason


def test_wrong_table_digest_is_a_failed_ack() -> None:
    core, t, (r0,) = fleet(1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, AckReport(v, "sha256:other", ok=True)) is VersionState.FAILED
    assert "loaded a different table" in core.list_versions("job")[0].replicas[0].error


def test_dead_replica_is_dropped_and_does_not_fail_the_others() -> None:
    core, t, (r0, r1) = fleet(2, ttl=0.2)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.report_progress(r0, v, Progress.READY_TO_RECEIVE)
    core.report_progress(r1, v, Progress.READY_TO_RECEIVE)
    core.ack(r0, ok(v))
    deadline = time.monotonic() + 5
    while core.list_versions("job")[0].state is VersionState.STAGING and time.monotonic() < deadline:
        core.renew(t)
        core.renew(r0)  # r1 stops renewing
        time.sleep(0.05)
        core.tick()
    info = core.list_versions("job")[0]
    assert info.state is VersionState.READY and "1 dropped" in info.reason
    assert {r.replica_id: r.status for r in info.replicas} == {"r0": "acked", "r1": "dropped"}


def test_trainer_lost_mid_publish_fails_the_version_and_aborts_replicas() -> None:
    core, t, (r0,) = fleet(1, ttl=0.2)
    events = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert events.get(timeout=1).kind is EventKind.ASSIGN  # type: ignore[union-attr]
    for _ in range(6):  # the replica renews, the trainer does not
        time.sleep(0.06)
        core.renew(r0)
        core.tick()
    info = core.list_versions("job")[0]
    assert info.version == v and info.state is VersionState.FAILED and "trainer lost mid-publish" in info.reason
    abort = events.get(timeout=1)
    assert abort is not None and abort.kind is EventKind.ABORT and abort.version == v


def test_abort_event_when_a_version_fails() -> None:
    core, t, (r0, r1) = fleet(2)
    events = core.subscribe(r1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.ack(r0, AckReport(v, TABLE.table_digest, ok=False, error="boom"))
    kinds = [events.get(timeout=1).kind for _ in range(2)]  # type: ignore[union-attr]
    assert kinds == [EventKind.ASSIGN, EventKind.ABORT]


def test_version_timeout() -> None:
    core, t, _ = fleet(1, JobPolicy(version_timeout_s=0.05))
    core.open_version(t, "job", "t1", 1, TABLE)
    time.sleep(0.1)
    core.tick()
    info = core.list_versions("job")[0]
    assert info.state is VersionState.FAILED and "timed out after 0.05s waiting for r0" in info.reason


def test_open_is_idempotent_and_steps_never_go_backwards() -> None:
    core, t, _ = fleet(1)
    first = core.open_version(t, "job", "t1", 5, TABLE)
    again = core.open_version(t, "job", "t1", 5, TABLE)
    assert again.version == first.version and again.reused and again.plans == first.plans
    with pytest.raises(faults.FailedPrecondition, match=r"step 4 goes backwards.*already published step 5"):
        core.open_version(t, "job", "t1", 4, TABLE)
    # a restarted trainer (new incarnation) may publish from an older step: the version number still grows
    t2 = core.register("job", Role.TRAINER, "trainer", "t2", CPU, offers=[OFFER]).lease_id
    assert core.open_version(t2, "job", "t2", 4, TABLE).version == first.version + 1


def test_errors_name_the_field_and_fix() -> None:
    core, t, (r0,) = fleet(1)
    with pytest.raises(faults.NotFound, match="job 'nope' is unknown"):
        core.open_version(t, "nope", "t1", 1, TABLE)
    with pytest.raises(faults.PermissionDenied, match="needs a trainer lease"):
        core.open_version(r0, "job", "i0", 1, TABLE)
    with pytest.raises(faults.InvalidArgument, match="job 'Bad_Name' is not a valid name"):
        core.register("Bad_Name", Role.REPLICA, "x", "i", CPU)
    with pytest.raises(faults.NotFound, match="unknown or expired; register again"):
        core.renew("0" * 32)
    with pytest.raises(faults.NotFound, match="has no version 9"):
        core.ack(r0, ok(9))
    with pytest.raises(faults.InvalidArgument, match="manifest_sha256"):
        core.mark_durable("job", 1, "/ckpt/v1/manifest.json", "xyz")


def test_late_joiner_catches_up_from_newest_durable_ready() -> None:
    core, t, (r0,) = fleet(1)
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    core.ack(r0, ok(v1))
    core.mark_durable("job", v1, "/ckpt/v00000001/manifest.json", "a" * 64)
    v2 = core.open_version(t, "job", "t1", 2, TABLE).version
    core.ack(r0, ok(v2))  # v2 READY but not durable: catch-up still uses v1
    late = core.register("job", Role.REPLICA, "late", "il", CPU).lease_id
    event = core.subscribe(late).get(timeout=1)
    assert event is not None and event.kind is EventKind.CATCH_UP and event.version == v1
    assert event.plan is not None and event.plan.channel is Channel.VOLUME
    assert event.plan.rendezvous.volume_path == "/ckpt"


def test_wait_receivers_ready_and_settled() -> None:
    core, t, (r0,) = fleet(1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.wait_version("job", v, WaitFor.RECEIVERS_READY, 0.01)[1] is False
    core.report_progress(r0, v, Progress.READY_TO_RECEIVE)
    assert core.wait_version("job", v, WaitFor.RECEIVERS_READY, 0.01)[1] is True
    assert core.wait_version("job", v, WaitFor.SETTLED, 0.01)[1] is False


def test_replica_reconnect_keeps_its_place_restart_loses_it() -> None:
    core, t, _ = fleet(2)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.register("job", Role.REPLICA, "r0", "i0", CPU)  # same incarnation: still planned
    assert {r.replica_id: r.status for r in core.list_versions("job")[0].replicas}["r0"] == "planned"
    core.register("job", Role.REPLICA, "r1", "new", CPU)  # restarted: dropped from v
    statuses = {r.replica_id: r.status for r in core.list_versions("job")[0].replicas}
    assert statuses["r1"] == "dropped" and v == 1


def test_metrics_after_a_sync() -> None:
    registry = CollectorRegistry()
    core, t, (r0, r1) = fleet(2, registry=registry)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.ack(r0, ok(v))
    core.ack(r1, ok(v))

    def value(name: str, **labels: str) -> float | None:
        core.refresh_metrics()  # gauges are recomputed on ticks and scrapes, not per ack
        return registry.get_sample_value(name, labels)

    assert value("weightsync_negotiations_total", channel="cpu") == 2
    assert value("weightsync_versions", state="READY") == 1
    assert value("weightsync_replicas", state="current") == 2
    assert value("weightsync_transferred_bytes_total", channel="cpu") == 6000
    assert value("weightsync_sync_duration_seconds_count", phase="total", channel="cpu") == 2
    assert value("weightsync_fleet_version_lag_max") == 0
    core.register("job", Role.REPLICA, "late", "il", CPU)
    assert value("weightsync_fleet_replicas_lagging") == 1 and value("weightsync_fleet_version_lag_max") == 1


def test_a_new_stream_ends_the_old_one_and_gets_the_missed_assignment() -> None:
    core, t, (r0,) = fleet(1)
    first = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    second = core.subscribe(r0)  # the client reconnected before the old stream read the assignment
    assert first.get(timeout=1) is None  # the old stream is told to end; its unread events moved over
    again = second.get(timeout=1)
    assert again is not None and again.kind is EventKind.ASSIGN and again.version == v


def test_mark_durable_checks_a_manifest_it_can_read(tmp_path: Path) -> None:
    core, t, _ = fleet(1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    with pytest.raises(faults.InvalidArgument, match=r"does not match .*manifest\.json"):
        core.mark_durable("job", v, str(manifest), "b" * 64)
    info = core.mark_durable("job", v, str(manifest), hashlib.sha256(b"{}").hexdigest())
    assert info.durable and info.manifest_path == str(manifest)


def test_a_replica_that_stops_watching_is_not_planned() -> None:
    core, t, (r0, r1) = fleet(2, ttl=0.3)
    core.subscribe(r0)
    core.subscribe(r1)
    core.stream_ended(r1)  # r1's agent stopped reading its stream but keeps renewing
    time.sleep(0.35)
    core.renew(t)
    core.renew(r0)
    core.renew(r1)
    opened = core.open_version(t, "job", "t1", 1, TABLE)
    assert [p.replica_id for p in opened.plans] == ["r0"]
