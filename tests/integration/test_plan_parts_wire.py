"""A plan's layouts and regions over gRPC: layouts of real models' length register, and a plan's regions cross once
per plan key to each end (the trainer's OpenVersion and a replica's watch stream), a part past a message's room read
in chunks.

A real coordinator server (gRPC, in this process) and two real clients: a trainer that registered its layout and a
replica that registered its engine layout and watches. While the plan key holds, the second version's parts come
without their regions (``ReplicaRegions.held``) and each client fills them back in from what it decoded before;
``serde.transfer_part`` is wrapped (its result unchanged) to see what each message carried.
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.unit.sharding_cases import random_replica
from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import faults, limits, serde, server
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import Assignment, Capabilities, ChannelPlan, EventKind, OpenedVersion, summarize
from weightsync.sharding.shards import REPLICATE, Mesh, Placement, TrainerLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TABLE = TensorTable.build(
    [[("a.weight", "bfloat16", (64, 6)), ("a.bias", "float32", (64,))], [("b", "bfloat16", (5, 4))]]
)
TRAINER = TrainerLayout(TABLE, 2, (Mesh((2,), (0, 1)),), tuple(Placement(0, (0,)) for _ in TABLE))
ENGINE = random_replica(random.Random(3), TABLE, 2)
CPU = Capabilities(host="n", channels=(Channel.CPU,))


LIMIT = 16 << 10
"""A lowered message limit (``--max-message-bytes``, which the coordinator's operator sets), so that a small plan's
part is past a message's room: ``WIDE``'s from 2 ranks to a TP=2 replica."""
WIDE = TensorTable.build([[(f"t{i}", "bfloat16", (64, 6)) for i in range(100)]])
WIDE_TRAINER = TrainerLayout(WIDE, 2, (Mesh((2,), (0, 1)),), tuple(Placement(0, (0,)) for _ in WIDE))


@pytest.fixture
def coordinator() -> Iterator[server.CoordinatorServer]:
    yield from _serving(server.ServerConfig(insecure=True, port=0, lease_ttl_s=30.0, metrics_port=0))


@pytest.fixture
def small_coordinator() -> Iterator[server.CoordinatorServer]:
    config = server.ServerConfig(insecure=True, port=0, lease_ttl_s=30.0, metrics_port=0, max_message_bytes=LIMIT)
    yield from _serving(config)


def _serving(config: server.ServerConfig) -> Iterator[server.CoordinatorServer]:
    s = server.CoordinatorServer(config).start()
    try:
        yield s
    finally:
        s.stop(0.5)


def test_regions_cross_once_per_plan_key_and_each_end_fills_them_back_in(
    coordinator: server.CoordinatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    carried: list[tuple[str, str, bool, int]] = []  # (which end, replica, held, regions on the wire), per part decoded
    decode = serde.transfer_part

    def seen(m: Any, field: str = "transfer", held: Any = None) -> Any:
        end = "trainer" if threading.current_thread() is threading.main_thread() else "replica"
        carried.extend((end, r.replica_id, r.held, len(r.regions)) for r in m.replicas)
        return decode(m, field, held)

    monkeypatch.setattr(serde, "transfer_part", seen)
    trainer = CoordinatorClient(coordinator.target, insecure=True, timeout_s=10)
    replica = CoordinatorClient(coordinator.target, insecure=True, timeout_s=10)
    events: queue.Queue[Assignment] = queue.Queue()
    try:
        trainer.register_trainer(
            "job", "t", CPU, offers=[Offer(Channel.CPU, Endpoint("127.0.0.1", 29999))], layout=TRAINER
        )
        replica.register_replica("job", "r", CPU, layout=ENGINE)
        threading.Thread(target=lambda: [events.put(e) for e in replica.watch()], daemon=True).start()
        opened = []
        for step in (1, 2):
            opened.append(trainer.open_version(step, summarize(TABLE, True)))
            while True:  # the replica is planned once its stream is up: the first open may come before it
                e = events.get(timeout=30)
                if e.kind is EventKind.ASSIGN and e.version == opened[-1].version:
                    break
            assert e.plan is not None and e.plan == opened[-1].plans[0]  # what the trainer got, regions included
        parts = [o.plans[0].regions_part() for o in opened]
        assert parts[0] is not None and parts[0].regions and parts[0] == parts[1]
        n = len(parts[0].regions)
        # each end got the regions once (the trainer's first response, the stream's first event), then the key
        assert [c[1:] for c in carried if c[0] == "trainer"] == [("r", False, n), ("r", True, 0)]
        streamed = [c[1:] for c in carried if c[0] == "replica"]
        assert streamed[0] == ("r", False, n) and set(streamed[1:]) == {("r", True, 0)}, streamed

        # an end that lost them: the trainer names a key it no longer holds every part of; it reads the part it
        # lacks (a stand-in for a fault the product does not cause: its held parts are what it decoded)
        read: list[tuple[str, str]] = []

        def fetch(key: str, replica_id: str) -> Any:
            read.append((key, replica_id))
            return trainer.plan_regions(key, replica_id)

        lost = serde.HeldRegions(fetch=fetch)
        key = opened[0].plans[0].transfer.key  # type: ignore[union-attr]
        lost.keep(key, "another", ())
        trainer._opened_parts = lost
        carried.clear()
        again = trainer.open_version(2, summarize(TABLE, True))  # the same step: the same version, reused
        assert again.reused and again.plans == opened[1].plans
        assert [c[1:] for c in carried if c[0] == "trainer"] == [("r", True, 0)] and read == [(key, "r")]
    finally:
        trainer.close()
        replica.close()


def test_parts_past_a_messages_room_are_read_in_chunks_by_each_end(
    small_coordinator: server.CoordinatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part whose regions would take more than half the coordinator's message limit is left out of the message
    (Qwen3-235B's is 12.7 MB a replica, rank 0's answer every replica's); each end reads it with GetPlanRegions, in
    chunks within the limit, and gets the plan the coordinator computed. The limit is lowered here so a small plan
    engages it (``--max-message-bytes``, which the coordinator's operator sets)."""
    chunks: list[list[int]] = []  # per part decoded, each chunk's size
    encoded: list[int] = []  # per part the coordinator encoded, its regions
    chunked, chunking = serde.chunked_regions, serde.region_chunks

    def decoded(answer: Any, field: str) -> Any:
        sizes: list[int] = []
        chunks.append(sizes)
        return chunked([sizes.append(c.ByteSize()) or c for c in answer], field)

    def encoding(regions: Any, nbytes: int) -> Any:
        encoded.append(len(regions))
        return chunking(regions, nbytes)

    monkeypatch.setattr(serde, "chunked_regions", decoded)
    monkeypatch.setattr(serde, "region_chunks", encoding)
    engine = random_replica(random.Random(3), WIDE, 2)
    opened, assigned = _first_assigned(small_coordinator, WIDE_TRAINER, engine, replicas=2)
    assert assigned == list(opened.plans)  # every end read the parts in full
    planned = small_coordinator.core._state.job("job").transfer_plans.find(opened.plans[0].transfer.key)  # type: ignore[union-attr]
    assert planned is not None and [p.regions_part() for p in opened.plans] == list(planned.replicas)
    # each replica read its part and the trainer every replica's, in more than one chunk within the limit; the two
    # replicas' parts are the same regions (one engine layout): encoded once, decoded once by the trainer
    assert len(chunks) == 3 and all(len(c) > 1 and max(c) <= LIMIT for c in chunks), chunks
    assert encoded == [len(planned.replicas[0].regions)]


def test_a_replica_that_cannot_read_its_part_opens_its_stream_again_and_gets_the_version(
    small_coordinator: server.CoordinatorServer,
) -> None:
    """Its first read of the part fails (a stand-in for a coordinator that lost the plan between the event and the
    read: it keeps plans in memory, and a restart loses them); the agent's stream does not end: it is opened again,
    the coordinator replays the version's assignment, and the part is read then."""
    trainer = CoordinatorClient(small_coordinator.target, insecure=True, timeout_s=10)
    replica = CoordinatorClient(small_coordinator.target, insecure=True, timeout_s=10)
    failed: list[str] = []
    read = replica._watched_parts.fetch
    assert read is not None

    def once(key: str, replica_id: str) -> Any:
        if not failed:
            failed.append(key)
            raise faults.NotFound(f"job 'job' holds no plan {key[:19]}... any more (a stand-in)")
        return read(key, replica_id)

    replica._watched_parts.fetch = once
    events: queue.Queue[Assignment] = queue.Queue()
    try:
        trainer.register_trainer(
            "job", "t", CPU, offers=[Offer(Channel.CPU, Endpoint("127.0.0.1", 29999))], layout=WIDE_TRAINER
        )
        replica.register_replica("job", "r", CPU, layout=random_replica(random.Random(3), WIDE, 2))
        threading.Thread(target=lambda: [events.put(e) for e in replica.watch()], daemon=True).start()
        for step in range(1, 50):
            opened = trainer.open_version(step, summarize(WIDE, True))
            if opened.plans:
                break
            time.sleep(0.1)
        while (e := events.get(timeout=30)).version != opened.version:
            pass
        assert failed == [opened.plans[0].transfer.key] and e.plan == opened.plans[0]  # type: ignore[union-attr]
    finally:
        trainer.close()
        replica.close()


def test_layouts_of_the_length_real_models_have_register_and_are_planned(
    coordinator: server.CoordinatorServer,
) -> None:
    """Every request's fields are bounded (``limits.check_fields``); a layout lists an entry per tensor, per
    parameter and per fill, and a trainer mesh one per rank, far past an ordinary list's bound (``MAX_ITEMS``):
    Qwen3-8B has 399 tensors, its TP=2 worker 291 parameters, a 235B trainer 64 ranks. Here each of those lists is
    past that bound (asserted, so the test cannot shrink below where the bound engages)."""
    ranks = limits.MAX_ITEMS + 8
    table = TensorTable.build(
        [[(f"layers.{i}.w{j}", "bfloat16", (ranks * 2, 8)) for j in range(4)] for i in range(limits.MAX_ITEMS)]
    )
    # FSDP2 over every rank, and (as experts cut from a fused expert parameter are) tensors each held whole by one
    # rank: a mesh of one per holder
    meshes = (Mesh((ranks,), tuple(range(ranks))), *(Mesh((1,), (r,)) for r in range(ranks)))
    placed = tuple(
        Placement(0, (0,)) if t % 2 else Placement(1 + t // 2 % ranks, (REPLICATE,)) for t in range(len(table))
    )
    layout = TrainerLayout(table, ranks, meshes, placed)
    engine = random_replica(random.Random(5), table, 2)
    assert len(table) > limits.MAX_ITEMS and len(layout.meshes[0].ranks) > limits.MAX_ITEMS
    assert len({p.mesh for p in layout.placements}) > limits.MAX_ITEMS
    assert all(len(w.params) > limits.MAX_ITEMS and len(w.fills) > limits.MAX_ITEMS for w in engine.workers)
    opened, assigned = _first_assigned(coordinator, layout, engine)
    part = opened.plans[0].regions_part()
    assert assigned == list(opened.plans) and part is not None, opened.plans[0].reason
    assert {r.rank for r in part.regions} == set(range(ranks)) and {r.worker for r in part.regions} == {0, 1}


def _first_assigned(
    coordinator: server.CoordinatorServer, layout: TrainerLayout, engine: Any, replicas: int = 1
) -> tuple[OpenedVersion, list[ChannelPlan | None]]:
    """A trainer with ``layout`` and ``replicas`` watching replicas ("r", "r1", ...) with ``engine`` registered over
    gRPC: the first version planned for every replica, and the plan each one's ASSIGN carried, in the version's
    order."""
    trainer = CoordinatorClient(coordinator.target, insecure=True, timeout_s=30)
    ends = [CoordinatorClient(coordinator.target, insecure=True, timeout_s=30) for _ in range(replicas)]
    events: queue.Queue[Assignment] = queue.Queue()
    try:
        trainer.register_trainer(
            "job", "t", CPU, offers=[Offer(Channel.CPU, Endpoint("127.0.0.1", 29999))], layout=layout
        )
        for i, end in enumerate(ends):
            end.register_replica("job", f"r{i or ''}", CPU, layout=engine)
            threading.Thread(target=lambda end=end: [events.put(e) for e in end.watch()], daemon=True).start()
        for step in range(1, 50):  # a replica is planned once its stream is up: the first opens may come before
            opened = trainer.open_version(step, summarize(layout.table, True))
            if len(opened.plans) == replicas:
                break
            time.sleep(0.1)
        assigned: dict[str, ChannelPlan | None] = {}
        while len(assigned) < replicas:
            e = events.get(timeout=30)
            if e.version == opened.version and e.plan is not None:
                assigned[e.plan.replica_id] = e.plan
        return opened, [assigned[p.replica_id] for p in opened.plans]
    finally:
        for c in (trainer, *ends):
            c.close()


def test_a_replica_reads_only_its_own_part(coordinator: server.CoordinatorServer) -> None:
    trainer = CoordinatorClient(coordinator.target, insecure=True, timeout_s=10)
    replica = CoordinatorClient(coordinator.target, insecure=True, timeout_s=10)
    try:
        trainer.register_trainer(
            "job", "t", CPU, offers=[Offer(Channel.CPU, Endpoint("127.0.0.1", 29999))], layout=TRAINER
        )
        replica.register_replica("job", "r", CPU, layout=ENGINE)
        with pytest.raises(faults.PermissionDenied, match="replica 'r' asked for replica 'other'"):
            replica.plan_regions("sha256:" + "0" * 64, "other")
        with pytest.raises(faults.NotFound, match="holds no plan sha256:0000"):
            trainer.plan_regions("sha256:" + "0" * 64, "r")
    finally:
        trainer.close()
        replica.close()


def test_a_client_that_keeps_no_regions_gets_them_on_every_event(coordinator: server.CoordinatorServer) -> None:
    """A watch stream opened without ``keeps_regions`` (an agent older than ``ReplicaRegions.held``, as in a rolling
    upgrade) is sent every part's regions every time, so it never meets a part it cannot read."""
    trainer = CoordinatorClient(coordinator.target, insecure=True, timeout_s=10)
    old = CoordinatorClient(coordinator.target, insecure=True, timeout_s=10)
    events: queue.Queue[Any] = queue.Queue()
    call = None
    try:
        trainer.register_trainer(
            "job", "t", CPU, offers=[Offer(Channel.CPU, Endpoint("127.0.0.1", 29999))], layout=TRAINER
        )
        old.register_replica("job", "old", CPU, layout=ENGINE)
        request = serde.watch_request(old.lease.lease_id, keeps_regions=False)
        call = old._rpc["WatchVersions"](request, timeout=60, metadata=old._metadata)
        stream = call

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                for e in stream:
                    events.put(e)

        threading.Thread(target=read, daemon=True).start()
        carried = []
        for step in (1, 2):
            version = trainer.open_version(step, summarize(TABLE, True)).version
            while True:
                e = events.get(timeout=30)
                if e.kind == pb.EVENT_KIND_ASSIGN and e.version == version:
                    break
            carried += [(r.held, len(r.regions)) for r in e.plan.transfer.replicas]
        assert len(carried) == 2 and carried[0] == carried[1] and carried[0][1] > 0 and not carried[0][0]
    finally:
        if call is not None:
            call.cancel()
        trainer.close()
        old.close()
