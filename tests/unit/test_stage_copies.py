"""The switch's copies from the stage into the parameters: runs that lie back to back on both sides become one."""

from __future__ import annotations

import pytest
import torch

from weightsync_inference.staging import _coalesced

pytestmark = pytest.mark.unit


def _stage(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


def test_back_to_back_copies_merge_and_land_where_each_would() -> None:
    qkv = torch.zeros(6, 2)  # a fused parameter: q rows, k rows, v rows
    stage = _stage(96)
    q, k, v = (stage[i * 16 : (i + 1) * 16].view(torch.float32).reshape(2, 2) for i in range(3))
    norm, norm_stage = torch.zeros(4), stage[64:80].view(torch.float32)
    for i, t in enumerate((q, k, v, norm_stage), start=1):
        t.fill_(i)
    dests, srcs = _coalesced([qkv[0:2], qkv[2:4], qkv[4:6], norm], [q, k, v, norm_stage])
    assert [t.numel() for t in dests] == [48, 4] and dests[0].dtype == torch.uint8  # q, k, v: one copy of bytes
    torch._foreach_copy_(dests, srcs)
    assert torch.equal(qkv, torch.tensor([[1.0] * 2] * 2 + [[2.0] * 2] * 2 + [[3.0] * 2] * 2))
    assert torch.equal(norm, torch.full((4,), 4.0))


def test_a_gap_a_cast_or_another_order_keeps_copies_apart() -> None:
    qkv = torch.zeros(6, 2)
    stage = _stage(128)
    q = stage[0:16].view(torch.float32).reshape(2, 2)
    k = stage[32:48].view(torch.float32).reshape(2, 2)  # a gap in the stage after q
    assert len(_coalesced([qkv[0:2], qkv[2:4]], [q, k])[0]) == 2
    k = stage[16:32].view(torch.float32).reshape(2, 2)
    assert len(_coalesced([qkv[2:4], qkv[0:2]], [q, k])[0]) == 2  # the parameter's rows in another order
    half = torch.zeros(4, 2, dtype=torch.bfloat16)  # cast on the copy: elements, not bytes
    dests, srcs = _coalesced([half[0:2], half[2:4]], [q, k])
    assert len(dests) == 2 and dests[0].dtype == torch.bfloat16
    q.fill_(1.5)
    k.fill_(2.5)
    torch._foreach_copy_(dests, srcs)
    assert half.float().flatten().tolist() == [1.5] * 4 + [2.5] * 4
