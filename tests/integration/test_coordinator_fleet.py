"""A fleet on loopback: the coordinator's gRPC server, replicas as separate processes, real leases.

Each replica is a ``simulation.replica_main`` process (a real ``CoordinatorClient``:
register, renew, watch, report joined, ack); the test process plays the publisher.
A replica planned on the volume is sent its version only once the publisher marked
it durable, so the publisher here does what the real one does: it waits with
``durable_needed``, then marks the version durable.
Kills are real ``SIGKILL``s, so lease expiry is what the coordinator observes.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests import simulation
from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import server
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import AckReport, Assignment, Capabilities, EngineKind, EventKind, TableSummary
from weightsync.tensors import manifest_checksum
from weightsync.vocabulary import Channel, ReplicaState, VersionState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TTL = 2.0  # generous: the shared 2-core machine can delay renewals under load
TABLE = TableSummary(4, 4096, simulation.LAYOUT)
CPU_OFFER = Offer(Channel.CPU, Endpoint("127.0.0.1", 29999))
VOLUME_OFFER = Offer(Channel.VOLUME)
CHECKSUM = manifest_checksum(b"the fleet's manifest")
"""What the publisher claims when it marks a version durable (this coordinator mounts no volume: it records it)."""
TRAINER = Capabilities(host="node-a", channels=(Channel.CPU, Channel.VOLUME), volume_id="vol", engine=EngineKind.CPU)


class Fleet:
    """The coordinator in this process, simulated members as processes, each reporting on its own queue.

    One queue per process, because a process SIGKILLed while its queue's feeder thread holds the
    queue's write lock would block every other writer of a shared queue for good.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        config = server.ServerConfig(insecure=True, port=0, lease_ttl_s=TTL, metrics_port=0)
        self.server = server.CoordinatorServer(config, registry=self.registry).start()
        self.ctx = mp.get_context("spawn")
        self.queues: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        self.clients: list[CoordinatorClient] = []
        self.seen: list[tuple[Any, ...]] = []

    def spawn(self, member: simulation.Member, target: Any, *args: Any) -> None:
        """Start ``target(member, its queue, *args)``; its events are read by ``expect(..., member.member_id)``."""
        events = self.queues[member.member_id] = self.ctx.Queue()
        proc = self.ctx.Process(target=target, args=(member, events, *args), daemon=True)
        proc.start()
        self.procs[member.member_id] = proc

    def replica(self, rid: str, **kw: Any) -> None:
        self.spawn(simulation.Member(self.server.target, "job", rid, **kw), simulation.replica_main)
        self.expect("registered", rid)

    def trainer(self) -> CoordinatorClient:
        client = CoordinatorClient(self.server.target, insecure=True, timeout_s=10)
        client.register_trainer("job", "trainer", TRAINER, offers=[CPU_OFFER, VOLUME_OFFER])
        self.clients.append(client)
        return client

    def expect(self, kind: str, rid: str, version: int | None = None, timeout: float = 30.0) -> tuple[Any, ...]:
        """Wait for one event (events seen earlier count too: they are kept in ``seen``)."""
        for ev in self.seen:
            if ev[0] == kind and ev[1] == rid and (version is None or ev[2] == version):
                return tuple(ev)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ev = self.queues[rid].get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(ev)
            if ev[0] == kind and ev[1] == rid and (version is None or ev[2] == version):
                return tuple(ev)
        raise AssertionError(f"no {kind!r} from {rid} (version {version}) within {timeout}s; saw {self.seen[-10:]}")

    def kill(self, rid: str) -> None:
        self.procs[rid].kill()
        self.procs[rid].join(5)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for p in self.procs.values():
            p.kill()
            p.join(5)
        self.server.stop(0.5)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


def test_two_replicas_on_different_channels_in_one_version_and_metrics(fleet: Fleet) -> None:
    fleet.replica("cpu-replica", channels=("cpu", "volume"), volume_id="vol", volume_mount="/ckpt")
    fleet.replica("volume-replica", channels=("volume",), volume_id="vol", volume_mount="/mnt/ckpt")
    trainer = fleet.trainer()
    opened = trainer.open_version(1, TABLE)
    plans = {p.replica_id: p for p in opened.plans}
    assert plans["cpu-replica"].channel is Channel.CPU
    assert str(plans["cpu-replica"].rendezvous.endpoint) == "127.0.0.1:29999"
    assert plans["cpu-replica"].rendezvous.world_size == 2
    assert plans["volume-replica"].channel is Channel.VOLUME
    assert plans["volume-replica"].rendezvous.root == "/mnt/ckpt"
    trainer.wait_receivers_joined(opened.version, timeout_s=30)
    # the cpu stream went out (verification off: no content digest); the same call waits: the volume replica
    # waits for the volume copy, so the publisher writes it, then marks the version durable
    assert trainer.report_sent(opened.version, "", {}, wait_s=30).durable_needed
    trainer.mark_durable(opened.version, "/ckpt/v00000001/manifest.json", CHECKSUM)
    assert trainer.wait_version(opened.version, timeout_s=30).state is VersionState.READY

    assert fleet.server.metrics_server is not None
    body = urllib.request.urlopen(fleet.server.metrics_server.url, timeout=5).read().decode()
    for series in (
        'weightsync_sync_duration_seconds_bucket{channel="cpu",le="0.001",phase="transfer"}',
        'weightsync_sync_duration_seconds_count{channel="volume",phase="total"} 1.0',
        'weightsync_transferred_bytes_total{channel="cpu"} 4096.0',
        'weightsync_negotiations_total{channel="volume"} 1.0',
        'weightsync_versions{state="READY"} 1.0',
        'weightsync_replicas{state="current"} 2.0',
        "weightsync_fleet_version_lag_max 0.0",
        "weightsync_fleet_replicas_lagging 0.0",
        "weightsync_version_ready_seconds_count 1.0",
    ):
        assert series in body, f"{series} missing from /metrics:\n{body}"


def test_a_volume_planned_replica_is_assigned_only_once_the_version_is_durable(fleet: Fleet) -> None:
    replica = CoordinatorClient(fleet.server.target, insecure=True, timeout_s=10)
    fleet.clients.append(replica)
    caps = Capabilities(host="node-b", channels=(Channel.VOLUME,), volume_id="vol", volume_mount="/mnt/ckpt")
    replica.register_replica("job", "vol-replica", caps)
    seen: queue.Queue[Assignment] = queue.Queue()

    def watch() -> None:
        for a in replica.watch():
            seen.put(a)

    threading.Thread(target=watch, name="vol-replica-watch", daemon=True).start()
    trainer = fleet.trainer()
    opened = trainer.open_version(1, TABLE)
    (plan,) = opened.plans
    assert (plan.replica_id, plan.channel, plan.manifest_checksum) == ("vol-replica", Channel.VOLUME, "")
    # no live receiver to wait for; a plain wait does not return for the volume copy, the publisher's wait does
    assert trainer.wait_receivers_joined(opened.version, timeout_s=5).state is VersionState.STAGING
    trainer.report_sent(opened.version, "", {})
    assert trainer.wait_version(opened.version, 0.3).state is VersionState.STAGING
    info = trainer.wait_version(opened.version, 30, durable_needed=True)
    assert (info.state, info.durable, info.durable_needed) == (VersionState.STAGING, False, True)
    with pytest.raises(queue.Empty):
        seen.get(timeout=1.0)  # nothing to load before the copy landed

    info = trainer.mark_durable(opened.version, "/ckpt/v00000001/manifest.json", CHECKSUM)
    assert (info.durable, info.manifest_checksum, info.durable_needed) == (True, CHECKSUM, False)
    a = seen.get(timeout=30)
    assert (a.kind, a.version, a.table) == (EventKind.ASSIGN, opened.version, TABLE)
    assert a.plan is not None and a.plan.channel is Channel.VOLUME
    assert (a.plan.manifest_checksum, a.plan.rendezvous.root) == (CHECKSUM, "/mnt/ckpt")
    replica.report_joined(a.version)
    replica.ack(AckReport(a.version, TABLE.layout_digest))
    info = trainer.wait_version(opened.version, 30)
    assert info.state is VersionState.READY
    assert [(r.replica_id, r.channel, r.state) for r in info.replicas] == [
        ("vol-replica", Channel.VOLUME, ReplicaState.LOADED)
    ]


def test_late_joiner_catches_up_from_the_newest_durable_ready_version(fleet: Fleet) -> None:
    fleet.replica("early", channels=("cpu", "volume"), volume_id="vol", volume_mount="/ckpt")
    trainer = fleet.trainer()
    v1 = trainer.open_version(1, TABLE).version
    trainer.report_sent(v1, "", {})
    assert trainer.wait_version(v1, 30).state is VersionState.READY
    trainer.mark_durable(v1, "/ckpt/v00000001/manifest.json", CHECKSUM)
    fleet.replica("late", channels=("cpu", "volume"), volume_id="vol", volume_mount="/ckpt", current_version=0)
    _, _, version, channel = fleet.expect("catch_up", "late")
    assert (version, channel) == (v1, "volume")
    fleet.expect("acked", "late", v1)  # the catch-up carried the recorded manifest checksum, or it would refuse
    # then it follows live
    v2 = trainer.open_version(2, TABLE).version
    assert trainer.report_sent(v2, "", {}, wait_s=30).state is VersionState.READY  # the report waits for the acks
    fleet.expect("assign", "late", v2)
    job = trainer.get_job()
    assert {m.member_id: m.current_version for m in job.members if m.member_id != "trainer"} == {
        "early": v2,
        "late": v2,
    }


def test_a_replica_killed_mid_transfer_does_not_fail_the_version(fleet: Fleet) -> None:
    fleet.replica("healthy", channels=("cpu",), work_s=0.2)
    fleet.replica("doomed", channels=("cpu",), hang_after_joined=True)
    trainer = fleet.trainer()
    v = trainer.open_version(1, TABLE).version
    fleet.expect("hanging", "doomed", v)
    fleet.kill("doomed")
    started = time.monotonic()
    trainer.report_sent(v, "", {"doomed": "connection reset by peer"})  # the sender lost it mid-transfer
    assert trainer.wait_version(v, 30).state is VersionState.READY
    assert time.monotonic() - started < 10 * TTL
    info = trainer.list_versions(limit=1)[0]
    assert {r.replica_id: r.state for r in info.replicas} == {
        "healthy": ReplicaState.LOADED,
        "doomed": ReplicaState.DROPPED,
    }
    assert "1 dropped" in info.reason


def test_trainer_killed_mid_publish_fails_the_version_and_aborts_unfinished_replicas(fleet: Fleet) -> None:
    fleet.replica("r0", channels=("cpu",))
    fleet.replica("r1", channels=("cpu",), work_s=3 * TTL)  # still receiving when the trainer dies
    trainer = fleet.trainer()
    v1 = trainer.open_version(1, TABLE).version
    trainer.report_sent(v1, "", {})
    assert trainer.wait_version(v1, 30).state is VersionState.READY
    trainer.close()  # the first trainer leaves cleanly after v1... then a second trainer dies mid-publish
    member = simulation.Member(fleet.server.target, "job", "trainer", channels=("cpu",))
    fleet.spawn(member, simulation.trainer_main, 2, (("cpu", "127.0.0.1", 29999),))
    _, _, v2, _ = fleet.expect("opened", "trainer")
    fleet.expect("assign", "r0", v2)
    fleet.kill("trainer")
    observer = CoordinatorClient(fleet.server.target, insecure=True)
    fleet.clients.append(observer)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = next(v for v in observer.list_versions("job") if v.version == v2)
        if info.state is not VersionState.STAGING:
            break
        time.sleep(0.1)
    assert info.state is VersionState.FAILED and "trainer lost mid-publish" in info.reason
    states = {r.replica_id: r.state for r in info.replicas}
    assert states["r1"] in (ReplicaState.PLANNED, ReplicaState.JOINED)  # it had not finished when the version failed
    fleet.expect("abort", "r1", v2)  # told to stop, and to reload the newest durable READY version if bytes landed
    assert observer.get_job("job").newest_ready == v1  # the fleet's version did not move
