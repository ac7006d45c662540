"""Explicit tensor metadata: the framing every channel shares.

Tensors travel as raw bytes plus this metadata; nothing is pickled. A
``TensorTable`` lists every tensor of one version in send order, each with its
byte offset in the version's logical byte stream (aligned, so any tensor can be
viewed in place from a packed buffer) and, when verification is on, its digest.
Tables cross process boundaries as plain JSON dicts and validate themselves on
construction, so a malformed table fails where it enters, naming the field.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.errors import ModelMismatchError, PermanentError

DIGEST_PREFIX = "sha256:"
"""The three whole-version digests share one format, ``sha256:<64 hex digits>``, and one name each:

- the **layout digest** (``TensorTable.layout_digest``): names, dtypes, shapes and offsets of every tensor
  in order; both ends know it before a byte moves, so a receiver checks the table it got against it;
- the **content digest** (``content_digest``): over the per-tensor digests; what the trainer sent and
  what a replica's engine computed while loading, compared by the coordinator;
- the **manifest checksum** (``manifest_checksum``): of a volume version's ``manifest.json``, recorded by
  the coordinator when the version becomes durable and checked by every replica before it trusts the
  manifest.
"""

ALIGNMENT = 64
"""Byte alignment of every tensor inside a packed stream (covers int64 views and SIMD loads)."""

ITEMSIZE: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}


def align(offset: int, alignment: int = ALIGNMENT) -> int:
    return (offset + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorSpec:
    """One tensor on the wire: what it is called, what it holds, where its bytes are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise PermanentError("tensor name is empty")
        if self.dtype not in ITEMSIZE:
            raise PermanentError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not supported; supported: {', '.join(ITEMSIZE)}"
            )
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise PermanentError(f"tensor {self.name!r}: shape {self.shape!r} must be non-negative ints")
        if self.offset < 0 or self.offset % ALIGNMENT:
            raise PermanentError(
                f"tensor {self.name!r}: offset {self.offset} must be a non-negative multiple of {ALIGNMENT}"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}
        if self.digest:
            d["digest"] = self.digest
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorSpec:
        try:
            return cls(
                name=str(d["name"]),
                dtype=str(d["dtype"]),
                shape=tuple(int(x) for x in d["shape"]),
                offset=int(d.get("offset", 0)),
                digest=str(d.get("digest", "")),
            )
        except KeyError as e:
            raise PermanentError(f"tensor metadata {dict(d)!r} lacks field {e.args[0]!r}") from None

    def same_layout(self, other: TensorSpec) -> bool:
        return (self.name, self.dtype, self.shape) == (other.name, other.dtype, other.shape)


@dataclass(frozen=True)
class TensorTable:
    """Every tensor of one version, in send order, with packed offsets.

    ``groups`` partitions the tensors into the units a sender gathers and sends
    together (one decoder layer each, plus the embeddings and the head): each
    group is a contiguous run of ``tensors``, given as its start indices.
    """

    tensors: tuple[TensorSpec, ...]
    group_starts: tuple[int, ...] = (0,)
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        end = 0
        for i, spec in enumerate(self.tensors):
            if spec.name in self._index:
                raise ModelMismatchError(f"tensor {spec.name!r} appears twice in the table")
            if spec.offset < end:
                raise PermanentError(f"tensor {spec.name!r}: offset {spec.offset} overlaps the previous tensor")
            end = spec.end
            self._index[spec.name] = i
        starts = self.group_starts
        if self.tensors and (
            not starts or starts[0] != 0 or list(starts) != sorted(set(starts)) or starts[-1] >= len(self.tensors)
        ):
            raise PermanentError(f"group_starts {starts!r} do not partition {len(self.tensors)} tensors")

    @classmethod
    def build(cls, groups: Iterable[Sequence[tuple[str, str, Sequence[int]]]]) -> TensorTable:
        """Lay out ``(name, dtype, shape)`` groups back to back with aligned offsets."""
        specs: list[TensorSpec] = []
        starts: list[int] = []
        offset = 0
        for group in groups:
            if not group:
                continue
            starts.append(len(specs))
            for name, dtype, shape in group:
                spec = TensorSpec(name, dtype, tuple(int(s) for s in shape), offset)
                specs.append(spec)
                offset = align(spec.end)
        return cls(tuple(specs), tuple(starts) or (0,))

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data (excluding alignment padding)."""
        return sum(s.nbytes for s in self.tensors)

    @property
    def span_bytes(self) -> int:
        """Bytes of the packed stream, padding included."""
        return align(self.tensors[-1].end) if self.tensors else 0

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)

    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self.tensors[self._index[name]]
        except KeyError:
            raise ModelMismatchError(f"tensor {name!r} is not in this version's table") from None

    def groups(self) -> list[tuple[TensorSpec, ...]]:
        bounds = [*self.group_starts, len(self.tensors)]
        return [self.tensors[a:b] for a, b in itertools.pairwise(bounds) if b > a]

    def with_digests(self, digests: Mapping[str, str]) -> TensorTable:
        missing = [s.name for s in self.tensors if s.name not in digests]
        if missing:
            raise PermanentError(f"no digest for tensors {missing[:5]!r}")
        specs = tuple(TensorSpec(s.name, s.dtype, s.shape, s.offset, digests[s.name]) for s in self.tensors)
        return TensorTable(specs, self.group_starts)

    def digests(self) -> dict[str, str]:
        return {s.name: s.digest for s in self.tensors if s.digest}

    def layout_digest(self) -> str:
        """The layout digest (see ``DIGEST_PREFIX``): what every tensor is and where, not what it holds."""
        return self._layout_digest

    @functools.cached_property
    def _layout_digest(self) -> str:  # a table is immutable: hashed once, asked every version
        h = hashlib.sha256()
        for s in self.tensors:
            h.update(f"{s.name}\0{s.dtype}\0{','.join(map(str, s.shape))}\0{s.offset}\n".encode())
        return DIGEST_PREFIX + h.hexdigest()

    def check_matches(self, expected: TensorTable) -> None:
        """Raise naming the first tensor that is missing, extra, or laid out differently."""
        for spec in expected:
            if spec.name not in self._index:
                raise ModelMismatchError(
                    f"tensor {spec.name!r} (dtype {spec.dtype}, shape {list(spec.shape)}) is expected "
                    f"but was not sent; check the trainer's name mapping"
                )
            got = self[spec.name]
            if not got.same_layout(spec):
                raise ModelMismatchError(
                    f"tensor {spec.name!r}: received dtype {got.dtype} shape {list(got.shape)}, "
                    f"expected dtype {spec.dtype} shape {list(spec.shape)}"
                )
        for spec in self:
            if spec.name not in expected._index:
                raise ModelMismatchError(f"tensor {spec.name!r} was sent but the receiver has no such tensor")

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": [s.to_dict() for s in self.tensors], "group_starts": list(self.group_starts)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorTable:
        try:
            tensors = tuple(TensorSpec.from_dict(t) for t in d["tensors"])
        except (KeyError, TypeError) as e:
            raise PermanentError(f"malformed tensor table: {e}") from None
        return cls(tensors, tuple(int(x) for x in d.get("group_starts", [0])))


def content_digest(digests: Mapping[str, str]) -> str:
    """The content digest (see ``DIGEST_PREFIX``) over per-tensor digests, in name order."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return DIGEST_PREFIX + h.hexdigest()


def manifest_checksum(data: bytes) -> str:
    """The manifest checksum (see ``DIGEST_PREFIX``) of a manifest file's bytes."""
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def is_digest(value: str) -> bool:
    """Whether ``value`` has the shared format ``sha256:<64 lowercase hex digits>``."""
    hexpart = value.removeprefix(DIGEST_PREFIX)
    return value.startswith(DIGEST_PREFIX) and len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)
