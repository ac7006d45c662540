"""How ``regions`` cuts a side's regions into buckets and rounds: what lets both ends post matching messages.

The transfer itself (gloo groups, faults) is ``tests/integration/test_region_stream.py``; this is the cut alone,
over a random plan-like list, so a change that makes the two ends cut differently fails here first.
"""

from __future__ import annotations

import random

import pytest
import torch

from weightsync.channels import regions
from weightsync.sharding.boxes import Box
from weightsync.sharding.plans import Region

pytestmark = pytest.mark.unit


def _plan(seed: int, n: int = 200) -> list[Region]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = rng.choice([6, 64, 1000, 4096, 5000, 20000])  # odd sizes, exactly a bucket, larger than one
        out.append(Region(i, rng.randrange(3), rng.randrange(2), Box((0,), (size,)), 0, Box((0,), (size,)), size))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_both_ends_cut_each_link_into_the_same_buckets_in_plan_order(seed: int) -> None:
    plan = _plan(seed)
    bucket = 4096
    for worker in range(2):
        received = regions._rounds([r for r in plan if r.worker == worker], regions.rank_of, bucket)
        for rank in range(3):
            sent = regions._rounds([r for r in plan if r.rank == rank], lambda r: 100 + r.worker, bucket)
            theirs = [[r for _, r in b.regions] for rnd in sent for b in rnd if b.peer == 100 + worker]
            ours = [[r for _, r in b.regions] for rnd in received for b in rnd if b.peer == rank]
            assert theirs == ours  # the same messages, in the same order, on the link rank -> worker
            link = [r for r in plan if r.rank == rank and r.worker == worker]
            assert [r for b in ours for r in b] == link  # every region once, in plan order
            for b in ours:  # a bucket stays within its size, or is one region larger than it
                assert len(b) == 1 or sum(regions.aligned(r.nbytes) for r in b) <= bucket


def test_a_round_holds_the_next_bucket_of_every_link_that_has_one() -> None:
    plan = _plan(7)
    rounds = regions._rounds(plan, regions.rank_of, 4096)
    depth = {p: sum(1 for rnd in rounds for b in rnd if b.peer == p) for p in range(3)}
    for k, rnd in enumerate(rounds):
        assert sorted(b.peer for b in rnd) == sorted(p for p, d in depth.items() if d > k)


def test_a_bucket_lays_regions_at_16_byte_boundaries_then_their_words() -> None:
    plan = _plan(3, 12)
    for rnd in regions._rounds(plan, regions.rank_of, 1 << 20):
        for b in rnd:
            buffer = torch.zeros(b.nbytes, dtype=torch.uint8)
            views = b.views(buffer)
            assert [v.numel() for v in views] == [r.nbytes for _, r in b.regions]
            assert all(v.storage_offset() % 16 == 0 for v in views)
            assert b.words(buffer).numel() == len(b.regions)
            assert b.words(buffer).storage_offset() * 8 >= views[-1].storage_offset() + views[-1].numel()
