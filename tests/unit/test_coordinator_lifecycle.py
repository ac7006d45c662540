"""Version lifecycle and leases on the core (no gRPC): ack policies, drops, failures, idempotency, the volume.

Time is a ``ManualClock``: a lease or a version timeout runs out when a test advances the clock and calls
``core.tick()`` (the reaper's step), never by sleeping. The durations used are exact in binary floating point
(30 = 15 + 15 = 29.5 + 0.5), so "at the TTL" means exactly at it.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from weightsync import metrics
from weightsync.channels.base import Endpoint, Offer
from weightsync.channels.manifests import Manifest
from weightsync.coordinator import faults
from weightsync.coordinator.clock import ManualClock
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import (
    AckReport,
    Assignment,
    Capabilities,
    EventKind,
    JobPolicy,
    Progress,
    Role,
    SentReport,
    TableSummary,
    VersionInfo,
    WaitFor,
)
from weightsync.coordinator.store import MemoryStore
from weightsync.tensors import DIGEST_PREFIX, TensorTable, content_digest, manifest_checksum
from weightsync.vocabulary import Channel, ReplicaState, SyncPhase, VersionState

pytestmark = pytest.mark.unit

TABLE = TableSummary(3, 3000, DIGEST_PREFIX + "1" * 64)
OTHER_LAYOUT = DIGEST_PREFIX + "2" * 64
SENT = DIGEST_PREFIX + "c" * 64
"""The content digest the trainer sent."""
CORRUPT = DIGEST_PREFIX + "d" * 64
CPU = Capabilities(host="n", channels=(Channel.CPU, Channel.VOLUME), volume_id="vol", volume_mount="/ckpt")
VOLUME_ONLY = Capabilities(host="n", channels=(Channel.VOLUME,), volume_id="vol", volume_mount="/ckpt")
CPU_OFFER = Offer(Channel.CPU, Endpoint("127.0.0.1", 29500))
OFFERS = (CPU_OFFER, Offer(Channel.VOLUME))


def fleet(
    n: int,
    policy: JobPolicy | None = None,
    ttl: float = 30.0,
    registry: CollectorRegistry | None = None,
    volume: Path | None = None,
    offers: tuple[Offer, ...] = OFFERS,
    clock: ManualClock | None = None,
) -> tuple[Coordinator, str, list[str]]:
    """A trainer and ``n`` replicas registered at the same instant of ``clock`` (a fresh one when None)."""
    core = Coordinator(
        lease_ttl_s=ttl,
        store=MemoryStore(),
        metrics=metrics.CoordinatorMetrics.create(registry) if registry else None,
        volumes={"job": volume} if volume is not None else None,
        clock=clock if clock is not None else ManualClock(),
    )
    trainer = core.register("job", Role.TRAINER, "trainer", "t1", CPU, policy=policy, offers=offers).lease_id
    replicas = [core.register("job", Role.REPLICA, f"r{i}", f"i{i}", CPU).lease_id for i in range(n)]
    return core, trainer, replicas


def ok(version: int, **kw: object) -> AckReport:
    return AckReport(version, TABLE.layout_digest, True, {SyncPhase.TOTAL: 0.01}, **kw)  # type: ignore[arg-type]


def failed(version: int, error: str, **kw: object) -> AckReport:
    return AckReport(version, TABLE.layout_digest, ok=False, error=error, **kw)  # type: ignore[arg-type]


def write_manifest(root: Path, version: int, digests: dict[str, str] | None = None) -> tuple[Path, str]:
    """A version's manifest where the coordinator looks for it (``<root>/v%08d/manifest.json``), and its checksum;
    ``digests``: the per-tensor digests it lists (none: written with verification off)."""
    names = sorted(digests or {"w": ""})
    table = TensorTable.build([[(name, "bfloat16", (4,)) for name in names]])
    shard = "shard-00000.safetensors"
    manifest = Manifest(
        version, version, table.with_digests(digests) if digests else table, dict.fromkeys(names, shard),
        {shard: (8 * len(names), "0" * 64)}, 0.0,
    )  # fmt: skip
    data = manifest.to_json().encode()
    path = root / f"v{version:08d}" / "manifest.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return path, manifest_checksum(data)


def statuses(info: VersionInfo) -> dict[str, ReplicaState]:
    return {r.replica_id: r.state for r in info.replicas}


def latest(core: Coordinator) -> VersionInfo:
    return core.list_versions("job")[0]


def sent(core: Coordinator, trainer: str, version: int, digest: str = "") -> VersionInfo:
    """The publisher's report of what it sent, as it makes it right after streaming (before waiting for the
    verdict): no version becomes READY before it. ``digest`` is what the replicas ack ("" when they ack none)."""
    return core.report_sent(trainer, version, SentReport(digest, {}))


def next_event(events: queue.SimpleQueue[Assignment | None]) -> Assignment:
    event = events.get(timeout=1)
    assert event is not None
    return event


# ---- ack policies ---------------------------------------------------------------------------------------------


def test_all_live_policy_and_superseded() -> None:
    core, t, (r0, r1) = fleet(2)
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v1)
    assert core.ack(r0, ok(v1)) is VersionState.STAGING
    assert core.ack(r1, ok(v1)) is VersionState.READY
    v2 = core.open_version(t, "job", "t1", 2, TABLE).version
    assert v2 == v1 + 1
    sent(core, t, v2)
    core.ack(r0, ok(v2))
    core.ack(r1, ok(v2))
    states = {v.version: v.state for v in core.list_versions("job")}
    assert states == {v1: VersionState.SUPERSEDED, v2: VersionState.READY}


def test_quorum_policy() -> None:
    core, t, (r0, _r1, _r2) = fleet(3, JobPolicy(ack_quorum=1))
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v)
    assert core.ack(r0, ok(v)) is VersionState.READY


def test_a_version_planned_for_no_replica_is_never_ready_without_acks_unless_the_policy_says_so() -> None:
    core, t, _ = fleet(0)
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    info = sent(core, t, v1)
    assert info.state is VersionState.FAILED and "planned for no replica, so none acked it" in info.reason
    assert core.get_job("job").newest_ready == 0

    core, t, _ = fleet(0, JobPolicy(ready_without_acks=True))
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    assert latest(core).state is VersionState.STAGING  # READY still waits for what the trainer sent
    info = sent(core, t, v1)
    assert info.state is VersionState.READY and "policy allows READY without acks" in info.reason


def test_a_version_whose_replicas_all_dropped_unacked_fails_under_any_policy() -> None:
    clock = ManualClock()
    core, t, _ = fleet(1, JobPolicy(ready_without_acks=True), ttl=30.0, clock=clock)
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v1)
    clock.advance(15.0)
    core.renew(t)
    clock.advance(15.0)
    core.tick()
    info = latest(core)
    assert info.state is VersionState.FAILED and "no planned replica acknowledged it (1 dropped)" in info.reason


def test_failed_ack_fails_all_live_policy_and_names_the_replica() -> None:
    core, t, (r0, _r1) = fleet(2)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.ack(r0, failed(v, "digest mismatch in layer 3"))
    info = latest(core)
    assert info.state is VersionState.FAILED and "r0: digest mismatch in layer 3" in info.reason
    assert statuses(info) == {"r0": ReplicaState.FAILED, "r1": ReplicaState.PLANNED}


def test_wrong_layout_digest_is_a_failed_ack() -> None:
    core, t, (r0,) = fleet(1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, AckReport(v, OTHER_LAYOUT, ok=True)) is VersionState.FAILED
    replica = latest(core).replicas[0]
    assert replica.state is ReplicaState.FAILED and "loaded a different table" in replica.error


def test_dead_replica_is_dropped_and_does_not_fail_the_others() -> None:
    clock = ManualClock()
    core, t, (r0, r1) = fleet(2, ttl=30.0, clock=clock)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.report_progress(r0, v, Progress.JOINED)
    core.report_progress(r1, v, Progress.JOINED)
    sent(core, t, v)
    core.ack(r0, ok(v))
    clock.advance(15.0)
    core.renew(t)
    core.renew(r0)  # r1 stops renewing: only time passing expires its lease
    core.tick()
    assert latest(core).state is VersionState.STAGING  # r1's lease has 15 s left
    clock.advance(15.0)
    core.tick()
    info = latest(core)
    assert info.state is VersionState.READY and "1 dropped" in info.reason
    assert statuses(info) == {"r0": ReplicaState.LOADED, "r1": ReplicaState.DROPPED}


def test_trainer_lost_mid_publish_fails_the_version_and_aborts_replicas() -> None:
    clock = ManualClock()
    core, t, (r0,) = fleet(1, ttl=30.0, clock=clock)
    events = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert next_event(events).kind is EventKind.ASSIGN
    for _ in range(2):  # the replica renews, the trainer does not
        clock.advance(15.0)
        core.renew(r0)
        core.tick()
    info = latest(core)
    assert info.version == v and info.state is VersionState.FAILED and "trainer lost mid-publish" in info.reason
    abort = next_event(events)
    assert abort.kind is EventKind.ABORT and abort.version == v


def test_abort_event_when_a_version_fails() -> None:
    core, t, (r0, r1) = fleet(2)
    events = core.subscribe(r1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.ack(r0, failed(v, "boom"))
    assign, abort = next_event(events), next_event(events)
    assert (assign.kind, abort.kind) == (EventKind.ASSIGN, EventKind.ABORT)
    assert assign.plan is not None and assign.plan.channel is Channel.CPU and assign.table == TABLE
    assert assign.plan.rendezvous.endpoint == CPU_OFFER.endpoint and assign.plan.rendezvous.secret


def test_a_version_that_fails_after_a_replica_loaded_it_tells_that_replica_too() -> None:
    """A FAILED version is served by no replica: the one that loaded it gets an ABORT (its agent rolls back)."""
    core, t, (r0, r1) = fleet(2)
    events = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v)
    core.ack(r0, ok(v))
    assert next_event(events).kind is EventKind.ASSIGN
    core.ack(r1, failed(v, "boom"))
    info = latest(core)
    assert info.state is VersionState.FAILED and statuses(info)["r0"] is ReplicaState.LOADED
    abort = next_event(events)
    assert (abort.kind, abort.version) == (EventKind.ABORT, v) and "boom" in abort.reason


def test_version_timeout() -> None:
    clock = ManualClock()
    core, t, _ = fleet(1, JobPolicy(version_timeout_s=0.05), clock=clock)
    core.open_version(t, "job", "t1", 1, TABLE)
    clock.advance(0.1)
    core.tick()
    info = latest(core)
    assert info.state is VersionState.FAILED and "timed out after 0.05s waiting for r0" in info.reason


# ---- time: leases, version timeouts, waits -----------------------------------------------------------------------


def test_a_lease_expires_exactly_at_its_ttl() -> None:
    registry = CollectorRegistry()
    clock = ManualClock()
    core, t, (r0,) = fleet(1, ttl=30.0, registry=registry, clock=clock)
    clock.advance(29.5)
    core.renew(t)
    core.tick()
    (replica,) = [m for m in core.get_job("job").members if m.member_id == "r0"]
    assert replica.lease_expires_in_s == 0.5  # not before: still a member, half a second left
    clock.advance(0.5)  # exactly 30 s after its registration
    core.tick()
    assert [m.member_id for m in core.get_job("job").members] == ["trainer"]
    with pytest.raises(faults.NotFound, match="unknown or expired; register again"):
        core.renew(r0)
    assert registry.get_sample_value("weightsync_leases_expired_total", {"role": "replica"}) == 1


def test_a_renewed_lease_runs_a_full_ttl_from_the_renewal() -> None:
    clock = ManualClock()
    core, t, (r0,) = fleet(1, ttl=30.0, clock=clock)
    clock.advance(20.0)
    assert core.renew(r0).ttl_s == 30.0
    clock.advance(29.5)  # 49.5 s after registration, 29.5 s after the renewal
    core.renew(t)
    core.tick()
    assert {m.member_id for m in core.get_job("job").members} == {"trainer", "r0"}
    clock.advance(0.5)
    core.tick()
    assert {m.member_id for m in core.get_job("job").members} == {"trainer"}


def test_a_staging_version_times_out_exactly_at_the_policy_timeout() -> None:
    clock = ManualClock()
    core, t, (r0,) = fleet(1, JobPolicy(version_timeout_s=10.0), clock=clock)
    events = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert next_event(events).kind is EventKind.ASSIGN
    clock.advance(9.75)
    core.tick()
    assert latest(core).state is VersionState.STAGING  # not before
    clock.advance(0.25)  # exactly 10 s after it was opened
    core.tick()
    info = latest(core)
    assert info.version == v and info.state is VersionState.FAILED
    assert info.reason == "timed out after 10s waiting for r0, the publisher's report of what it sent"
    assert info.settled_at == clock.time() and info.opened_at == clock.time() - 10.0  # wall time from the clock too
    abort = next_event(events)
    assert abort.kind is EventKind.ABORT and abort.version == v


def test_wait_version_wakes_on_a_notification_whatever_the_clock_says() -> None:
    core, t, (r0,) = fleet(1)  # a ManualClock that never moves: only the join can end the wait
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    result: list[tuple[VersionInfo, bool]] = []
    waiter = threading.Thread(target=lambda: result.append(core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 60)))
    waiter.start()
    core.report_progress(r0, v, Progress.JOINED)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    ((info, met),) = result
    assert met and statuses(info) == {"r0": ReplicaState.JOINED}


def test_wait_version_times_out_by_the_clock() -> None:
    clock = ManualClock()
    core, t, _ = fleet(1, clock=clock)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    result: list[tuple[VersionInfo, bool]] = []
    waiter = threading.Thread(target=lambda: result.append(core.wait_version("job", v, WaitFor.SETTLED, 0.05)))
    waiter.start()
    for _ in range(600):  # each real wait is bounded by the 0.05 s the clock says are left: it sees the advance
        clock.advance(1.0)
        waiter.join(timeout=0.05)
        if not waiter.is_alive():
            break
    assert not waiter.is_alive()
    ((info, met),) = result
    assert not met and info.state is VersionState.STAGING


def test_open_is_idempotent_and_steps_never_go_backwards() -> None:
    core, t, _ = fleet(1)
    first = core.open_version(t, "job", "t1", 5, TABLE)
    again = core.open_version(t, "job", "t1", 5, TABLE)
    assert again.version == first.version and again.reused and again.plans == first.plans
    with pytest.raises(faults.FailedPrecondition, match=r"step 4 goes backwards.*already published step 5"):
        core.open_version(t, "job", "t1", 4, TABLE)
    # a restarted trainer (new incarnation) may publish from an older step: the version number still grows
    t2 = core.register("job", Role.TRAINER, "trainer", "t2", CPU, offers=OFFERS).lease_id
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
    with pytest.raises(faults.InvalidArgument, match=r"manifest_checksum 'xyz' is not sha256:<64 hex>"):
        core.mark_durable("job", 1, "/ckpt/v00000001/manifest.json", "xyz")
    with pytest.raises(faults.InvalidArgument, match=r"manifest_checksum .* is not sha256"):
        core.mark_durable("job", 1, "/ckpt/v00000001/manifest.json", "a" * 64)  # the bare hex of old
    with pytest.raises(faults.PermissionDenied, match="needs a trainer lease"):
        core.report_sent(r0, 1, SentReport(SENT, {}))


def test_late_joiner_catches_up_from_newest_durable_ready() -> None:
    core, t, (r0,) = fleet(1)
    checksum = manifest_checksum(b"v1")
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v1)
    core.ack(r0, ok(v1))
    core.mark_durable("job", v1, "/ckpt/v00000001/manifest.json", checksum)
    v2 = core.open_version(t, "job", "t1", 2, TABLE).version
    sent(core, t, v2)
    core.ack(r0, ok(v2))  # v2 READY but not durable: catch-up still uses v1
    late = core.register("job", Role.REPLICA, "late", "il", CPU).lease_id
    event = next_event(core.subscribe(late))
    assert event.kind is EventKind.CATCH_UP and event.version == v1 and event.table == TABLE
    assert event.plan is not None and event.plan.channel is Channel.VOLUME
    assert event.plan.rendezvous.root == "/ckpt" and event.plan.manifest_checksum == checksum


def test_a_catch_up_is_shown_with_the_version_and_never_changes_its_verdict() -> None:
    core, t, (r0,) = fleet(1)
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v1, SENT)
    core.ack(r0, ok(v1, content_digest=SENT))
    late = core.register("job", Role.REPLICA, "late", "il", CPU).lease_id
    refused = "catch-up from the volume: sha256 ... does not match the manifest's; the version is refused"
    assert core.ack(late, failed(v1, refused)) is VersionState.READY
    info = latest(core)
    assert statuses(info) == {"r0": ReplicaState.LOADED, "late": ReplicaState.FAILED}
    assert {r.replica_id: r.error for r in info.replicas}["late"] == refused
    assert info.reason == "all 1 live replicas acked"
    # bytes other than the trainer's are a failure, even outside a plan
    core.ack(late, ok(v1, content_digest=CORRUPT))
    assert "is not the" in {r.replica_id: r.error for r in latest(core).replicas}["late"]
    core.ack(late, ok(v1, content_digest=SENT))
    info = latest(core)
    assert statuses(info)["late"] is ReplicaState.LOADED and not {r.replica_id: r.error for r in info.replicas}["late"]
    # a catch-up comes from the volume: the status says so, as it does for planned replicas
    assert {r.replica_id: r.channel for r in info.replicas} == {"r0": Channel.CPU, "late": Channel.VOLUME}
    assert {m.member_id: m.current_version for m in core.get_job("job").members}["late"] == v1


def test_wait_receivers_joined_and_settled() -> None:
    core, t, (r0,) = fleet(1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 0)[1] is False
    core.report_progress(r0, v, Progress.JOINED)
    info, met = core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 0)
    assert met and statuses(info) == {"r0": ReplicaState.JOINED}
    sent(core, t, v)  # streamed to everyone who joined
    assert core.wait_version("job", v, WaitFor.SETTLED, 0)[1] is False
    # nobody waits for the volume: the publisher need not write it before the version settles
    info, met = core.wait_version("job", v, WaitFor.SETTLED_OR_DURABLE_NEEDED, 0)
    assert not met and not info.durable_needed
    core.ack(r0, ok(v))
    info, met = core.wait_version("job", v, WaitFor.SETTLED, 0)
    assert met and info.state is VersionState.READY and statuses(info) == {"r0": ReplicaState.LOADED}


def test_replica_reconnect_keeps_its_place_restart_loses_it() -> None:
    core, t, _ = fleet(2)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.register("job", Role.REPLICA, "r0", "i0", CPU)  # same incarnation: still planned
    assert statuses(latest(core))["r0"] is ReplicaState.PLANNED
    core.register("job", Role.REPLICA, "r1", "new", CPU)  # restarted: dropped from v
    assert statuses(latest(core))["r1"] is ReplicaState.DROPPED and v == 1


def test_a_replica_dropped_from_a_version_that_catches_it_up_shows_the_volume_not_its_plan() -> None:
    # found by the fleet's killed-mid-transfer fault: the restarted replica's catch-up read as "loaded over nccl"
    core, t, (r0, _) = fleet(2)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    new = core.register("job", Role.REPLICA, "r1", "new", CPU).lease_id  # killed and restarted: dropped from v
    sent(core, t, v)
    core.ack(r0, ok(v))
    assert core.ack(new, ok(v)) is VersionState.READY  # its catch-up, from the volume
    info = latest(core)
    assert statuses(info) == {"r0": ReplicaState.LOADED, "r1": ReplicaState.LOADED}
    assert {r.replica_id: r.channel for r in info.replicas} == {"r0": Channel.CPU, "r1": Channel.VOLUME}


def test_metrics_after_a_sync() -> None:
    registry = CollectorRegistry()
    core, t, (r0, r1) = fleet(2, registry=registry)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v)
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
    again = next_event(second)
    assert again.kind is EventKind.ASSIGN and again.version == v


def test_a_replica_that_stops_watching_is_not_planned() -> None:
    clock = ManualClock()
    core, t, (r0, r1) = fleet(2, ttl=30.0, clock=clock)
    core.subscribe(r0)
    core.subscribe(r1)
    core.stream_ended(r1)  # r1's agent stopped reading its stream but keeps renewing
    for _ in range(2):  # "not watching for a lease TTL" is the rule under test: one TTL passes, every lease renewed
        clock.advance(15.0)
        core.renew(t)
        core.renew(r0)
        core.renew(r1)
        core.tick()
    opened = core.open_version(t, "job", "t1", 1, TABLE)
    assert [p.replica_id for p in opened.plans] == ["r0"]


# ---- durability and the volume ------------------------------------------------------------------------------------


def test_mark_durable_checks_the_manifest_on_its_own_volume(tmp_path: Path) -> None:
    core, t, _ = fleet(1, volume=tmp_path)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    with pytest.raises(faults.FailedPrecondition, match="has no manifest on the coordinator's volume"):
        core.mark_durable("job", v, "/elsewhere/manifest.json", manifest_checksum(b"{}"))
    path, checksum = write_manifest(tmp_path, v)
    with pytest.raises(faults.InvalidArgument, match=r"does not match version 1's manifest on the volume"):
        core.mark_durable("job", v, str(path), manifest_checksum(b"something else"))
    assert not latest(core).durable
    # the coordinator reads its own mount: the client's path is not what it records
    info = core.mark_durable("job", v, "/publisher/mount/v00000001/manifest.json", checksum)
    assert info.durable and info.manifest_path == str(path) and info.manifest_checksum == checksum
    assert latest(core).manifest_checksum == checksum


def test_a_version_only_the_volume_carried_is_checked_against_what_the_trainer_wrote(tmp_path: Path) -> None:
    """Nothing streamed it (its one replica receives the volume alone), so the publisher reports no digest when it
    sent; what the trainer wrote is what the replica is held to, not another replica's word."""
    core, t, _ = fleet(0, volume=tmp_path)
    vol = core.register("job", Role.REPLICA, "vol", "iv", VOLUME_ONLY).lease_id
    core.subscribe(vol)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v)
    assert latest(core).content_digest == "" and latest(core).durable_needed
    written = {"a": "1" * 64, "b": "2" * 64}
    path, checksum = write_manifest(tmp_path, v, written)
    with pytest.raises(faults.InvalidArgument, match=r"content_digest .* is not the .* manifest lists"):
        core.mark_durable("job", v, str(path), checksum, CORRUPT)
    info = core.mark_durable("job", v, str(path), checksum, content_digest(written))
    assert info.durable and info.content_digest == content_digest(written)
    assert core.ack(vol, ok(v, content_digest=CORRUPT)) is VersionState.FAILED
    assert "is not the" in latest(core).reason and "the trainer sent" in latest(core).reason


def test_a_streamed_version_keeps_the_digest_the_trainer_reported_sent() -> None:
    """A volume copy's digest does not replace what the live channels carried: a replica that loads other bytes from
    the volume fails against the trainer's report, as any other would."""
    core, t, _ = fleet(1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v, SENT)
    info = core.mark_durable("job", v, "/ckpt/v00000001/manifest.json", manifest_checksum(b"m"), CORRUPT)
    assert info.durable and info.content_digest == SENT
    # without a mount the publisher's claim stands: it is recorded for a version nothing streamed
    v2 = core.open_version(t, "job", "t1", 2, TABLE).version
    sent(core, t, v2)
    assert core.mark_durable("job", v2, "/ckpt/v00000002/manifest.json", manifest_checksum(b"n"), SENT).content_digest
    with pytest.raises(faults.InvalidArgument, match=r"content_digest 'x' is not sha256"):
        core.mark_durable("job", v2, "/ckpt/v00000002/manifest.json", manifest_checksum(b"n"), "x")


def test_superseded_versions_keep_their_own_settle_times() -> None:
    clock = ManualClock()
    core, t, (r0,) = fleet(1, ttl=1000.0, clock=clock)
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v1)
    core.ack(r0, ok(v1))
    ready_at = latest(core).settled_at
    clock.advance(30.0)
    v2 = core.open_version(t, "job", "t1", 2, TABLE).version
    sent(core, t, v2)
    core.ack(r0, ok(v2))
    settled = {v.version: (v.state, v.settled_at) for v in core.list_versions("job")}
    assert settled == {v1: (VersionState.SUPERSEDED, ready_at), v2: (VersionState.READY, ready_at + 30.0)}


def test_mark_durable_without_a_volume_records_the_publishers_claim() -> None:
    core, t, _ = fleet(1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    checksum = manifest_checksum(b"not on this machine")
    info = core.mark_durable("job", v, "/ckpt/v00000001/manifest.json", checksum)
    assert info.durable and info.manifest_path == "/ckpt/v00000001/manifest.json"
    assert info.manifest_checksum == checksum


def test_a_failed_volume_copy_fails_the_replicas_waiting_for_it_at_once(tmp_path: Path) -> None:
    core, t, (r0,) = fleet(1, volume=tmp_path)
    vol = core.register("job", Role.REPLICA, "vol", "iv", VOLUME_ONLY).lease_id
    core.subscribe(vol)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert sent(core, t, v, SENT).durable_needed
    core.ack(r0, ok(v, content_digest=SENT))
    assert latest(core).state is VersionState.STAGING  # "vol" waits for the copy
    info = core.report_sent(t, v, SentReport(SENT, {}, volume_error="[Errno 28] No space left on device"))
    assert info.state is VersionState.FAILED and statuses(info)["vol"] is ReplicaState.FAILED
    assert (
        "could not write the volume copy: [Errno 28] No space left"
        in {r.replica_id: r.error for r in info.replicas}["vol"]
    )
    assert "vol" in info.reason and not info.durable_needed


def test_a_volume_planned_replica_is_assigned_only_once_the_version_is_durable(tmp_path: Path) -> None:
    core, t, (r0,) = fleet(1, volume=tmp_path)
    vol = core.register("job", Role.REPLICA, "vol", "iv", VOLUME_ONLY).lease_id
    live_events, vol_events = core.subscribe(r0), core.subscribe(vol)
    opened = core.open_version(t, "job", "t1", 1, TABLE)
    v = opened.version
    assert {p.replica_id: p.channel for p in opened.plans} == {"r0": Channel.CPU, "vol": Channel.VOLUME}
    assert opened.receivers(Channel.CPU).keys() == {"r0"} and opened.receivers(Channel.VOLUME).keys() == {"vol"}
    assert next_event(live_events).kind is EventKind.ASSIGN  # the live replica is assigned at once
    assert vol_events.empty()  # the volume replica is not: there is nothing to load yet
    info = latest(core)
    assert info.durable_needed and not info.durable
    # the publisher's wait returns as soon as someone waits for the volume copy
    info, met = core.wait_version("job", v, WaitFor.SETTLED_OR_DURABLE_NEEDED, 0)
    assert met and info.durable_needed and info.state is VersionState.STAGING
    # receivers_joined counts only replicas planned on a live channel
    assert core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 0)[1] is False
    core.report_progress(r0, v, Progress.JOINED)
    info, met = core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 0)
    assert met and statuses(info) == {"r0": ReplicaState.JOINED, "vol": ReplicaState.PLANNED}
    # streamed to r0: the report says the volume copy is needed, so the publisher writes it
    info = sent(core, t, v)
    assert info.durable_needed and info.state is VersionState.STAGING
    # a new stream before the copy landed does not get the assignment either
    vol_events = core.subscribe(vol)
    assert vol_events.empty()

    path, checksum = write_manifest(tmp_path, v)
    info = core.mark_durable("job", v, str(path), checksum)
    assert info.durable and not info.durable_needed
    event = next_event(vol_events)
    assert event.kind is EventKind.ASSIGN and event.version == v and event.table == TABLE
    assert event.plan is not None and event.plan.channel is Channel.VOLUME
    assert event.plan.manifest_checksum == checksum and event.plan.rendezvous.root == "/ckpt"
    assert vol_events.empty() and live_events.empty()
    # a stream opened now is primed with the same assignment, checksum included
    again = next_event(core.subscribe(vol))
    assert again.kind is EventKind.ASSIGN and again.plan == event.plan

    core.ack(r0, ok(v))
    assert core.ack(vol, ok(v)) is VersionState.READY
    assert statuses(latest(core)) == {"r0": ReplicaState.LOADED, "vol": ReplicaState.LOADED}


def test_a_version_for_volume_replicas_only_needs_no_live_receiver(tmp_path: Path) -> None:
    core, t, _ = fleet(0, volume=tmp_path)
    vol = core.register("job", Role.REPLICA, "vol", "iv", VOLUME_ONLY).lease_id
    events = core.subscribe(vol)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    info, met = core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 0)
    assert met and info.durable_needed and events.empty()
    assert sent(core, t, v).durable_needed  # nothing to stream: the publisher reports at once
    path, checksum = write_manifest(tmp_path, v)
    core.mark_durable("job", v, str(path), checksum)
    assert next_event(events).plan.manifest_checksum == checksum  # type: ignore[union-attr]
    assert core.ack(vol, ok(v)) is VersionState.READY


def test_a_failed_live_channel_falls_back_to_the_volume_for_the_same_version(tmp_path: Path) -> None:
    clock = ManualClock()
    core, t, (r0,) = fleet(1, volume=tmp_path, ttl=1000.0, clock=clock)
    events = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert next_event(events).plan.channel is Channel.CPU  # type: ignore[union-attr]
    core.report_progress(r0, v, Progress.JOINED)

    state = core.ack(r0, failed(v, "gloo: connection reset", channel_failed=True))
    assert state is VersionState.STAGING  # not FAILED: r0 loads v from the volume instead
    info = latest(core)
    (replica,) = info.replicas
    assert replica.state is ReplicaState.PLANNED and replica.channel is Channel.VOLUME
    assert "cpu failed, loading from the volume: gloo: connection reset" in replica.error
    assert info.durable_needed and info.state is VersionState.STAGING
    sent(core, t, v)
    assert core.wait_version("job", v, WaitFor.SETTLED_OR_DURABLE_NEEDED, 0)[1] is True
    assert core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 0)[1] is True
    assert events.empty()  # not durable yet: nothing to load

    path, checksum = write_manifest(tmp_path, v)
    core.mark_durable("job", v, str(path), checksum)
    event = next_event(events)
    assert event.kind is EventKind.ASSIGN and event.version == v and event.plan is not None
    assert event.plan.channel is Channel.VOLUME and event.plan.manifest_checksum == checksum
    assert event.plan.rendezvous.root == "/ckpt" and "cpu failed" in event.plan.reason
    assert core.ack(r0, ok(v)) is VersionState.READY

    # the failed channel is skipped for this replica for 30 s, then tried again
    opened = core.open_version(t, "job", "t1", 2, TABLE)
    assert [p.channel for p in opened.plans] == [Channel.VOLUME]
    assert events.empty()
    clock.advance(29.5)
    v3 = core.open_version(t, "job", "t1", 3, TABLE)
    assert [p.channel for p in v3.plans] == [Channel.VOLUME]
    clock.advance(0.5)
    v4 = core.open_version(t, "job", "t1", 4, TABLE).version
    assert [p.channel for p in latest(core).replicas] == [Channel.CPU]
    # failing again keeps it off twice as long; a load over it clears that
    core.ack(r0, failed(v4, "gloo: connection reset", channel_failed=True))
    clock.advance(59.5)
    assert [p.channel for p in core.open_version(t, "job", "t1", 5, TABLE).plans] == [Channel.VOLUME]
    clock.advance(0.5)
    v6 = core.open_version(t, "job", "t1", 6, TABLE).version
    assert [p.channel for p in latest(core).replicas] == [Channel.CPU]
    sent(core, t, v6)
    assert core.ack(r0, ok(v6)) is VersionState.READY
    v7 = core.open_version(t, "job", "t1", 7, TABLE).version
    core.ack(r0, failed(v7, "gloo: connection reset", channel_failed=True))
    clock.advance(30.0)  # the count started over: 30 s again, not 120
    assert [p.channel for p in core.open_version(t, "job", "t1", 8, TABLE).plans] == [Channel.CPU]


def test_a_fallback_on_a_durable_version_is_assigned_at_once(tmp_path: Path) -> None:
    core, t, (r0,) = fleet(1, volume=tmp_path)
    events = core.subscribe(r0)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    path, checksum = write_manifest(tmp_path, v)
    core.mark_durable("job", v, str(path), checksum)
    assert next_event(events).plan.channel is Channel.CPU  # type: ignore[union-attr]
    assert core.ack(r0, failed(v, "reset", channel_failed=True)) is VersionState.STAGING
    event = next_event(events)
    assert event.kind is EventKind.ASSIGN and event.plan is not None
    assert event.plan.channel is Channel.VOLUME and event.plan.manifest_checksum == checksum
    assert not latest(core).durable_needed


@pytest.mark.parametrize(
    ("replica", "offers"),
    [
        pytest.param(Capabilities(host="n", channels=(Channel.CPU,)), OFFERS, id="no-shared-volume"),
        pytest.param(CPU, (CPU_OFFER,), id="volume-not-offered"),
    ],
)
def test_a_failed_channel_without_a_volume_to_fall_back_to_fails_the_version(
    replica: Capabilities, offers: tuple[Offer, ...]
) -> None:
    core, t, _ = fleet(0, offers=offers)
    r = core.register("job", Role.REPLICA, "r", "ir", replica).lease_id
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r, failed(v, "reset", channel_failed=True)) is VersionState.FAILED
    info = latest(core)
    assert statuses(info) == {"r": ReplicaState.FAILED} and "r: reset" in info.reason


def test_a_volume_failure_is_not_retried_on_the_volume(tmp_path: Path) -> None:
    core, t, _ = fleet(0, volume=tmp_path)
    vol = core.register("job", Role.REPLICA, "vol", "iv", VOLUME_ONLY).lease_id
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    path, checksum = write_manifest(tmp_path, v)
    core.mark_durable("job", v, str(path), checksum)
    assert core.ack(vol, failed(v, "shard missing", channel_failed=True)) is VersionState.FAILED


# ---- content digests ------------------------------------------------------------------------------------------------


POLICIES = [pytest.param(JobPolicy(), id="all-live"), pytest.param(JobPolicy(ack_quorum=1), id="quorum-1")]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_version_is_ready_only_once_the_publisher_reported_what_it_sent(policy: JobPolicy) -> None:
    core, t, (r0, r1) = fleet(2, policy)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    # the replicas load fast: every planned one acks before the publisher's report arrives
    assert core.ack(r0, ok(v, content_digest=SENT)) is VersionState.STAGING
    assert core.ack(r1, ok(v, content_digest=SENT)) is VersionState.STAGING
    info, met = core.wait_version("job", v, WaitFor.SETTLED, 0)
    assert not met and info.state is VersionState.STAGING and not info.content_digest
    assert statuses(info) == {"r0": ReplicaState.LOADED, "r1": ReplicaState.LOADED}
    assert core.get_job("job").newest_ready == 0
    # the report with the digest they acked settles it
    info = sent(core, t, v, SENT)
    assert info.state is VersionState.READY and info.content_digest == SENT
    assert statuses(info) == {"r0": ReplicaState.LOADED, "r1": ReplicaState.LOADED}
    assert core.wait_version("job", v, WaitFor.SETTLED, 0)[1] is True
    assert core.get_job("job").newest_ready == v


@pytest.mark.parametrize("policy", POLICIES)
def test_acks_that_beat_the_report_are_checked_against_it(policy: JobPolicy) -> None:
    """The race: replicas that all acked the same wrong bytes before the trainer's digest arrived must not make
    the version READY; the report fails them, and with them the version."""
    core, t, (r0, r1) = fleet(2, policy)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, ok(v, content_digest=CORRUPT)) is VersionState.STAGING
    assert core.ack(r1, ok(v, content_digest=CORRUPT)) is VersionState.STAGING  # they agree: nothing to flag yet
    assert statuses(latest(core)) == {"r0": ReplicaState.LOADED, "r1": ReplicaState.LOADED}
    info = sent(core, t, v, SENT)
    assert info.state is VersionState.FAILED and info.content_digest == SENT
    assert statuses(info) == {"r0": ReplicaState.FAILED, "r1": ReplicaState.FAILED}
    for replica in info.replicas:
        assert replica.content_digest == CORRUPT
        assert f"content_digest {CORRUPT} is not the {SENT} the trainer sent" in replica.error
    assert f"r0: content_digest {CORRUPT} is not the {SENT} the trainer sent" in info.reason
    assert core.get_job("job").newest_ready == 0


def test_report_sent_with_a_different_content_digest_fails_an_acked_replica() -> None:
    core, t, (r0, r1) = fleet(2)
    events = core.subscribe(r1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, ok(v, content_digest=CORRUPT)) is VersionState.STAGING
    assert statuses(latest(core))["r0"] is ReplicaState.LOADED
    info = core.report_sent(t, v, SentReport(SENT, {}))
    assert info.content_digest == SENT
    r0_status = next(r for r in info.replicas if r.replica_id == "r0")
    assert r0_status.state is ReplicaState.FAILED and r0_status.content_digest == CORRUPT
    assert f"content_digest {CORRUPT} is not the {SENT} the trainer sent" in r0_status.error
    assert info.state is VersionState.FAILED and "r0: content_digest" in info.reason
    assert [next_event(events).kind, next_event(events).kind] == [EventKind.ASSIGN, EventKind.ABORT]


def test_acks_are_checked_against_what_the_trainer_sent() -> None:
    core, t, (r0, r1, _r2) = fleet(3)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, ok(v, content_digest=SENT)) is VersionState.STAGING
    info = core.report_sent(t, v, SentReport(SENT, {"r2": "connection reset by peer"}))
    assert info.state is VersionState.STAGING and statuses(info)["r0"] is ReplicaState.LOADED
    r2_status = next(r for r in info.replicas if r.replica_id == "r2")
    # the trainer's word moves it to the volume at once (tests/unit/test_coordinator_faults.py has the rules)
    assert r2_status.state is ReplicaState.PLANNED and r2_status.channel is Channel.VOLUME
    assert "the trainer's sender lost it: connection reset by peer" in r2_status.error
    assert core.ack(r1, ok(v, content_digest=CORRUPT)) is VersionState.FAILED
    info = latest(core)
    assert statuses(info) == {"r0": ReplicaState.LOADED, "r1": ReplicaState.FAILED, "r2": ReplicaState.PLANNED}
    assert info.content_digest == SENT and "the trainer sent" in info.reason


def test_acks_that_disagree_fail_before_the_trainers_report() -> None:
    core, t, (r0, r1) = fleet(2)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, ok(v, content_digest=SENT)) is VersionState.STAGING
    assert core.ack(r1, ok(v, content_digest=CORRUPT)) is VersionState.FAILED
    r1_status = next(r for r in latest(core).replicas if r.replica_id == "r1")
    assert r1_status.state is ReplicaState.FAILED
    assert f"content_digest {CORRUPT} differs from other replicas' {SENT}" in r1_status.error


def test_report_sent_needs_the_trainer_incarnation_that_opened_it() -> None:
    core, t, _ = fleet(1)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    t2 = core.register("job", Role.TRAINER, "trainer", "t2", CPU, offers=OFFERS).lease_id
    with pytest.raises(faults.PermissionDenied, match="opened by another trainer incarnation"):
        core.report_sent(t2, v, SentReport(SENT, {}))
    with pytest.raises(faults.NotFound, match="has no version 7"):
        core.report_sent(t2, 7, SentReport(SENT, {}))


# ---- retention ----------------------------------------------------------------------------------------------------


def test_retention_prunes_durable_versions_but_never_the_newest_durable_ready(tmp_path: Path) -> None:
    core, t, (r0,) = fleet(1, JobPolicy(retention=1), volume=tmp_path)

    def durable(v: int) -> None:
        path, checksum = write_manifest(tmp_path, v)
        core.mark_durable("job", v, str(path), checksum)

    def on_disk() -> set[int]:
        return {int(p.name[1:]) for p in tmp_path.iterdir() if p.name.startswith("v")}

    def durable_versions() -> set[int]:
        return {i.version for i in core.list_versions("job") if i.durable}

    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v1)
    core.ack(r0, ok(v1))
    durable(v1)
    v2 = core.open_version(t, "job", "t1", 2, TABLE).version
    sent(core, t, v2)
    durable(v2)  # STAGING: kept, and v1 (the newest durable READY) too
    assert on_disk() == durable_versions() == {v1, v2}
    core.ack(r0, failed(v2, "boom"))
    v3 = core.open_version(t, "job", "t1", 3, TABLE).version
    sent(core, t, v3)
    durable(v3)
    # retention 1 counts READY/SUPERSEDED versions only: the FAILED v2 goes, v1 stays (the newest durable READY)
    assert on_disk() == durable_versions() == {v1, v3}
    pruned = next(i for i in core.list_versions("job") if i.version == v2)
    assert pruned.state is VersionState.FAILED and not pruned.manifest_path and not pruned.manifest_checksum
    assert core.get_job("job").newest_durable_ready == v1
    core.ack(r0, ok(v3))  # v3 READY, v1 SUPERSEDED
    v4 = core.open_version(t, "job", "t1", 4, TABLE).version
    sent(core, t, v4)
    durable(v4)
    assert on_disk() == durable_versions() == {v3, v4}
    assert core.get_job("job").newest_durable_ready == v3
    late = core.register("job", Role.REPLICA, "late", "il", CPU).lease_id
    catch_up = next_event(core.subscribe(late))
    assert catch_up.kind is EventKind.CATCH_UP and catch_up.version == v3
    # while "late" loads v3, a newer durable READY version does not take v3 off the volume
    core.ack(r0, ok(v4))
    v5 = core.open_version(t, "job", "t1", 5, TABLE).version
    sent(core, t, v5)
    core.ack(r0, ok(v5))
    durable(v5)  # v5 still STAGING ("late" is planned on it too), v4 the newest durable READY
    assert on_disk() == durable_versions() == {v3, v4, v5}
    core.ack(late, ok(v3))  # caught up: v3 may go with the next retirement
    core.ack(late, ok(v5))
    v6 = core.open_version(t, "job", "t1", 6, TABLE).version
    sent(core, t, v6)
    core.ack(r0, ok(v6))
    core.ack(late, ok(v6))
    durable(v6)
    assert on_disk() == durable_versions() == {v6}


def test_retention_keeps_the_newest_n(tmp_path: Path) -> None:
    core, t, (r0,) = fleet(1, JobPolicy(retention=2), volume=tmp_path)
    for step in range(1, 6):
        v = core.open_version(t, "job", "t1", step, TABLE).version
        sent(core, t, v)
        core.ack(r0, ok(v))
        path, checksum = write_manifest(tmp_path, v)
        core.mark_durable("job", v, str(path), checksum)
        kept = {v - 1, v} if v > 1 else {v}
        assert {int(p.name[1:]) for p in tmp_path.iterdir()} == kept
        assert {i.version for i in core.list_versions("job") if i.durable} == kept


def test_a_copy_never_marked_durable_is_pruned_once_older_than_every_kept_version(tmp_path: Path) -> None:
    """The publisher wrote v2 while the coordinator was unreachable: its mark was lost, the coordinator's record
    never calls it durable; once it is older than every version kept, it goes like the others."""
    core, t, (r0,) = fleet(1, JobPolicy(retention=1), volume=tmp_path)
    for step in range(1, 5):
        v = core.open_version(t, "job", "t1", step, TABLE).version
        sent(core, t, v)
        core.ack(r0, ok(v))
        path, checksum = write_manifest(tmp_path, v)
        if v != 2:  # v2's copy landed; its MarkDurable did not
            core.mark_durable("job", v, str(path), checksum)
        on_disk = {int(p.name[1:]) for p in tmp_path.iterdir() if p.name.startswith("v")}
        # nothing retires while v2's mark is missing; v2 goes with v3's retirement although never durable
        assert on_disk == ({1, 2} if v == 2 else {v}), (v, on_disk)


def test_without_a_volume_nothing_is_pruned() -> None:
    core, t, (r0,) = fleet(1, JobPolicy(retention=1))
    for step in range(1, 4):
        v = core.open_version(t, "job", "t1", step, TABLE).version
        sent(core, t, v)
        core.ack(r0, ok(v))
        core.mark_durable("job", v, f"/ckpt/v{v:08d}/manifest.json", manifest_checksum(b"%d" % v))
    assert {i.version for i in core.list_versions("job") if i.durable} == {1, 2, 3}


def test_a_job_holds_a_bounded_number_of_members_and_a_coordinator_a_bounded_number_of_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from weightsync.coordinator import leases, state

    monkeypatch.setattr(leases, "MAX_MEMBERS_PER_JOB", 3)
    monkeypatch.setattr(state, "MAX_JOBS", 2)
    core, _, _ = fleet(2)  # the trainer and two replicas
    with pytest.raises(faults.ResourceExhausted, match="job 'job' has 3 registered members, the most one job may"):
        core.register("job", Role.REPLICA, "r9", "i9", CPU)
    core.register("job", Role.REPLICA, "r0", "i0-restarted", CPU)  # a member registering again takes no new place
    core.register("other", Role.REPLICA, "r0", "i0", CPU)
    with pytest.raises(faults.ResourceExhausted, match="this coordinator holds 2 jobs"):
        core.register("third", Role.REPLICA, "r0", "i0", CPU)


def test_a_restarted_coordinator_opens_no_version_of_a_recovered_job_for_one_lease_ttl() -> None:
    """Every live replica registers again within a TTL of the restart; a version opened sooner would miss them."""
    store, clock = MemoryStore(), ManualClock()
    core = Coordinator(lease_ttl_s=30.0, store=store, clock=clock)
    t = core.register("job", Role.TRAINER, "trainer", "t1", CPU, offers=OFFERS).lease_id
    r0 = core.register("job", Role.REPLICA, "r0", "i0", CPU).lease_id
    v1 = core.open_version(t, "job", "t1", 1, TABLE).version
    sent(core, t, v1)
    core.ack(r0, ok(v1))

    restarted = Coordinator(lease_ttl_s=30.0, store=store, clock=clock)  # same store: the job is recovered
    t = restarted.register("job", Role.TRAINER, "trainer", "t1", CPU, offers=OFFERS).lease_id
    with pytest.raises(faults.Unavailable, match=r"gives replicas one lease TTL to register again.*retry in 30.0s"):
        restarted.open_version(t, "job", "t1", 2, TABLE)
    clock.advance(10.0)
    restarted.register("job", Role.REPLICA, "r0", "i0", CPU)
    clock.advance(20.0)
    opened = restarted.open_version(t, "job", "t1", 2, TABLE)
    assert opened.version == v1 + 1 and [p.replica_id for p in opened.plans] == ["r0"]
    # a job new to this coordinator has nobody to wait for
    fresh = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=clock)
    t = fresh.register("new", Role.TRAINER, "trainer", "t1", CPU, offers=OFFERS).lease_id
    fresh.register("new", Role.REPLICA, "r0", "i0", CPU)
    assert fresh.open_version(t, "new", "t1", 1, TABLE).version == 1
