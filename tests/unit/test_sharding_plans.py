"""The transfer plan: every worker gets exactly its boxes, each element once, from a rank that holds it.

Property-style: seeded random trainers (meshes, FSDP/TP/replicated placements, uneven sizes) and random
replicas (``sharding_cases``), then the plan is *executed* on unique integer values: each rank sends from its
own shard only, and each worker's parameters must come out equal to what its layout says, every element
written exactly once.
"""

from __future__ import annotations

import random

import pytest

from tests.unit.sharding_cases import execute, random_replica, random_table, random_trainer
from weightsync.errors import PermanentError
from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import EngineLayout, Fill, ParamSpec, WorkerLayout
from weightsync.sharding.plans import Member, PlanCache, plan
from weightsync.sharding.shards import REPLICATE, Mesh, Placement, TrainerLayout
from weightsync.tensors import TensorTable

pytestmark = pytest.mark.unit


def test_random_plans_deliver_every_needed_element_exactly_once() -> None:
    rng = random.Random(24)
    for _ in range(60):
        table = random_table(rng, rng.randint(1, 9))
        trainer = random_trainer(rng, table)
        members = [
            Member(f"r{i}", random_replica(rng, table, rng.choice([1, 2, 3, 4]))) for i in range(rng.randint(1, 3))
        ]
        result = plan(trainer, members)
        execute(trainer, members, result)
        assert plan(trainer, members) == result  # deterministic
        assert [r.tensor for _, r in result.ordered()] == sorted(r.tensor for _, r in result.ordered())
        links: dict[tuple[int, str, int, int], list[Box]] = {}
        for rid, r in result.ordered():  # no element twice over one link
            for other in links.setdefault((r.rank, rid, r.worker, r.tensor), []):
                assert not other.overlaps(r.source)
            links[r.rank, rid, r.worker, r.tensor].append(r.source)


def _fsdp(table: TensorTable, world: int) -> TrainerLayout:
    mesh = Mesh((world,), tuple(range(world)))
    return TrainerLayout(table, world, (mesh,), tuple(Placement(0, (0,)) for _ in table))


def test_replicated_pieces_spread_over_their_holders() -> None:
    table = TensorTable.build([[(f"norm{i}", "bfloat16", (64,)) for i in range(8)]])
    mesh = Mesh((4,), (0, 1, 2, 3))
    trainer = TrainerLayout(table, 4, (mesh,), tuple(Placement(0, (REPLICATE,)) for _ in table))
    whole = EngineLayout(
        table.layout_digest(),
        (
            WorkerLayout(
                0,
                tuple(ParamSpec(s.name, s.dtype, s.shape) for s in table),
                tuple(Fill(t, Box.whole((64,)), t, Box.whole((64,))) for t in range(8)),
            ),
        ),
    )
    result = plan(trainer, [Member("a", whole)])
    assert result.bytes_sent() == {0: 256, 1: 256, 2: 256, 3: 256}


def test_replicas_of_one_engine_layout_are_cut_once_where_no_rank_has_a_choice() -> None:
    """With every piece on one rank (FSDP2) the replicas of one engine layout get the same regions (the plan cuts
    them once per tensor); where pieces are replicated, they still spread over the holders."""
    rng = random.Random(7)
    table = random_table(rng, 6)
    engine = random_replica(rng, table, 2)
    members = [
        Member("a", engine),
        Member("b", random_replica(rng, table, 3)),
        Member("c", engine),
        Member("d", engine),
    ]
    fsdp = _fsdp(table, 3)
    result = plan(fsdp, members)
    execute(fsdp, members, result)
    assert result.replica("a").regions == result.replica("c").regions == result.replica("d").regions
    replicated = TrainerLayout(table, 2, (Mesh((2,), (0, 1)),), tuple(Placement(0, (REPLICATE,)) for _ in table))
    spread = plan(replicated, members)
    execute(replicated, members, spread)
    assert spread.replica("a").regions != spread.replica("c").regions
    assert set(spread.bytes_sent()) == {0, 1}


def test_a_replica_that_cannot_take_regions_is_planned_gathered_with_the_reason() -> None:
    table = TensorTable.build([[("w", "bfloat16", (8, 4))]])
    trainer = _fsdp(table, 2)
    good = EngineLayout(
        table.layout_digest(),
        (WorkerLayout(0, (ParamSpec("w", "bfloat16", (8, 4)),), (Fill(0, Box.whole((8, 4)), 0, Box.whole((8, 4))),)),),
    )
    other = EngineLayout("sha256:" + "0" * 64, good.workers)
    members = [
        Member("ok", good),
        Member("volume", good, refused="its channel (volume) reads whole tensors"),
        Member("old-agent", None),
        Member("stale", other),
        Member("broken", EngineLayout(table.layout_digest(), unsupported="load_weights raised NotImplementedError")),
    ]
    result = plan(trainer, members)
    reasons = {r.replica_id: r.gathered for r in result.replicas}
    assert reasons["ok"] == "" and result.replica("ok").sharded
    assert reasons["volume"] == "its channel (volume) reads whole tensors"
    assert reasons["old-agent"] == "its agent reported no engine layout"
    assert reasons["stale"].startswith("its engine layout was recorded against table sha256:000000000000")
    assert reasons["broken"] == "its engine layout could not be recorded: load_weights raised NotImplementedError"
    assert result.bytes_sent() == {0: 32, 1: 32}  # the sharded replica only: half the rows each
    unreadable = TrainerLayout(table, 2, unsupported="tensor 'w' has a Partial() placement")
    assert {r.gathered for r in plan(unreadable, members[:1]).replicas} == {
        "the trainer's layout cannot be read: tensor 'w' has a Partial() placement"
    }
    with pytest.raises(PermanentError, match="lists a replica twice"):
        plan(trainer, [Member("ok", good), Member("ok", good)])


def test_the_cache_computes_once_per_trainer_engine_and_membership() -> None:
    rng = random.Random(1)
    table = random_table(rng, 6)
    trainer = _fsdp(table, 2)
    a, b = random_replica(rng, table, 2), random_replica(rng, table, 1)
    cache = PlanCache(size=2)
    first = cache.get(trainer, [Member("a", a), Member("b", b)])
    assert cache.get(trainer, [Member("a", a), Member("b", b)]) is first and cache.computed == 1
    assert cache.get(trainer, [Member("a", a)]) is not first and cache.computed == 2  # membership changed
    assert cache.get(_fsdp(table, 4), [Member("a", a)]).key != first.key and cache.computed == 3  # trainer changed
    assert cache.get(trainer, [Member("a", a), Member("b", b)]) is not first and cache.computed == 4  # evicted


def test_worker_layout_refuses_what_would_break_the_plan() -> None:
    p = (ParamSpec("qkv", "bfloat16", (6, 4)),)
    with pytest.raises(PermanentError, match=r"parameter 'qkv': boxes \[0:4, 0:4\] and \[2:6, 0:4\] are both filled"):
        WorkerLayout(
            0,
            p,
            (
                Fill(0, Box((0, 0), (4, 4)), 0, Box((0, 0), (4, 4))),
                Fill(1, Box((0, 0), (4, 4)), 0, Box((2, 0), (4, 4))),
            ),
        )
    with pytest.raises(PermanentError, match=r"tensor #0: boxes .* are both needed"):
        WorkerLayout(
            0,
            p,
            (
                Fill(0, Box((0, 0), (2, 4)), 0, Box((0, 0), (2, 4))),
                Fill(0, Box((1, 0), (2, 4)), 0, Box((2, 0), (2, 4))),
            ),
        )
    with pytest.raises(PermanentError, match="does not fill destination box"):
        WorkerLayout(0, p, (Fill(0, Box((0, 0), (4, 2)), 0, Box((0, 0), (2, 4))),))
    with pytest.raises(PermanentError, match=r"lies outside its tensor of shape \[6, 4\]"):
        WorkerLayout(0, p, (Fill(0, Box((0, 0), (8, 4)), 0, Box((0, 0), (8, 4))),))
    layout = WorkerLayout(0, p, (Fill(0, Box((0, 0), (6, 4)), 0, Box((0, 0), (6, 4))),))
    assert WorkerLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(PermanentError, match="malformed worker layout"):
        WorkerLayout.from_dict({"rank": 0})


def test_a_replica_layout_is_its_workers_answers_merged() -> None:
    table = TensorTable.build([[("w", "bfloat16", (8, 4))]])
    halves = [
        WorkerLayout(
            r, (ParamSpec("w", "bfloat16", (4, 4)),), (Fill(0, Box((4 * r, 0), (4, 4)), 0, Box.whole((4, 4))),)
        )
        for r in (0, 1)
    ]
    merged = EngineLayout.merged(table.layout_digest(), [{"layout": h.to_dict()} for h in reversed(halves)])
    assert merged.workers == tuple(halves) and merged.why_not(table) == ""
    broken = EngineLayout.merged(table.layout_digest(), [{"layout": halves[0].to_dict()}, {"error": "worker 1: no"}])
    assert broken.unsupported == "worker 1: no" and broken.why_not(table).endswith(
        "could not be recorded: worker 1: no"
    )
