"""The trainer's layout: which trainer rank holds which box of every tensor it publishes.

A trainer describes each tensor the way DTensor does: a device mesh (its shape and
the global ranks at each coordinate, row-major) and one placement per mesh
dimension, either ``Replicate`` or ``Shard(d)`` (that mesh dimension cuts tensor
dimension ``d`` into chunks). FSDP2 is ``Shard(0)`` on a 1-D mesh; tensor parallel
adds ``Shard(0)``/``Shard(1)`` on a second mesh dimension; a plain module on one
rank is a one-rank mesh holding everything. A tensor that one rank of a bigger
trainer holds whole (an expert of an expert-parallel trainer) is a one-rank mesh too.

FSDP2 over a tensor-parallel mesh cuts a tensor the tensor-parallel dimension already
cuts after it (``_StridedShard``): a placement's ``order`` says so (``placement_of``).

The boxes follow DTensor's rule for uneven sizes exactly (``torch.chunk``: chunks of
``ceil(n / k)``, the trailing ones short or empty), applied mesh dimension by mesh
dimension, so the same placements give the same boxes here (torch-free, in the
coordinator) and in the trainer's DTensors; the trainer checks its own local shards
against ``TrainerLayout.shard`` when it builds the layout.

Along each tensor dimension the ranks' intervals partition it, and a tensor's boxes
are the product of those partitions: a grid. ``holders`` lists the grid's cells with
the ranks holding each (more than one where a mesh dimension replicates), which is
all the plan needs.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from weightsync.errors import ModelMismatchError, PermanentError
from weightsync.sharding.boxes import Box
from weightsync.tensors import TensorTable

REPLICATE = -1
"""A mesh dimension whose placement is ``Replicate``; any other value is the tensor dimension it shards."""


@dataclass(frozen=True, slots=True)
class Mesh:
    """A device mesh: its shape and the global trainer rank at each coordinate, row-major."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.shape or any(s <= 0 for s in self.shape):
            raise PermanentError(f"mesh shape {list(self.shape)} must be one or more positive sizes")
        if len(self.ranks) != math.prod(self.shape) or len(set(self.ranks)) != len(self.ranks):
            raise PermanentError(
                f"mesh of shape {list(self.shape)} lists ranks {list(self.ranks)}: "
                f"expected {math.prod(self.shape)} distinct ranks, one per coordinate"
            )
        if any(r < 0 for r in self.ranks):
            raise PermanentError(f"mesh ranks {list(self.ranks)} must be non-negative")

    def coordinates(self) -> list[tuple[int, tuple[int, ...]]]:
        """(rank, coordinate) for every coordinate, row-major."""
        return list(zip(self.ranks, itertools.product(*(range(s) for s in self.shape)), strict=True))


@dataclass(frozen=True, slots=True)
class Placement:
    """How one tensor lies on the trainer: its mesh (an index into ``TrainerLayout.meshes``), per mesh
    dimension ``REPLICATE`` or the tensor dimension that mesh dimension shards, and the order in which the
    mesh dimensions cut (empty: mesh order, as DTensor's ``Shard``; FSDP2 over a tensor-parallel mesh marks
    its dimension ``_StridedShard`` to say it cuts after the tensor-parallel one)."""

    mesh: int
    shard_dims: tuple[int, ...]
    order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.order and sorted(self.order) != list(range(len(self.shard_dims))):
            raise PermanentError(
                f"placement order {list(self.order)} is not an order of the {len(self.shard_dims)} mesh dimensions"
            )

    def cuts(self) -> tuple[int, ...]:
        """The mesh dimensions in the order they cut."""
        return self.order or tuple(range(len(self.shard_dims)))

    def __str__(self) -> str:
        parts = ["Replicate()" if d == REPLICATE else f"Shard({d})" for d in self.shard_dims]
        order = f", cut in order {list(self.order)}" if self.order else ""
        return f"mesh {self.mesh} ({', '.join(parts)}{order})"


SHARD, STRIDED = "shard", "strided"


def placement_of(mesh: int, mesh_shape: Sequence[int], kinds: Sequence[tuple[str, int, int]]) -> Placement:
    """A ``Placement`` from DTensor's placements, one ``(kind, dim, split_factor)`` per mesh dimension.

    ``kind`` is ``REPLICATE``'s ``"replicate"``, ``SHARD`` or ``STRIDED`` (``_StridedShard``). FSDP2 over a
    tensor-parallel mesh places a tensor the tensor-parallel dimension already shards ``_StridedShard(d,
    split_factor=k)`` on its own mesh dimension, where ``k`` is the size of the later mesh dimensions that
    ``Shard(d)``: its chunks are cut after theirs. That is the one strided form read here; any other raises
    naming it (the trainer is then described as unsupported and takes the gathered path).
    """
    dims = tuple(REPLICATE if kind == "replicate" else dim for kind, dim, _ in kinds)
    strided = [i for i, (kind, _, _) in enumerate(kinds) if kind == STRIDED]
    if not strided:
        return Placement(mesh, dims)
    order = [i for i in range(len(kinds)) if i not in strided]
    for i in strided:
        _, dim, split = kinds[i]
        later = [j for j in range(i + 1, len(kinds)) if kinds[j][0] == SHARD and kinds[j][1] == dim]
        if not later or math.prod(mesh_shape[j] for j in later) != split:
            raise PermanentError(
                f"_StridedShard({dim}, split_factor={split}) on mesh dimension {i} is not FSDP2's form over "
                f"tensor parallelism (the later Shard({dim}) mesh dimensions have sizes "
                f"{[mesh_shape[j] for j in later]})"
            )
        order.insert(order.index(later[-1]) + 1, i)
    return Placement(mesh, dims, tuple(order))


def chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk ``index`` when ``torch.chunk`` cuts ``length`` into ``parts``, as DTensor does."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(length, start + size) - start


def local_box(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placement: Placement) -> Box:
    """The box a rank at ``coord`` holds: each sharding mesh dimension, in cut order, chunks what the previous
    left."""
    offsets, lengths = [0] * len(shape), list(shape)
    for mesh_dim in placement.cuts():
        dim = placement.shard_dims[mesh_dim]
        if dim == REPLICATE:
            continue
        start, length = chunk(lengths[dim], mesh_shape[mesh_dim], coord[mesh_dim])
        offsets[dim] += start
        lengths[dim] = length
    return Box(tuple(offsets), tuple(lengths))


@dataclass(frozen=True)
class TrainerLayout:
    """Every published tensor (the table, in send order) and where it lies across the trainer's ranks.

    ``placements[i]`` places ``table.tensors[i]``. A layout whose ``unsupported`` is set says why the trainer
    cannot be described this way (a ``Partial`` or strided placement, a source that computes its tensors):
    the plan then sends every replica the gathered path and repeats the reason.
    """

    table: TensorTable
    world_size: int
    meshes: tuple[Mesh, ...] = ()
    placements: tuple[Placement, ...] = ()
    unsupported: str = ""
    _holders: dict[int, tuple[tuple[Box, tuple[int, ...]], ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _shards: dict[int, tuple[Box | None, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise PermanentError(f"trainer world_size {self.world_size} must be positive")
        if self.unsupported:
            return
        if len(self.placements) != len(self.table):
            raise ModelMismatchError(
                f"trainer layout places {len(self.placements)} tensors, but its table has {len(self.table)}; "
                "give one placement per tensor, in table order"
            )
        for m, mesh in enumerate(self.meshes):
            if max(mesh.ranks) >= self.world_size:
                raise PermanentError(f"mesh {m} lists rank {max(mesh.ranks)}, outside world_size {self.world_size}")
        for spec, p in zip(self.table, self.placements, strict=True):
            if not 0 <= p.mesh < len(self.meshes):
                raise PermanentError(f"tensor {spec.name!r}: mesh {p.mesh} is not one of {len(self.meshes)} meshes")
            mesh = self.meshes[p.mesh]
            if len(p.shard_dims) != len(mesh.shape):
                raise PermanentError(
                    f"tensor {spec.name!r}: {len(p.shard_dims)} placements for a {len(mesh.shape)}-D mesh; "
                    "give one per mesh dimension"
                )
            bad = [d for d in p.shard_dims if d != REPLICATE and not 0 <= d < len(spec.shape)]
            if bad:
                raise PermanentError(
                    f"tensor {spec.name!r} of shape {list(spec.shape)}: Shard({bad[0]}) names no dimension of it"
                )

    @classmethod
    def single(cls, table: TensorTable) -> TrainerLayout:
        """A plain module on one rank: rank 0 holds every tensor whole."""
        mesh = Mesh((1,), (0,))
        return cls(table, 1, (mesh,), tuple(Placement(0, (REPLICATE,)) for _ in table))

    def shard(self, tensor: int, rank: int) -> Box | None:
        """The box ``rank`` holds of tensor ``tensor`` (an index into the table); None when it holds none."""
        return self.shards(rank)[tensor]

    def shards(self, rank: int) -> tuple[Box | None, ...]:
        """``shard(t, rank)`` of every tensor, computed once (a rank cuts every region of every version from them)."""
        cached = self._shards.get(rank)
        if cached is None:
            cached = self._shards[rank] = tuple(self._shard(t, rank) for t in range(len(self.table)))
        return cached

    def _shard(self, tensor: int, rank: int) -> Box | None:
        spec, p = self.table.tensors[tensor], self.placements[tensor]
        mesh = self.meshes[p.mesh]
        for r, coord in mesh.coordinates():
            if r == rank:
                box = local_box(spec.shape, mesh.shape, coord, p)
                return box if box.numel else None
        return None

    def holders(self, tensor: int) -> tuple[tuple[Box, tuple[int, ...]], ...]:
        """The distinct non-empty boxes of tensor ``tensor`` (they partition it), each with the ranks holding it."""
        cached = self._holders.get(tensor)
        if cached is None:
            cached = self._holders[tensor] = _holders(
                self.table.tensors[tensor].shape, self.meshes[self.placements[tensor].mesh], self.placements[tensor]
            )
        return cached

    def digest(self) -> str:
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:  # a layout is immutable: hashed once, asked every version
        h = hashlib.sha256(f"{self.table.layout_digest()}\0{self.world_size}\0{self.unsupported}\n".encode())
        for m in self.meshes:
            h.update(f"mesh {m.shape} {m.ranks}\n".encode())
        for p in self.placements:
            h.update(f"{p.mesh} {p.shard_dims} {p.order}\n".encode())
        return "sha256:" + h.hexdigest()


@functools.lru_cache(maxsize=4096)
def _holders(shape: tuple[int, ...], mesh: Mesh, p: Placement) -> tuple[tuple[Box, tuple[int, ...]], ...]:
    """Cached by (shape, mesh, placement): a model repeats few of them across thousands of tensors."""
    cells: dict[Box, list[int]] = {}
    for rank, coord in mesh.coordinates():
        box = local_box(shape, mesh.shape, coord, p)
        if box.numel:
            cells.setdefault(box, []).append(rank)
    out = tuple(sorted(((box, tuple(sorted(ranks))) for box, ranks in cells.items()), key=lambda c: c[0].offsets))
    if sum(box.numel for box, _ in out) != math.prod(shape):
        raise PermanentError(f"placements {p} on mesh {list(mesh.shape)} do not partition a tensor of shape {shape}")
    return out
