"""The batched digest and copy kernels, run by Triton's interpreter on the CPU (the same kernel code a GPU
compiles; the GPU tier runs them compiled, ``tests/gpu/test_batched_gpu.py``).

Triton reads ``TRITON_INTERPRET`` when it is imported, which the test session has done long before, so
``test_batched.py`` runs this module in a pytest of its own with the variable set.

A batched digest must equal ``digests.word`` of each tensor bit for bit (the trainer's and a replica's digests
meet whatever path computed them), and a flipped bit must still change it; a batched copy must land every byte
where a copy of each pair would.
"""

from __future__ import annotations

import os

import pytest
import torch

from weightsync.channels import batched, digests

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="test_batched.py runs it, interpreted"),
]


def _weights() -> list[torch.Tensor]:
    """Tensors of a model's kinds, more than one chunk among them, not in address order."""
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(batched.CHUNK * 4 * 2 + 4096, generator=gen).to(torch.bfloat16)  # 2 chunks and 1024 words
    fused = torch.randn(96, 64, generator=gen)
    return [fused[32:64], big, torch.randn(4096, generator=gen).to(torch.bfloat16), fused[0:32], torch.ones(2)]


def test_batched_digests_equal_the_per_tensor_digests() -> None:
    tensors = _weights()
    assert all(batched.eligible(t) for t in tensors)
    got = batched.Digests(tensors)(tensors)
    assert got.tolist() == [int(digests.word(t)) for t in tensors]


def test_a_flipped_bit_in_any_chunk_changes_that_tensors_digest_only() -> None:
    tensors = _weights()
    prepared = batched.Digests(tensors)
    before = prepared(tensors).tolist()
    big = tensors[1].view(torch.int16)
    big[batched.CHUNK * 4 * 2 + 3] ^= 1 << 9  # a bit in the big tensor's third chunk (4 bf16 to a word)
    after = prepared(tensors).tolist()
    assert after[1] != before[1]
    assert after[:1] + after[2:] == before[:1] + before[2:]


def test_words_mixes_batched_and_per_tensor_digests_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched, "available", lambda device: True)
    odd = torch.arange(3, dtype=torch.bfloat16)  # 6 bytes: not whole words
    unaligned = torch.arange(64, dtype=torch.float32)[2:34]  # 8 bytes past a 16-byte aligned start
    tensors = [*_weights(), odd, unaligned]
    assert not batched.eligible(odd) and not batched.eligible(unaligned)
    assert digests.words(tensors).tolist() == [int(digests.word(t)) for t in tensors]


def test_batched_copies_land_every_pair_and_leave_the_rest_untouched() -> None:
    srcs = _weights()
    stage = torch.zeros(sum(t.numel() * t.element_size() for t in srcs) + 64, dtype=torch.uint8)
    dests, at = [], 0
    for t in srcs:
        n = t.numel() * t.element_size()
        dests.append(stage[at : at + n].view(t.dtype).view(t.shape))
        at += n
    cast = torch.zeros(4096)  # a bfloat16 source into float32: not bytes, copied by torch
    batched.copies([*dests, cast], [*srcs, srcs[2]])()
    assert all(torch.equal(d, s) for d, s in zip(dests, srcs, strict=True))
    assert torch.equal(cast, srcs[2].float())
    assert not stage[at:].any()


def _strided() -> list[torch.Tensor]:
    """Strided views as a sharded rank digests them: column blocks of a row shard (a row-parallel region), a block
    of a 3-D expert tensor, a view whose rows are long enough to be more than one chunk, and a contiguous one."""
    gen = torch.Generator().manual_seed(11)
    shard = torch.randn(48, 512, generator=gen).to(torch.bfloat16)  # rows of 1 KiB
    experts = torch.randn(4, 16, 256, generator=gen)
    wide = torch.randn(3, batched.CHUNK * 3, generator=gen).to(torch.bfloat16)  # rows of 1.5 chunks
    return [shard[8:40, 256:], shard[:, :128], experts[1:3, 4:12, 64:192], wide[:, : batched.CHUNK * 2], shard[4:8]]


def test_batched_digests_read_strided_views_as_their_rows() -> None:
    tensors = _strided()
    assert not any(t.is_contiguous() for t in tensors[:4])
    assert all(batched.runs(t) is not None for t in tensors)
    got = batched.Digests(tensors)(tensors)
    assert got.tolist() == [int(digests.word(t)) for t in tensors]
    # a flipped bit inside the first view's last row changes its word only; one outside every view changes none
    base = tensors[0]._base if tensors[0]._base is not None else tensors[0]
    base.view(torch.int16)[39, 300] ^= 1 << 3
    after = batched.Digests(tensors)(tensors).tolist()
    assert after[0] != got[0] and after[1:] == got.tolist()[1:]
    base.view(torch.int16)[45, 200] ^= 1 << 3  # row 45, column 200: outside shard[8:40, 256:] and shard[:, :128]
    assert batched.Digests(tensors)(tensors).tolist() == after


def test_short_or_misaligned_runs_keep_the_per_tensor_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched, "available", lambda device: True)
    x = torch.arange(64 * 128, dtype=torch.float32).view(64, 128)
    assert batched.runs(x[:, :8]) is None  # 32-byte rows: shorter than MIN_RUN
    assert batched.runs(x[:, 2:126]) is None  # 496-byte rows that start 8 bytes past a 16-byte boundary
    assert batched.runs(x[:, 4:128]) == (x[:, 4:].data_ptr(), 496, (64,), (512,))  # aligned: a run per row
    assert batched.runs(x) == (x.data_ptr(), 64 * 128 * 4, (), ())  # contiguous: one run
    mixed = [x[:, :8], *_strided(), x[:, 2:126]]
    assert digests.words(mixed).tolist() == [int(digests.word(t)) for t in mixed]


def test_a_copy_digest_writes_every_pair_and_gives_the_words_of_what_it_wrote() -> None:
    """Strided sources (a rank's row-parallel cuts, rows longer than a chunk) into contiguous places and contiguous
    pairs more than one chunk long: each destination equals its source, each word equals ``digests.word`` of the
    destination, and nothing beside the destinations is written. A block of a 3-D tensor (rows at two strides) is
    not one launch's (``copy_words`` copies it apart, below)."""
    strided = _strided()
    assert batched.pairable(torch.empty(strided[2].shape), strided[2]) is None
    srcs = [*strided[:2], *strided[3:], *_weights()[:2]]
    stage = torch.zeros(sum(t.numel() * t.element_size() for t in srcs) + 4096, dtype=torch.uint8)
    dests, at = [], 16
    for t in srcs:
        n = t.numel() * t.element_size()
        dests.append(stage[at : at + n].view(t.dtype).view(t.shape))
        at += -(-n // 16) * 16
    pairs = [batched.pairable(d, s) for d, s in zip(dests, srcs, strict=True)]
    assert all(p is not None for p in pairs)
    got = batched.copy_digest(dests, srcs, pairs)  # type: ignore[arg-type]
    assert all(torch.equal(d, s) for d, s in zip(dests, srcs, strict=True))
    assert got.tolist() == [int(digests.word(d)) for d in dests]
    assert not stage[:16].any() and not stage[at:].any()
    # a changed source byte changes its pair's word only
    srcs[0][3, 5] += 1
    again = batched.copy_digest(dests, srcs, pairs)  # type: ignore[arg-type]
    assert again[0] != got[0] and again.tolist()[1:] == got.tolist()[1:]
    assert again[0] == digests.word(dests[0])


def test_copy_words_takes_the_pairs_a_launch_cannot_read_apart_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batched, "available", lambda device: True)
    x = torch.arange(64 * 128, dtype=torch.float32).view(64, 128)
    srcs = [x[:, 2:126], *_strided(), x[:, :8]]  # misaligned rows, then short ones: torch's copies
    dests = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    got = digests.copy_words(dests, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dests, srcs, strict=True))
    assert got.tolist() == [int(digests.word(d)) for d in dests]
