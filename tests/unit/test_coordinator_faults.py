"""One replica's fault stays its own: the coordinator's side of the trainer's lost-receiver reports.

The publisher reports a receiver lost the moment its sender gives up on it (it missed the join deadline,
it died, froze or fell too far behind mid-transfer): that replica alone moves to the volume for the
version and is kept off its channel for a while; every other replica keeps its plan, its group and its
channel. A replica's own late report of the same failure changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_coordinator_lifecycle import (
    SENT,
    TABLE,
    failed,
    fleet,
    latest,
    ok,
    statuses,
    write_manifest,
)
from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator.clock import ManualClock
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import Capabilities, Progress, Role, SentReport, WaitFor
from weightsync.coordinator.store import MemoryStore
from weightsync.vocabulary import Channel, ReplicaState, VersionState

pytestmark = pytest.mark.unit


def channels(core: Coordinator) -> dict[str, Channel | None]:
    return {r.replica_id: r.channel for r in latest(core).replicas}


def test_a_lost_receiver_falls_back_alone_and_at_once(tmp_path: Path) -> None:
    core, t, (r0, r1, r2) = fleet(3, volume=tmp_path)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.report_progress(r0, v, Progress.JOINED)
    core.report_progress(r1, v, Progress.JOINED)
    _, joined = core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 0)
    assert not joined  # r2 has not joined: the publisher's join deadline runs out
    core.report_lost(t, v, {"r2": "cpu channel: group did not form within the join deadline of 10s"})
    _, joined = core.wait_version("job", v, WaitFor.RECEIVERS_JOINED, 0)
    assert joined, "the lost replica still counted among those the publisher waits for"
    assert channels(core) == {"r0": Channel.CPU, "r1": Channel.CPU, "r2": Channel.VOLUME}
    info = latest(core)
    assert statuses(info) == {"r0": ReplicaState.JOINED, "r1": ReplicaState.JOINED, "r2": ReplicaState.PLANNED}
    assert info.durable_needed  # the publisher writes the volume copy before it waits for the verdict
    # a late JOINED from the lost replica (it was slow, not dead) does not count on the volume plan
    core.report_progress(r2, v, Progress.JOINED)
    assert statuses(latest(core))["r2"] is ReplicaState.PLANNED
    # its own report of the same failure comes after the trainer's: the volume plan stands
    assert core.ack(r2, failed(v, "join timed out", channel_failed=True)) is VersionState.STAGING
    assert statuses(latest(core))["r2"] is ReplicaState.PLANNED
    core.report_sent(t, v, SentReport(SENT, {"r2": "cpu channel: did not form"}))  # named again: no change
    assert core.ack(r0, ok(v, content_digest=SENT)) is VersionState.STAGING
    assert core.ack(r1, ok(v, content_digest=SENT)) is VersionState.STAGING
    path, checksum = write_manifest(tmp_path, v)
    core.mark_durable("job", v, str(path), checksum)
    assert core.ack(r2, ok(v, content_digest=SENT)) is VersionState.READY


def test_only_the_lost_replica_is_kept_off_its_channel(tmp_path: Path) -> None:
    core, t, _ = fleet(3, volume=tmp_path)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.report_lost(t, v, {"r1": "cpu channel: bucket 3 broadcast still not taken 10s after the others took it"})
    error = next(r.error for r in latest(core).replicas if r.replica_id == "r1")
    assert "cpu failed, loading from the volume: the trainer's sender lost it: cpu channel: bucket 3" in error
    core.report_sent(t, v, SentReport("", {}))
    # the next version plans the healthy replicas on the stream again, the lost one on the volume (its backoff)
    plans = {p.replica_id: p for p in core.open_version(t, "job", "t1", 2, TABLE).plans}
    assert {rid: p.channel for rid, p in plans.items()} == {
        "r0": Channel.CPU,
        "r1": Channel.VOLUME,
        "r2": Channel.CPU,
    }
    assert "cpu: failed before for this replica" in plans["r1"].reason


def test_a_lost_receiver_without_a_volume_is_left_to_its_own_ack_or_lease() -> None:
    """Nothing to fall back to: the trainer's word is recorded, and the replica's own ack decides (or its lease,
    when it died: dropped, it does not fail the version for the others)."""
    core, t, _ = fleet(0)
    no_volume = Capabilities(host="n", channels=(Channel.CPU,))
    r0 = core.register("job", Role.REPLICA, "r0", "i0", no_volume).lease_id
    r1 = core.register("job", Role.REPLICA, "r1", "i1", no_volume).lease_id
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    core.report_lost(t, v, {"r1": "cpu channel: group did not form"})
    info = latest(core)
    assert statuses(info)["r1"] is ReplicaState.PLANNED and "no volume to fall back to" in info.replicas[1].error
    core.report_sent(t, v, SentReport("", {}))
    assert core.ack(r0, ok(v)) is VersionState.STAGING
    assert core.ack(r1, failed(v, "header timed out", channel_failed=True)) is VersionState.FAILED


def test_a_lost_report_after_the_replica_loaded_changes_nothing() -> None:
    core, t, (r0, r1) = fleet(2)
    v = core.open_version(t, "job", "t1", 1, TABLE).version
    assert core.ack(r0, ok(v, content_digest=SENT)) is VersionState.STAGING
    core.report_lost(t, v, {"r0": "cpu channel: header failed"})  # raced with its ack: it has the version
    assert statuses(latest(core))["r0"] is ReplicaState.LOADED and channels(core)["r0"] is Channel.CPU
    core.report_sent(t, v, SentReport(SENT, {}))
    assert core.ack(r1, ok(v, content_digest=SENT)) is VersionState.READY


def test_a_group_that_lost_a_member_gets_a_new_generation_even_with_the_same_members() -> None:
    """The sender formed the group again without the lost member; if that member comes back as it was (its lease
    ran out before the trainer's report, so no fallback kept it off the channel), every member must join a new
    membership, not the group they think they are in."""
    clock = ManualClock()
    core = Coordinator(lease_ttl_s=10.0, store=MemoryStore(), clock=clock)
    nccl = Capabilities(host="n", channels=(Channel.NCCL,), nccl_domain="rack")
    offer = Offer(Channel.NCCL, Endpoint("127.0.0.1", 29500))
    t = core.register("job", Role.TRAINER, "trainer", "t1", nccl, offers=(offer,)).lease_id
    r0 = core.register("job", Role.REPLICA, "r0", "i0", nccl).lease_id
    r1 = core.register("job", Role.REPLICA, "r1", "i1", nccl).lease_id
    core.subscribe(r0)
    core.subscribe(r1)
    first = {p.replica_id: p.rendezvous for p in core.open_version(t, "job", "t1", 1, TABLE).plans}
    assert first["r0"].same_membership(first["r1"])
    clock.advance(6.0)
    core.renew(t)
    core.renew(r0)
    clock.advance(6.0)
    core.tick()  # r1 froze: its lease ran out, it is dropped from v1
    assert statuses(latest(core))["r1"] is ReplicaState.DROPPED
    core.report_lost(t, 1, {"r1": "nccl channel: silent for over the join deadline of 10s"})
    core.subscribe(core.register("job", Role.REPLICA, "r1", "i1", nccl).lease_id)  # thawed: back as it was
    again = {p.replica_id: p.rendezvous for p in core.open_version(t, "job", "t1", 2, TABLE).plans}
    assert set(again) == {"r0", "r1"} and again["r0"].same_membership(again["r1"])
    assert not again["r0"].same_membership(first["r0"]), "the survivor was planned on the group it left"
