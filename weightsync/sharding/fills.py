"""The engine's layout: what each vLLM worker keeps of every checkpoint tensor, and where it lands.

Each worker of a replica reports a ``WorkerLayout``, recorded by running vLLM's own
``load_weights`` against recording tensors (``weightsync_inference.recording``), never
from a table per architecture. It lists:

- ``fills``: a box of a checkpoint tensor (by its index in the trainer's table) that
  lands in a box of one of the worker's parameters (``params``, in checkpoint form: the
  shapes vLLM's loaders write, before any backend repacks them). Column- and
  row-parallel shards, the q/k/v and gate/up rows of fused parameters, the rows of a
  padded vocabulary, an expert's block of a stacked expert parameter: each is a fill.
  Parameter elements no fill covers (vocabulary padding) are the loader's to fill.
  A fill whose ``param`` is ``WHOLE`` is a tensor the worker needs whole and hands to
  vLLM's loader, because the loader reads it in a way a box cannot describe (a
  transpose, arithmetic); every tensor of the module it feeds goes whole then, since
  vLLM finalises a module as a unit (``why_whole`` says which and why).

Tensors with no fill are not this worker's (another expert-parallel rank's experts,
a tied head): it receives nothing of them. An ``EngineLayout`` is a replica's workers
in rank order, with the layout digest of the table they were recorded against; one
whose ``unsupported`` is set could not be recorded and takes the gathered path.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.errors import ModelMismatchError, PermanentError
from weightsync.sharding.boxes import Box, aligned, check_inside
from weightsync.tensors import ITEMSIZE, TensorTable

WHOLE = -1
"""``Fill.param`` of a need delivered whole to vLLM's loader rather than into a parameter box."""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Fill:
    """Box ``source`` of table tensor ``tensor`` lands in box ``dest`` of parameter ``param`` (an index into
    ``WorkerLayout.params``; ``WHOLE``: the tensor goes whole to the loader, ``dest`` is the whole tensor)."""

    tensor: int
    source: Box
    param: int
    dest: Box


@dataclass(frozen=True)
class WorkerLayout:
    rank: int
    params: tuple[ParamSpec, ...] = ()
    fills: tuple[Fill, ...] = ()
    why_whole: str = ""
    _needs: dict[int, tuple[Fill, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise PermanentError(f"worker rank {self.rank} must be non-negative")
        by_param: dict[int, list[Box]] = {}
        by_tensor: dict[int, list[Box]] = {}
        for f in self.fills:
            by_tensor.setdefault(f.tensor, []).append(f.source)
            if f.param == WHOLE:
                if f.source != f.dest or f.source.offsets != (0,) * f.source.ndim:
                    raise ModelMismatchError(
                        f"worker {self.rank}: whole tensor #{f.tensor} has boxes {f.source} -> {f.dest}; "
                        "a whole tensor's source and destination are the whole tensor"
                    )
                continue
            if not 0 <= f.param < len(self.params):
                raise ModelMismatchError(f"worker {self.rank}: a fill names parameter #{f.param} of {len(self.params)}")
            param = self.params[f.param]
            check_inside(f.dest, param.shape, f"worker {self.rank}, parameter {param.name!r}")
            if not aligned(f.source, f.dest):
                raise ModelMismatchError(
                    f"worker {self.rank}, parameter {param.name!r}: source box {f.source} of tensor #{f.tensor} "
                    f"does not fill destination box {f.dest} element for element"
                )
            by_param.setdefault(f.param, []).append(f.dest)
        for tensor, boxes in by_tensor.items():
            _refuse_overlap(
                boxes, f"worker {self.rank}, tensor #{tensor}", "needed; a worker receives each element once"
            )
        for index, boxes in by_param.items():
            where = f"worker {self.rank}, parameter {self.params[index].name!r}"
            _refuse_overlap(boxes, where, "filled; a parameter element takes one checkpoint element")

    def check(self, table: TensorTable) -> None:
        """Raise naming the fill when this layout does not fit ``table`` (recorded against another model)."""
        for f in self.fills:
            if not 0 <= f.tensor < len(table):
                raise ModelMismatchError(f"worker {self.rank}: a fill names tensor #{f.tensor} of {len(table)}")
            spec = table.tensors[f.tensor]
            check_inside(f.source, spec.shape, f"worker {self.rank}, tensor {spec.name!r}")
            if f.param == WHOLE and f.source.lengths != spec.shape:
                raise ModelMismatchError(f"worker {self.rank}: whole tensor {spec.name!r} is given as box {f.source}")

    def needs(self) -> Mapping[int, tuple[Fill, ...]]:
        """What this worker must receive of each tensor it keeps, by tensor index, in fill order."""
        if not self._needs and self.fills:
            out: dict[int, list[Fill]] = {}
            for f in self.fills:
                out.setdefault(f.tensor, []).append(f)
            self._needs.update({t: tuple(fs) for t, fs in out.items()})
        return self._needs

    def bytes_needed(self, table: TensorTable) -> int:
        return sum(f.source.numel * ITEMSIZE[table.tensors[f.tensor].dtype] for f in self.fills)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form that crosses vLLM's ``collective_rpc`` (boxes as ``[offsets, lengths]``)."""
        return {
            "rank": self.rank,
            "params": [[p.name, p.dtype, list(p.shape)] for p in self.params],
            "fills": [[f.tensor, *_box_to(f.source), f.param, *_box_to(f.dest)] for f in self.fills],
            "why_whole": self.why_whole,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkerLayout:
        try:
            return cls(
                rank=int(d["rank"]),
                params=tuple(ParamSpec(str(n), str(t), tuple(int(x) for x in s)) for n, t, s in d["params"]),
                fills=tuple(
                    Fill(int(t), Box(tuple(so), tuple(sl)), int(p), Box(tuple(do), tuple(dl)))
                    for t, so, sl, p, do, dl in d["fills"]
                ),
                why_whole=str(d.get("why_whole", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PermanentError(
                f"malformed worker layout ({type(e).__name__}: {e}); expected the form of WorkerLayout.to_dict()"
            ) from None


@dataclass(frozen=True)
class EngineLayout:
    """A replica's workers in rank order, recorded against the table whose layout digest is ``table_digest``."""

    table_digest: str
    workers: tuple[WorkerLayout, ...] = ()
    unsupported: str = ""

    def __post_init__(self) -> None:
        ranks = [w.rank for w in self.workers]
        if ranks != list(range(len(ranks))):
            raise PermanentError(f"engine layout lists worker ranks {ranks}; expected 0..{len(ranks) - 1} in order")
        if not self.unsupported and not self.workers:
            raise PermanentError("engine layout has no workers and gives no reason (set unsupported)")

    @classmethod
    def merged(cls, table_digest: str, answers: Sequence[Mapping[str, Any]]) -> EngineLayout:
        """A replica's layout from its workers' answers (``{"layout": WorkerLayout.to_dict()}`` or ``{"error":
        why}``, as ``WorkerExtension.weightsync_layout`` gives them): one worker that cannot be recorded makes the
        whole replica unsupported."""
        errors = sorted({str(a["error"]) for a in answers if a.get("error")})
        if errors:
            return cls(table_digest, unsupported="; ".join(errors))
        return cls(table_digest, tuple(sorted((WorkerLayout.from_dict(a["layout"]) for a in answers), key=_rank)))

    def why_not(self, table: TensorTable) -> str:
        """Why this replica cannot take regions of a version with ``table`` ("" when it can)."""
        if self.unsupported:
            return f"its engine layout could not be recorded: {self.unsupported}"
        if self.table_digest != table.layout_digest():
            return (
                f"its engine layout was recorded against table {self.table_digest[:19]}..., "
                f"not this version's {table.layout_digest()[:19]}...; it records again for a new table"
            )
        try:
            for w in self.workers:
                w.check(table)
        except ModelMismatchError as e:
            return f"its engine layout does not fit the table: {e}"
        return ""

    def digest(self) -> str:
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:  # immutable: hashed once, asked for every plan lookup
        h = hashlib.sha256(f"{self.table_digest}\0{self.unsupported}\n".encode())
        for w in self.workers:
            h.update(json.dumps(w.to_dict(), separators=(",", ":")).encode())
        return "sha256:" + h.hexdigest()


def _rank(worker: WorkerLayout) -> int:
    return worker.rank


def _box_to(box: Box) -> tuple[list[int], list[int]]:
    return list(box.offsets), list(box.lengths)


def _refuse_overlap(boxes: Sequence[Box], where: str, why: str) -> None:
    clash = _first_overlap(boxes)
    if clash:
        raise ModelMismatchError(f"{where}: boxes {clash[0]} and {clash[1]} are both {why}")


def _first_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | None:
    """Two boxes that share an element, by a sweep along dimension 0 (a parameter has thousands of expert boxes)."""
    if len(boxes) < 2 or boxes[0].ndim == 0:
        return (boxes[0], boxes[1]) if len(boxes) >= 2 else None
    active: list[Box] = []
    for box in sorted(boxes, key=lambda b: b.offsets):
        active = [a for a in active if a.ends[0] > box.offsets[0]]
        for a in active:
            if a.overlaps(box):
                return a, box
        active.append(box)
    return None
