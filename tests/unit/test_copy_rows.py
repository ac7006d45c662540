"""How a region's two sides are read as rows: the copy engines' 2D copies (``peer_copies``) and the batched
copy-and-digest launch (``batched.pairable``, whose answers are kept by everything they depend on)."""

from __future__ import annotations

import pytest
import torch

from weightsync.channels import batched, peer_copies

pytestmark = pytest.mark.unit


def test_a_row_parallel_cut_is_rows_at_its_shards_stride_and_a_contiguous_side_takes_the_others_rows() -> None:
    shard = torch.zeros(8, 16, dtype=torch.bfloat16)
    cut = shard[:, 4:8]  # a rank's row-parallel region: 4 elements of every row
    base = shard.data_ptr()
    assert peer_copies.rows(shard) == (base, 256, 1, 256)  # contiguous: one row
    assert peer_copies.rows(cut) == (base + 8, 8, 8, 32)
    place = torch.zeros(8, 4, dtype=torch.bfloat16)
    assert peer_copies.pair(place, cut) == ((place.data_ptr(), 8, 8, 8), (base + 8, 8, 8, 32))
    assert peer_copies.pair(cut, place) == ((base + 8, 8, 8, 32), (place.data_ptr(), 8, 8, 8))
    # a box of a box (two strided dims) is not rows at one stride: torch's own copy takes it
    assert peer_copies.rows(torch.zeros(4, 4, 4)[:, :2, :2]) is None
    assert peer_copies.pair(torch.zeros(4, 2, 2), torch.zeros(4, 4, 4)[:, :2, :2]) is None


def test_pairable_answers_again_only_for_the_same_addresses_shapes_strides_and_dtypes() -> None:
    memory = torch.zeros(1 << 12, dtype=torch.int64)
    a, b = memory[:1024], memory[2048:3072]
    pa, pb = a.data_ptr(), b.data_ptr()
    first = batched.pairable(a, b)
    assert first == (pa, pb, 1024, 1024, 8192, 8192) and batched.pairable(a, b) == first
    # the same first addresses seen as other tensors: answered for what they are, not from what was kept
    assert batched.pairable(a.view(8, 128)[:, :64], b.view(8, 128)[:, :64]) == (pa, pb, 64, 512, 1024, 1024)
    assert batched.pairable(a[:512], b[:512]) == (pa, pb, 512, 512, 4096, 4096)
    assert batched.pairable(a.view(8, 128)[:, :64], b[:512].view(8, 64)) == (pa, pb, 64, 512, 512, 1024)
    assert batched.pairable(a.view(8, 128), b.view(16, 64)) is None  # shapes differ
