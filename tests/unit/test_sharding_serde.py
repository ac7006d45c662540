"""The sharded path's wire form: layouts and plan parts survive the proto, and bad ones fail naming the field."""

from __future__ import annotations

import random

import pytest

from tests.unit.sharding_cases import random_replica, random_table, random_trainer
from weightsync.coordinator import faults, serde
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.sharding.plans import Member, plan
from weightsync.sharding.shards import TrainerLayout

pytestmark = pytest.mark.unit


def test_layouts_and_plan_parts_round_trip() -> None:
    rng = random.Random(29)
    for _ in range(20):
        table = random_table(rng, rng.randint(1, 9))
        trainer = random_trainer(rng, table)
        wire = pb.TrainerLayout.FromString(serde.trainer_layout_to(trainer).SerializeToString())
        back = serde.trainer_layout(wire)
        assert (
            back == trainer
            and back.digest() == trainer.digest()
            and back.table.layout_digest() == table.layout_digest()
        )
        members = [Member(f"r{i}", random_replica(rng, table, rng.choice([1, 2, 4]))) for i in range(2)]
        for m in members:
            assert m.layout is not None
            layout = serde.engine_layout(
                pb.EngineLayout.FromString(serde.engine_layout_to(m.layout).SerializeToString())
            )
            assert layout == m.layout and layout.digest() == m.layout.digest()
        full = plan(trainer, members)
        assert serde.transfer_part(serde.transfer_part_to(full)) == full  # every replica's, as rank 0 gets them
        for m in members:
            part = full.part_for_replica(m.replica_id)
            assert serde.transfer_part(serde.transfer_part_to(part)).replica(m.replica_id) == full.replica(m.replica_id)
    unreadable = TrainerLayout(table, 2, unsupported="tensor 't0' has a Partial() placement")
    assert serde.trainer_layout(serde.trainer_layout_to(unreadable)) == unreadable


def test_bad_layouts_fail_naming_the_field() -> None:
    rng = random.Random(2)
    table = random_table(rng, 4)
    wire = serde.trainer_layout_to(random_trainer(rng, table))
    wire.meshes[0].ranks.append(wire.meshes[0].ranks[0])
    with pytest.raises(
        faults.InvalidArgument, match=r"trainer_layout\.meshes\[0\]: mesh of shape .* expected .* distinct"
    ):
        serde.trainer_layout(wire)
    wire = serde.trainer_layout_to(random_trainer(rng, table))
    wire.group_starts[0] = 1
    with pytest.raises(
        faults.InvalidArgument, match=r"trainer_layout\.group_starts \[1, 3\] do not partition 4 tensors"
    ):
        serde.trainer_layout(wire)
    wire = serde.trainer_layout_to(random_trainer(rng, table))
    wire.tensors[2].dtype = "complex64"
    with pytest.raises(faults.InvalidArgument, match=r"trainer_layout\.tensors: tensor 't2': dtype 'complex64'"):
        serde.trainer_layout(wire)
    layout = random_replica(rng, table, 2)
    bad = serde.engine_layout_to(layout)
    bad.workers[1].fills[0].dest.lengths.append(1)
    with pytest.raises(faults.InvalidArgument, match=r"engine_layout\.workers\[1\]\.fills\[0\]\.dest: box offsets"):
        serde.engine_layout(bad)
    bad = serde.engine_layout_to(layout)
    bad.table_digest = "md5:1"
    with pytest.raises(faults.InvalidArgument, match=r"engine_layout\.table_digest 'md5:1' is not sha256"):
        serde.engine_layout(bad)
