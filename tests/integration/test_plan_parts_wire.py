"""A plan's regions cross gRPC once per plan key to each end: the trainer's OpenVersion and a replica's watch stream.

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
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.unit.sharding_cases import random_replica
from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import serde, server
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import Assignment, Capabilities, EventKind, summarize
from weightsync.sharding.shards import Mesh, Placement, TrainerLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TABLE = TensorTable.build(
    [[("a.weight", "bfloat16", (64, 6)), ("a.bias", "float32", (64,))], [("b", "bfloat16", (5, 4))]]
)
TRAINER = TrainerLayout(TABLE, 2, (Mesh((2,), (0, 1)),), tuple(Placement(0, (0,)) for _ in TABLE))
ENGINE = random_replica(random.Random(3), TABLE, 2)
CPU = Capabilities(host="n", channels=(Channel.CPU,))


@pytest.fixture
def coordinator() -> Iterator[server.CoordinatorServer]:
    s = server.CoordinatorServer(server.ServerConfig(insecure=True, port=0, lease_ttl_s=30.0, metrics_port=0)).start()
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

        # an end that lost them: the trainer names a key it no longer holds every part of; it opens again in full
        # (a stand-in for a fault the product does not cause: its held parts are what it decoded)
        lost = serde.HeldRegions()
        key = opened[0].plans[0].transfer.key  # type: ignore[union-attr]
        lost.keep(key, "another", ())
        trainer._opened_parts = lost
        carried.clear()
        again = trainer.open_version(2, summarize(TABLE, True))  # the same step: the same version, reused
        assert again.reused and again.plans == opened[1].plans
        assert [c[1:] for c in carried if c[0] == "trainer"] == [("r", True, 0), ("r", False, n)]
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
