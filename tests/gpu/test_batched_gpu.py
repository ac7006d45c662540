"""The batched kernels compiled for a real GPU (``weightsync.channels.batched``): a model's digests in one launch
equal the per-tensor digests bit for bit and still name a single flipped bit; a switch's batched copy lands every
byte. The CPU tier runs the same kernels under Triton's interpreter (``tests/unit/test_batched.py``)."""

from __future__ import annotations

import pytest
import torch

from bench import gpu_models
from weightsync.channels import batched, digests
from weightsync.channels.wire import view_from_bytes
from weightsync.tensors import align

pytestmark = pytest.mark.gpu


def _tensors(device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(3)
    out = []
    for spec in gpu_models.trainer_table("qwen3-1.7b"):
        t = torch.empty(spec.shape, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(generator=gen)
        out.append(t)
    return out


def test_batched_digests_equal_per_tensor_digests_and_catch_one_bit() -> None:
    device = torch.device("cuda:0")
    if not batched.available(device):
        pytest.skip("Triton is not installed")
    tensors = _tensors(device)
    odd = torch.arange(3, dtype=torch.bfloat16, device=device)  # not whole words: the per-tensor path
    tensors.append(odd)
    want = torch.stack([digests.word(t) for t in tensors])
    assert torch.equal(digests.words(tensors), want)
    embed = tensors[0].view(torch.int16).view(-1)
    embed[embed.numel() - 5] ^= 1  # the last chunk of the largest tensor
    got = digests.words(tensors)
    changed = (got != want).nonzero().flatten().tolist()
    assert changed == [0]


def test_batched_digests_of_a_ranks_strided_regions_equal_per_tensor_digests() -> None:
    """A 2-rank FSDP2 shard's TP=2 row-parallel regions (column halves of each row shard: the cuts a co-located
    rank digests) read as runs, one launch for all of them."""
    device = torch.device("cuda:0")
    if not batched.available(device):
        pytest.skip("Triton is not installed")
    cuts = []
    for t in _tensors(device):
        if t.dim() == 2 and t.shape[0] % 2 == 0 and t.shape[1] % 16 == 0:
            shard = t[: t.shape[0] // 2]
            cuts += [shard[:, : t.shape[1] // 2], shard[:, t.shape[1] // 2 :]]
    assert cuts and all(batched.runs(c) is not None and not c.is_contiguous() for c in cuts)
    want = torch.stack([digests.word(c) for c in cuts])
    assert torch.equal(digests.words(cuts), want)
    cuts[-1][-1, -1] = -cuts[-1][-1, -1] if cuts[-1][-1, -1] != 0 else 1.0  # the last word of the last run
    changed = (digests.words(cuts) != want).nonzero().flatten().tolist()
    assert changed == [len(cuts) - 1]


def test_a_copy_digest_lands_a_ranks_regions_in_their_places_with_the_words_of_what_it_wrote() -> None:
    """A co-located worker's copies: a 2-rank FSDP2 shard's TP=2 regions (row-parallel column halves, strided;
    column-parallel rows, contiguous) into separate parameters, one launch: every byte lands and each word equals
    ``digests.word`` of the written parameter."""
    device = torch.device("cuda:0")
    if not batched.available(device):
        pytest.skip("Triton is not installed")
    srcs = []
    for t in _tensors(device):
        if t.dim() == 2 and t.shape[0] % 2 == 0 and t.shape[1] % 16 == 0:
            shard = t[: t.shape[0] // 2]
            srcs += [shard[:, : t.shape[1] // 2], shard[: shard.shape[0] // 2]]
    dests = [torch.zeros(s.shape, dtype=s.dtype, device=device) for s in srcs]
    pairs = [batched.pairable(d, s) for d, s in zip(dests, srcs, strict=True)]
    assert all(p is not None for p in pairs) and any(not s.is_contiguous() for s in srcs)
    got = digests.copy_words(dests, srcs)
    # as bits: random bits hold NaNs, which torch.equal calls unequal to themselves
    assert all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(dests, srcs, strict=True))
    assert torch.equal(got, torch.stack([digests.word(d) for d in dests]))


def test_batched_copies_land_every_byte_into_separate_parameters() -> None:
    device = torch.device("cuda:0")
    if not batched.available(device):
        pytest.skip("Triton is not installed")
    table = gpu_models.trainer_table("qwen3-1.7b")
    stage = torch.empty(max(align(s.end) for s in table), dtype=torch.uint8, device=device)
    views = [view_from_bytes(stage, s) for s in table]
    for v, t in zip(views, _tensors(device), strict=True):
        v.copy_(t)
    params = [torch.full_like(v, 7.0) for v in views]
    batched.copies(params, views)()
    # bit patterns: random bfloat16 bits include NaNs, which never compare equal as numbers
    assert all(torch.equal(p.view(torch.int16), v.view(torch.int16)) for p, v in zip(params, views, strict=True))
