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

import threading
from collections.abc import Sequence

import torch

from weightsync.channels import batched
from weightsync.channels.wire import as_bytes
from weightsync.tensors import TensorSpec

_CHUNK_WORDS = 1 << 22
_MASK = (1 << 64) - 1
_multipliers: dict[torch.device, torch.Tensor] = {}
Layout = tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], ...]
_PREPARED = 1024
"""Batched digests kept prepared, by device and their tensors' offsets from the lowest and sizes (a receiver's
buckets, a stage's views, a sender's wire buffer for a group keep theirs from version to version). A sharded
rank's region buckets each have their own (Qwen3-8B to three replicas is about 770 buckets of 64 MiB on one
rank): preparing one costs host time comparable to its bucket's time on an NVLink, so they all stay prepared (a
prepared table is a few hundred bytes)."""
_prepared: dict[tuple[torch.device, Layout], batched.Digests] = {}
_prepared_lock = threading.Lock()


def _odd(device: torch.device) -> torch.Tensor:
    m = _multipliers.get(device)
    if m is None:
        m = torch.arange(_CHUNK_WORDS, dtype=torch.int64, device=device) * 2 + 1
        _multipliers[device] = m
    return m


def word(tensor: torch.Tensor) -> torch.Tensor:
    """The digest's 64-bit sum as a 0-d int64 tensor where the tensor lives, with no host sync.

    Integer arithmetic in int64 wraps modulo 2**64 on every device, so this equals the
    unsigned sum modulo 2**64 in two's complement. A byte length that is not a multiple of 8
    is padded with zero bytes: the padded last word is the little-endian value of the tail.
    """
    raw = as_bytes(tensor.detach())
    if raw.numel() % 8:
        raw = torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)])
    words = raw.view(torch.int64)
    odd = _odd(words.device)
    if words.numel() <= _CHUNK_WORDS:  # most tensors: two kernels (a per-tensor cost that dominates on a GPU)
        return torch.sum(words * odd[: words.numel()])
    total = torch.zeros((), dtype=torch.int64, device=raw.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS]
        # sum w_j * (2(start+j)+1) = sum w_j*(2j+1) + 2*start*sum w_j   (mod 2**64)
        total = total + torch.sum(chunk * odd[: chunk.numel()])
        if start:
            total = total + torch.sum(chunk) * (2 * start)
    return total


def words(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """Each tensor's digest word, as one int64 tensor on their device: kernels only, no host sync. On a GPU one
    launch for the whole group (``batched``) instead of two per tensor."""
    if not tensors:
        return torch.empty(0, dtype=torch.int64, device=device)
    if not batched.available(tensors[0].device):
        return torch.stack([word(t) for t in tensors])
    at = [batched.runs(t) for t in tensors]
    if None not in at:
        return _batched(tensors, _relative(at))
    # the few tensors a batched kernel cannot read (unaligned views, a tail that is not a whole word, short runs)
    some = [(t, a) for t, a in zip(tensors, at, strict=True) if a is not None]
    got = iter(_batched([t for t, _ in some], _relative([a for _, a in some])) if some else ())
    return torch.stack([word(t) if a is None else next(got) for t, a in zip(tensors, at, strict=True)])


def copy_words(dests: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``dests[i] <- srcs[i]`` (same shape and dtype) and each destination's digest word, the ``words`` of
    ``dests`` once written, computed from the bytes as they are written: on a GPU one batched kernel that reads each
    byte once and writes it once (``batched.copy_digest``) for the pairs it can read; no host sync."""
    if not dests:
        return torch.empty(0, dtype=torch.int64)
    if not batched.available(dests[0].device):
        torch._foreach_copy_(list(dests), list(srcs))
        return words(dests)
    pairs = [batched.pairable(d, s) for d, s in zip(dests, srcs, strict=True)]
    fast = [k for k, p in enumerate(pairs) if p is not None]
    rest = [k for k, p in enumerate(pairs) if p is None]  # another device, unaligned views, short runs
    if not rest:
        return batched.copy_digest(dests, srcs, [p for p in pairs if p is not None])
    got = iter(
        batched.copy_digest([dests[k] for k in fast], [srcs[k] for k in fast], [p for p in pairs if p is not None])
        if fast
        else ()
    )
    torch._foreach_copy_([dests[k] for k in rest], [srcs[k] for k in rest])
    slow = iter(words([dests[k] for k in rest]))
    return torch.stack([next(slow) if p is None else next(got) for p in pairs])  # as ``words`` puts its two kinds


def _relative(at: Sequence[batched.Runs | None]) -> Layout:
    """The tensors' runs with their offsets from the lowest: what a prepared digest depends on (``batched.Digests``
    takes the lowest address at each call), so tensors laid out alike in a new allocation (a group's wire buffer)
    reuse it."""
    lowest = min(a[0] for a in at if a is not None)
    return tuple((a[0] - lowest, *a[1:]) for a in at if a is not None)


def _batched(tensors: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor:
    key = (tensors[0].device, layout)  # a prepared table lives on one device
    with _prepared_lock:  # a stage's thread and the engine's digest at once
        prepared = _prepared.pop(key, None) or batched.Digests(tensors)
        _prepared[key] = prepared  # most recently used last
        if len(_prepared) > _PREPARED:
            del _prepared[next(iter(_prepared))]
    return prepared(tensors)


def digest(tensor: torch.Tensor) -> str:
    """The tensor's digest as ``"<nbytes>:<16 hex digits>"`` (one host sync; batch with ``words``)."""
    return f"{tensor.numel() * tensor.element_size()}:{int(word(tensor).item()) & _MASK:016x}"


def to_words(group_digests: Sequence[str], device: torch.device | None = None) -> torch.Tensor:
    """Digests as one int64 tensor (their 64-bit sums), to travel in-band on a stream channel."""
    values = [int(d.split(":")[1], 16) for d in group_digests]
    return torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in values], dtype=torch.int64, device=device)


def from_words(specs: Sequence[TensorSpec], words: torch.Tensor) -> dict[str, str]:
    """The inverse of ``to_words``, with each tensor's byte length from its spec."""
    return {s.name: f"{s.nbytes}:{int(w) & _MASK:016x}" for s, w in zip(specs, words.tolist(), strict=True)}
