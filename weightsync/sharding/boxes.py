"""Boxes: the one geometry both layouts and the plan speak.

A *box* is an axis-aligned block of a tensor: an offset and a length per dimension.
A trainer rank's local shard of a DTensor is a box of the full tensor (``Shard(d)``
cuts dimension ``d`` into chunks, ``Replicate`` cuts nothing); what a vLLM worker
keeps of a checkpoint tensor is a box of it (column-parallel: a block of rows;
row-parallel: a block of columns; an expert: the whole tensor), and where it lands
is a box of the worker's parameter (rows ``[q, q + k)`` of a fused ``qkv_proj``, the
``e``-th expert of a stacked ``w13``). Every region that moves is one box of a
checkpoint tensor copied into one box of a parameter, element by element in
row-major order.

Two boxes can carry one another's elements in that order only when they have the
same lengths once their length-1 dimensions are dropped (``aligned``): a
``(1, 192, 4096)`` block of a stacked expert parameter takes a ``(192, 4096)`` block
of a checkpoint tensor. Then any sub-box of the source maps to a sub-box of the
destination (``carry``), which is what lets the plan cut a worker's need at the
trainer ranks' shard boundaries and still know where each piece lands.

``box_of_view`` turns a strided view (offset, shape, strides) of a contiguous tensor
into the box it covers, or None when the view is not a box read in row-major order
(a transpose, a gather); the engine side records vLLM's loaders as such views.
Everything here is integer arithmetic: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from weightsync.errors import ModelMismatchError, PermanentError


@dataclass(frozen=True, slots=True)
class Box:
    """``offsets[d] <= index[d] < offsets[d] + lengths[d]`` for every dimension ``d``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise PermanentError(
                f"box offsets {list(self.offsets)} and lengths {list(self.lengths)} differ in rank; "
                "give one offset and one length per dimension"
            )
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.lengths):
            raise PermanentError(f"box {self}: offsets and lengths must be non-negative")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths, strict=True))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.ends, shape, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None when the boxes share no element."""
        if other.ndim != self.ndim:
            raise PermanentError(f"boxes {self} and {other} differ in rank")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def contains(self, other: Box) -> bool:
        """Whether every element of ``other`` lies in this box (``intersect(other) == other``, with no new box)."""
        return other.ndim == self.ndim and all(
            a <= b and b + m <= a + n
            for a, n, b, m in zip(self.offsets, self.lengths, other.offsets, other.lengths, strict=True)
        )

    def overlaps(self, other: Box) -> bool:
        return self.intersect(other) is not None

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(self.offsets, self.lengths, strict=True)) + "]"


def _squeezed(lengths: Sequence[int]) -> list[int]:
    return [i for i, n in enumerate(lengths) if n != 1]


def aligned(source: Box, dest: Box) -> bool:
    """Whether ``source``'s elements in row-major order fill ``dest`` block for block (see the module doc)."""
    s, d = _squeezed(source.lengths), _squeezed(dest.lengths)
    return [source.lengths[i] for i in s] == [dest.lengths[i] for i in d]


def carry(piece: Box, source: Box, dest: Box) -> Box:
    """Where ``piece`` (a sub-box of ``source``) lands in ``dest``, for an aligned pair ``source -> dest``."""
    if piece.intersect(source) != piece:
        raise PermanentError(f"box {piece} is not inside {source}")
    s, d = _squeezed(source.lengths), _squeezed(dest.lengths)
    if [source.lengths[i] for i in s] != [dest.lengths[i] for i in d]:
        raise PermanentError(f"box {source} does not fill {dest} element for element")
    offsets, lengths = list(dest.offsets), list(dest.lengths)
    for si, di in zip(s, d, strict=True):
        offsets[di] += piece.offsets[si] - source.offsets[si]
        lengths[di] = piece.lengths[si]
    return Box(tuple(offsets), tuple(lengths))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def _canonical(shape: Sequence[int], strides: Sequence[int]) -> list[tuple[int, int]]:
    """(length, stride) runs with length-1 dimensions dropped and mergeable neighbours merged.

    Two views of one storage with the same offset and the same canonical runs visit the
    same elements in the same order.
    """
    runs: list[tuple[int, int]] = []
    for n, st in zip(shape, strides, strict=True):
        if n == 1:
            continue
        if runs and runs[-1][1] == n * st:
            runs[-1] = (runs[-1][0] * n, st)
        else:
            runs.append((n, st))
    return runs


def _unravel(index: int, shape: Sequence[int]) -> list[int]:
    coords = []
    for s in reversed(shape):
        coords.append(index % s)
        index //= s
    return coords[::-1]


def box_of_view(offset: int, shape: Sequence[int], strides: Sequence[int], base: Sequence[int]) -> Box | None:
    """The box a strided view covers in a contiguous tensor of shape ``base``, in row-major order.

    None when the view is empty, reads outside ``base``, or is not a box visited in
    row-major order (transposed, strided by a step, or overlapping itself).
    """
    numel = math.prod(shape)
    if numel == 0 or any(st < 0 for st in strides) or 0 in base:
        return None
    last = offset + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    if offset < 0 or last >= math.prod(base):
        return None
    lo, hi = _unravel(offset, base), _unravel(last, base)
    lengths = tuple(h - low + 1 for low, h in zip(lo, hi, strict=True))
    if any(n <= 0 for n in lengths) or math.prod(lengths) != numel:
        return None
    if _canonical(shape, strides) != _canonical(lengths, contiguous_strides(base)):
        return None
    return Box(tuple(lo), lengths)


def check_inside(box: Box, shape: Sequence[int], what: str) -> None:
    """Raise naming ``what`` when ``box`` does not lie inside a tensor of ``shape``."""
    if not box.within(shape):
        raise ModelMismatchError(f"{what}: box {box} lies outside its tensor of shape {list(shape)}")
