"""Random trainers and replicas for the sharded path's tests, and a plan executed on unique integers.

Replicas are kept the ways vLLM keeps tensors (column- and row-parallel shards, fused parameters, replicated
heads, padded parameters, experts kept by one worker, tensors needed whole, tensors a worker does not keep),
made up here for property tests of the plan: the product records its engine layouts from vLLM's loaders.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import WHOLE, EngineLayout, Fill, ParamSpec, WorkerLayout
from weightsync.sharding.plans import Member, TransferPlan
from weightsync.sharding.shards import REPLICATE, Mesh, Placement, TrainerLayout, chunk
from weightsync.tensors import ITEMSIZE, TensorTable


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


def random_table(rng: random.Random, count: int) -> TensorTable:
    tensors = []
    for i in range(count):
        shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3)))
        tensors.append((f"t{i}", rng.choice(["bfloat16", "float32"]), shape))
    return TensorTable.build([tensors[i : i + 3] for i in range(0, count, 3)])


def random_trainer(rng: random.Random, table: TensorTable) -> TrainerLayout:
    world = rng.choice([1, 2, 3, 4, 6, 8])
    meshes = [Mesh((world,), tuple(range(world)))]
    if world % 2 == 0 and world > 2:
        meshes.append(Mesh((2, world // 2), tuple(range(world))))  # FSDP x TP
    meshes += [Mesh((1,), (r,)) for r in range(world)]  # a rank holding a tensor whole (an expert)
    placements = []
    for spec in table:
        m = rng.randrange(len(meshes))
        choices = [REPLICATE, *range(len(spec.shape))]
        placements.append(Placement(m, tuple(rng.choice(choices) for _ in meshes[m].shape)))
    return TrainerLayout(table, world, tuple(meshes), tuple(placements))


def random_replica(rng: random.Random, table: TensorTable, workers: int) -> EngineLayout:
    """A replica of ``workers`` tensor-parallel workers, each tensor kept one of the ways vLLM keeps them."""
    per_worker: list[tuple[list[ParamSpec], list[Fill]]] = [([], []) for _ in range(workers)]
    fused: list[list[tuple[int, Box]]] = [[] for _ in range(workers)]  # (tensor, need) stacked into one param
    for t, spec in enumerate(table.tensors):
        shape = spec.shape
        mode = rng.choice(["column", "row", "replicate", "heads", "expert", "whole", "skip", "fused"])
        for w in range(workers):
            params, fills = per_worker[w]
            need: Box | None = None
            if mode in {"column", "fused", "row"}:
                dim = len(shape) - 1 if mode == "row" else 0
                start, n = chunk(shape[dim], workers, w)
                if n:
                    need = Box(
                        tuple(start if d == dim else 0 for d in range(len(shape))),
                        tuple(n if d == dim else s for d, s in enumerate(shape)),
                    )
            elif mode == "heads":  # fewer heads than workers: neighbours keep the same rows
                parts = max(1, min(shape[0], workers // 2))
                start, n = chunk(shape[0], parts, w * parts // workers)
                need = Box((start, *(0,) * (len(shape) - 1)), (n, *shape[1:]))
            elif mode == "replicate" or (mode == "expert" and w == t % workers):
                need = Box.whole(shape)
            elif mode == "whole":
                fills.append(Fill(t, Box.whole(shape), WHOLE, Box.whole(shape)))
            if need is None:
                continue
            if mode == "fused":
                fused[w].append((t, need))
            elif mode == "expert":  # its block of a stacked expert parameter
                params.append(ParamSpec(f"w{t}.experts", spec.dtype, (3, *shape)))
                slot = rng.randrange(3)
                fills.append(
                    Fill(
                        t, need, len(params) - 1, Box((slot, *need.offsets[:0], *(0,) * len(shape)), (1, *need.lengths))
                    )
                )
            else:  # its own parameter, padded now and then (a vocabulary padded to the worker count)
                pad = rng.choice([0, 0, 2])
                params.append(ParamSpec(f"w{t}.weight", spec.dtype, (need.lengths[0] + pad, *need.lengths[1:])))
                fills.append(Fill(t, need, len(params) - 1, Box((0,) * len(shape), need.lengths)))
    for w in range(workers):
        params, fills = per_worker[w]
        by_tail: dict[tuple[int, ...], list[tuple[int, Box]]] = {}
        for t, need in fused[w]:
            by_tail.setdefault(need.lengths[1:], []).append((t, need))
        for tail, parts in by_tail.items():  # rows stacked like q/k/v in qkv_proj
            rows = sum(need.lengths[0] for _, need in parts)
            params.append(ParamSpec(f"fused{tail}", "bfloat16", (rows, *tail)))
            at = 0
            for t, need in parts:
                fills.append(Fill(t, need, len(params) - 1, Box((at, *(0,) * len(tail)), need.lengths)))
                at += need.lengths[0]
    return EngineLayout(
        table.layout_digest(), tuple(WorkerLayout(w, tuple(p), tuple(f)) for w, (p, f) in enumerate(per_worker))
    )


def execute(trainer: TrainerLayout, members: Sequence[Member], result: TransferPlan) -> None:
    """Run the plan on unique integers; assert each worker ends up with exactly what its layout says."""
    table = trainer.table
    base = 0
    full = []
    for spec in table:
        full.append(torch.arange(base, base + math.prod(spec.shape)).view(spec.shape))
        base += math.prod(spec.shape)
    sent: dict[tuple[str, int], dict[tuple[int, int], torch.Tensor]] = {}
    for rid, r in result.ordered():
        shard = trainer.shard(r.tensor, r.rank)
        assert shard is not None and shard.intersect(r.source) == r.source, f"rank {r.rank} does not hold {r.source}"
        local = full[r.tensor][slices(shard)]  # all the rank has
        rel = Box(tuple(a - b for a, b in zip(r.source.offsets, shard.offsets, strict=True)), r.source.lengths)
        assert r.nbytes == r.source.numel * ITEMSIZE[table.tensors[r.tensor].dtype]
        worker = sent.setdefault((rid, r.worker), {})
        target = worker.get((r.param, r.tensor if r.param == WHOLE else -1))
        if target is None:
            layout = next(m.layout for m in members if m.replica_id == rid)
            assert layout is not None
            shape = (
                table.tensors[r.tensor].shape if r.param == WHOLE else layout.workers[r.worker].params[r.param].shape
            )
            target = worker[r.param, r.tensor if r.param == WHOLE else -1] = torch.full(shape, -1)
        view = target[slices(r.dest)]
        assert bool((view == -1).all()), f"region {r} lands on elements already written"
        view.copy_(local[slices(rel)].reshape(r.dest.lengths))
    for m in members:
        rp = result.replica(m.replica_id)
        if not rp.sharded:
            assert not rp.regions
            continue
        assert m.layout is not None
        for w in m.layout.workers:
            got = sent.get((m.replica_id, w.rank), {})
            expected: dict[tuple[int, int], torch.Tensor] = {}
            for f in w.fills:
                key = (f.param, f.tensor if f.param == WHOLE else -1)
                if key not in expected:
                    shape = table.tensors[f.tensor].shape if f.param == WHOLE else w.params[f.param].shape
                    expected[key] = torch.full(shape, -1)
                expected[key][slices(f.dest)] = full[f.tensor][slices(f.source)].reshape(f.dest.lengths)
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(got[key], value), f"replica {m.replica_id} worker {w.rank} param {key}"
            assert sum(r.nbytes for r in rp.receives(w.rank)) == w.bytes_needed(table)
