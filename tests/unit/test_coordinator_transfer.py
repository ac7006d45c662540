"""The coordinator plans the sharded path: layouts registered, each replica's part in its plan, each rank's own.

On the core (no gRPC) with a ``ManualClock``: a 2-rank trainer that registered its layout and three replicas:
one on the CPU stream with its engine layout (sharded), one that registered none, one whose only channel is the
volume (both gathered in the same version, the plan saying why). Each trainer rank's part holds exactly the
regions it sends; the plan comes from the job's cache while nothing changes; the wire form round-trips.
"""

from __future__ import annotations

import random

import pytest

from tests.unit.sharding_cases import random_replica
from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import faults, serde
from weightsync.coordinator.clock import ManualClock
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import Capabilities, Role, summarize
from weightsync.coordinator.store import MemoryStore
from weightsync.sharding.shards import Mesh, Placement, TrainerLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit

TABLE = TensorTable.build(
    [[("a.weight", "bfloat16", (8, 6)), ("a.bias", "float32", (8,))], [("b", "bfloat16", (5, 4))]]
)
TRAINER = TrainerLayout(TABLE, 2, (Mesh((2,), (0, 1)),), tuple(Placement(0, (0,)) for _ in TABLE))
ENGINE = random_replica(random.Random(3), TABLE, 2)
CPU = Capabilities(host="n", channels=(Channel.CPU, Channel.VOLUME), volume_id="vol", volume_mount="/ckpt")
VOLUME_ONLY = Capabilities(host="n", channels=(Channel.VOLUME,), volume_id="vol", volume_mount="/ckpt")
OFFERS = (Offer(Channel.CPU, Endpoint("127.0.0.1", 29500)), Offer(Channel.VOLUME))


def _fleet(trainer: TrainerLayout | None = TRAINER) -> tuple[Coordinator, str]:
    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    lease = core.register("job", Role.TRAINER, "t", "t1", CPU, offers=OFFERS, layout=trainer).lease_id
    core.register("job", Role.REPLICA, "r-sharded", "i0", CPU, layout=ENGINE)
    core.register("job", Role.REPLICA, "r-none", "i1", CPU)
    core.register("job", Role.REPLICA, "r-volume", "i2", VOLUME_ONLY, layout=ENGINE)
    return core, lease


def test_each_replica_gets_its_part_and_each_rank_its_own_in_one_version() -> None:
    core, lease = _fleet()
    opened = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    parts = {p.replica_id: p.transfer for p in opened.plans}
    assert all(part is not None for part in parts.values())
    sharded = parts["r-sharded"].replica("r-sharded")  # type: ignore[union-attr]
    assert sharded.sharded and {r.worker for r in sharded.regions} == {0, 1}
    assert "no engine layout" in parts["r-none"].replica("r-none").gathered  # type: ignore[union-attr]
    volume = parts["r-volume"].replica("r-volume")  # type: ignore[union-attr]
    assert "'volume' carries whole tensors only" in volume.gathered and not volume.regions
    assert len(opened.transfers) == 2
    for rank, part in enumerate(opened.transfers):
        mine = part.replica("r-sharded").regions
        assert mine and {r.rank for r in mine} == {rank}
        assert part.replica("r-volume").gathered == volume.gathered  # a rank knows who takes the gathered path
    assert {r for p in opened.transfers for r in p.replica("r-sharded").regions} == set(sharded.regions)
    assert sum(len(p.replica("r-sharded").regions) for p in opened.transfers) == len(sharded.regions)
    again = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))  # a retried open: the same parts
    assert again.reused and again.transfers == opened.transfers


def test_the_plan_comes_from_the_jobs_cache_until_something_changes() -> None:
    core, lease = _fleet()
    first = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    second = core.open_version(lease, "job", "t1", 2, summarize(TABLE, True))
    cache = core._state.job("job").transfer_plans
    assert cache.computed == 1 and second.transfers == first.transfers
    core.register("job", Role.REPLICA, "r-none", "i1", CPU, layout=ENGINE)  # it records its layout now
    third = core.open_version(lease, "job", "t1", 3, summarize(TABLE, True))
    assert (
        cache.computed == 2
        and next(p for p in third.plans if p.replica_id == "r-none")
        .transfer.replica(  # type: ignore[union-attr]
            "r-none"
        )
        .sharded
    )


def test_no_plan_without_a_trainer_layout_or_for_another_table() -> None:
    core, lease = _fleet(trainer=None)
    opened = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    assert opened.transfers == () and all(p.transfer is None for p in opened.plans)
    other = TensorTable.build([[("a.weight", "bfloat16", (8, 6))]])
    core, lease = _fleet()
    opened = core.open_version(lease, "job", "t1", 1, summarize(other, True))
    assert opened.transfers == () and all(p.transfer is None for p in opened.plans)


def test_the_wire_carries_layouts_and_parts_and_refuses_the_wrong_layout_for_a_role() -> None:
    core, lease = _fleet()
    opened = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    assert serde.opened(serde.opened_to(opened)) == opened
    trainer = serde.register_request("job", Role.TRAINER, "t", "t1", CPU, None, OFFERS, 0, TRAINER)
    replica = serde.register_request("job", Role.REPLICA, "r", "i", CPU, None, (), 0, ENGINE)
    assert serde.registered_layout(trainer, Role.TRAINER) == TRAINER
    assert serde.registered_layout(replica, Role.REPLICA) == ENGINE
    with pytest.raises(faults.InvalidArgument, match="trainer_layout is not a replica's layout"):
        serde.registered_layout(trainer, Role.REPLICA)
