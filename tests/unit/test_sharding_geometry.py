"""Boxes and the trainer's shards against torch itself: the views vLLM's loaders take, DTensor's chunking.

Property-style: seeded random shapes, views and placements, each checked against what torch computes
(element indices through ``arange``, DTensor's own ``_compute_local_shape_and_global_offset``).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from weightsync.errors import ModelMismatchError, PermanentError
from weightsync.sharding.boxes import Box, aligned, box_of_view, carry
from weightsync.sharding.shards import (
    REPLICATE,
    SHARD,
    STRIDED,
    Mesh,
    Placement,
    TrainerLayout,
    chunk,
    local_box,
    placement_of,
)
from weightsync.tensors import TensorTable

pytestmark = pytest.mark.unit


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


def _random_view(rng: random.Random, base: torch.Tensor) -> torch.Tensor:
    """What loaders do to a checkpoint tensor: narrow, select, unsqueeze, chunk, now and then a transpose."""
    t = base
    for _ in range(rng.randint(0, 4)):
        op = rng.choice(["narrow", "narrow", "select", "unsqueeze", "chunk", "transpose", "flatten"])
        if op in {"narrow", "chunk", "select", "transpose"} and t.dim() == 0:
            continue
        d = rng.randrange(max(t.dim(), 1))
        if op == "narrow" and t.shape[d] > 0:
            start = rng.randrange(t.shape[d])
            t = t.narrow(d, start, rng.randint(1, t.shape[d] - start))
        elif op == "select" and t.shape[d] > 0:
            t = t.select(d, rng.randrange(t.shape[d]))
        elif op == "unsqueeze":
            t = t.unsqueeze(rng.randint(0, t.dim()))
        elif op == "chunk" and t.shape[d] > 0:
            parts = t.chunk(rng.randint(1, 3), d)
            t = parts[rng.randrange(len(parts))]
        elif op == "transpose" and t.dim() >= 2:
            t = t.transpose(0, t.dim() - 1)
        elif op == "flatten" and t.is_contiguous():
            t = t.flatten()
    return t


def test_box_of_view_finds_exactly_the_boxes_read_in_row_major_order() -> None:
    rng = random.Random(7)
    boxes = 0
    for _ in range(800):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        base = torch.arange(math.prod(shape)).view(shape)
        view = _random_view(rng, base)
        box = box_of_view(view.storage_offset(), tuple(view.shape), tuple(view.stride()), shape)
        if box is not None:
            boxes += 1
            assert box.within(shape)
            assert torch.equal(base[_slices(box)].flatten(), view.flatten())
        elif view.numel():
            # no box holds these elements in this order: the bounding box of their coordinates does not
            coords = torch.stack(torch.unravel_index(view.flatten(), shape), dim=1)
            lo, hi = coords.min(dim=0).values.tolist(), coords.max(dim=0).values.tolist()
            bounding = Box(tuple(lo), tuple(h - low + 1 for low, h in zip(lo, hi, strict=True)))
            assert not torch.equal(base[_slices(bounding)].flatten(), view.flatten())
    assert boxes > 250  # the generator mostly makes boxes, as loaders do


def test_carry_maps_a_piece_to_where_its_elements_land() -> None:
    rng = random.Random(11)
    for _ in range(500):
        lengths = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        src_shape = tuple(n + rng.randint(0, 3) for n in lengths)
        source = Box(tuple(rng.randint(0, s - n) for s, n in zip(src_shape, lengths, strict=True)), tuple(lengths))
        dest_lengths = [1, *lengths] if rng.random() < 0.5 else lengths  # an expert's block of a stacked param
        dest_shape = tuple(n + rng.randint(0, 3) for n in dest_lengths)
        dest = Box(
            tuple(rng.randint(0, s - n) for s, n in zip(dest_shape, dest_lengths, strict=True)), tuple(dest_lengths)
        )
        assert aligned(source, dest)
        full = torch.arange(math.prod(src_shape)).view(src_shape)
        param = torch.full(dest_shape, -1)
        param[_slices(dest)] = full[_slices(source)].reshape(dest.lengths)
        offsets = tuple(o + rng.randint(0, n - 1) for o, n in zip(source.offsets, source.lengths, strict=True))
        ends = [rng.randint(o + 1, s_o + n) for o, s_o, n in zip(offsets, source.offsets, source.lengths, strict=True)]
        piece = Box(offsets, tuple(e - o for o, e in zip(offsets, ends, strict=True)))
        landed = carry(piece, source, dest)
        assert torch.equal(param[_slices(landed)].flatten(), full[_slices(piece)].flatten())


def test_box_errors_name_the_problem() -> None:
    with pytest.raises(PermanentError, match="differ in rank"):
        Box((0,), (1, 2))
    with pytest.raises(PermanentError, match="non-negative"):
        Box((-1,), (2,))
    with pytest.raises(PermanentError, match="does not fill"):
        carry(Box((0,), (2,)), Box((0,), (2,)), Box((0,), (3,)))
    assert not aligned(Box((0, 0), (2, 3)), Box((0, 0), (3, 2)))  # a transpose is not a box copy


@pytest.mark.parametrize("length, parts", [(10, 4), (5, 4), (3, 8), (0, 2), (16, 4)])
def test_chunk_is_torch_chunk(length: int, parts: int) -> None:
    pieces = torch.arange(length).chunk(parts) if length else ()
    for i in range(parts):
        start, n = chunk(length, parts, i)
        expected = pieces[i].tolist() if i < len(pieces) else []
        assert list(range(start, start + n)) == expected


def test_local_boxes_are_dtensors_for_every_coordinate() -> None:
    rng = random.Random(3)
    for _ in range(400):
        shape = tuple(rng.randint(0, 13) for _ in range(rng.randint(1, 3)))
        mesh_shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 2)))
        dims = tuple(rng.choice([REPLICATE, *range(len(shape))]) for _ in mesh_shape)
        placements = [Replicate() if d == REPLICATE else Shard(d) for d in dims]
        for coord in Mesh(mesh_shape, tuple(range(math.prod(mesh_shape)))).coordinates():
            local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord[1]), placements)
            box = local_box(shape, mesh_shape, coord[1], Placement(0, dims))
            assert box.lengths == tuple(local), (shape, mesh_shape, dims, coord)
            if box.numel:
                assert box.offsets == tuple(offset), (shape, mesh_shape, dims, coord)


def test_fsdp_over_tensor_parallel_is_read_as_cutting_after_it() -> None:
    """FSDP2 on a (dp, tp) mesh over a column-parallel weight: _StridedShard(0, tp) then Shard(0).

    For sizes the mesh divides; torch cuts uneven sizes otherwise, which the trainer finds when it checks its
    layout against its own shards (and then takes the gathered path).
    """
    for dp, tp in [(2, 2), (2, 4), (4, 2), (3, 2)]:
        rows = dp * tp * 3
        torch_placements = [_StridedShard(0, split_factor=tp), Shard(0)]
        placement = placement_of(0, (dp, tp), [(STRIDED, 0, tp), (SHARD, 0, 0)])
        assert placement.cuts() == (1, 0)
        for _, coord in Mesh((dp, tp), tuple(range(dp * tp))).coordinates():
            local, offset = _compute_local_shape_and_global_offset((rows, 8), (dp, tp), list(coord), torch_placements)
            box = local_box((rows, 8), (dp, tp), coord, placement)
            assert box.lengths == tuple(local)
            if box.numel:
                assert box.offsets == tuple(offset)
    with pytest.raises(
        PermanentError, match=r"_StridedShard\(0, split_factor=3\) on mesh dimension 0 is not FSDP2's form"
    ):
        placement_of(0, (2, 2), [(STRIDED, 0, 3), (SHARD, 0, 0)])


def test_holders_partition_each_tensor_and_name_every_rank() -> None:
    rng = random.Random(5)
    for _ in range(200):
        shape = tuple(rng.randint(1, 11) for _ in range(rng.randint(1, 3)))
        mesh_shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 2)))
        ranks = tuple(rng.sample(range(20), math.prod(mesh_shape)))
        dims = tuple(rng.choice([REPLICATE, *range(len(shape))]) for _ in mesh_shape)
        table = TensorTable.build([[("t", "bfloat16", shape)]])
        layout = TrainerLayout(table, 20, (Mesh(mesh_shape, ranks),), (Placement(0, dims),))
        count = torch.zeros(shape, dtype=torch.int64)
        held = set()
        for box, owners in layout.holders(0):
            count[_slices(box)] += 1
            held.update(owners)
            for r in owners:
                assert layout.shard(0, r) == box
        assert bool((count == 1).all())
        assert held <= set(ranks)
        assert all(layout.shard(0, r) is None for r in set(ranks) - held)  # an empty chunk holds nothing


def test_trainer_layout_rejects_what_it_cannot_place_naming_the_tensor() -> None:
    table = TensorTable.build([[("w", "bfloat16", (4, 4))]])
    mesh = Mesh((2,), (0, 1))
    with pytest.raises(PermanentError, match=r"tensor 'w' of shape \[4, 4\]: Shard\(2\) names no dimension"):
        TrainerLayout(table, 2, (mesh,), (Placement(0, (2,)),))
    with pytest.raises(PermanentError, match="2 placements for a 1-D mesh"):
        TrainerLayout(table, 2, (mesh,), (Placement(0, (0, 1)),))
    with pytest.raises(PermanentError, match="rank 1, outside world_size 1"):
        TrainerLayout(table, 1, (mesh,), (Placement(0, (0,)),))
    with pytest.raises(ModelMismatchError, match="places 0 tensors, but its table has 1"):
        TrainerLayout(table, 2, (mesh,), ())
    with pytest.raises(PermanentError, match="expected 2 distinct ranks"):
        Mesh((2,), (0, 0))
    single = TrainerLayout.single(table)
    assert single.shard(0, 0) == Box.whole((4, 4)) and single.shard(0, 1) is None
