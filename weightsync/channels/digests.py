"""Per-tensor digests that give the same value on the CPU and on a GPU.

A digest must be computed where the tensor lives (copying a GPU tensor to the
host to hash it would cost more than sending it), and the trainer's and the
receiver's digests must agree bit for bit whatever device computed them. So the
digest is integer arithmetic only: the tensor's bytes read as little-endian
64-bit words w_i, combined as sum_i w_i * (2i + 1) modulo 2**64, together with the
byte length. Integer addition modulo 2**64 is associative, so the reduction order
of the device does not matter; odd multipliers make every word count and make
swapped words visible. It detects truncation, bit flips and misplaced bytes; it is
not a cryptographic hash (the volume's shard files carry sha256 for that).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightsync.channels.wire import as_bytes
from weightsync.tensors import TensorSpec

_CHUNK_WORDS = 1 << 22
_MASK = (1 << 64) - 1
_multipliers: dict[torch.device, torch.Tensor] = {}


def _odd(device: torch.device) -> torch.Tensor:
    m = _multipliers.get(device)
    if m is None:
        m = torch.arange(_CHUNK_WORDS, dtype=torch.int64, device=device) * 2 + 1
        _multipliers[device] = m
    return m


def digest(tensor: torch.Tensor) -> str:
    """The tensor's digest as ``"<nbytes>:<16 hex digits>"``."""
    raw = as_bytes(tensor.detach())
    n = raw.numel()
    whole = n - n % 8
    total = 0
    if whole:
        words = raw[:whole].view(torch.int64)
        odd = _odd(words.device)
        for start in range(0, words.numel(), _CHUNK_WORDS):
            chunk = words[start : start + _CHUNK_WORDS]
            k = chunk.numel()
            # sum w_j * (2(start+j)+1) = sum w_j*(2j+1) + 2*start*sum w_j   (mod 2**64)
            weighted = int(torch.sum(chunk * odd[:k]).item())
            plain = int(torch.sum(chunk).item())
            total = (total + weighted + 2 * start * plain) & _MASK
    if whole < n:
        tail = int.from_bytes(bytes(raw[whole:].cpu().tolist()), "little")
        total = (total + tail * (2 * (whole // 8) + 1)) & _MASK
    return f"{n}:{total:016x}"


def to_words(group_digests: list[str]) -> torch.Tensor:
    """Digests as one int64 tensor (their 64-bit sums), to travel in-band on a stream channel."""
    words = [int(d.split(":")[1], 16) for d in group_digests]
    return torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words], dtype=torch.int64)


def from_words(specs: Sequence[TensorSpec], words: torch.Tensor) -> dict[str, str]:
    """The inverse of ``to_words``, with each tensor's byte length from its spec."""
    return {s.name: f"{s.nbytes}:{int(w) & _MASK:016x}" for s, w in zip(specs, words.tolist(), strict=True)}
