"""The trainer's layout, read from what it holds: each published tensor's DTensor mesh and placements.

``trainer_layout(source)`` describes a ``ModuleSource`` without gathering anything:

- a DTensor (FSDP2 ``Shard(0)``, tensor parallel ``Shard(0)``/``Shard(1)``, ``Replicate``,
  and FSDP2 over tensor parallelism, whose ``_StridedShard`` says it cuts after the
  tensor-parallel dimension) keeps its mesh, whose global ranks it lists, and its
  placements;
- a plain tensor is rank 0's: the gathered path has always sent rank 0's copy of a
  tensor no mesh shards, and the sharded path sends the same bytes.

Every rank computes the same layout from the same global metadata, with no collective;
``agreed`` then checks that they did (one all-reduce of the digest) before rank 0
registers it, and ``local_shards`` gives a rank what it sends the plan's regions from.
Before it trusts one, it checks the core's boxes (``weightsync.sharding.shards``)
against DTensor's own for every rank of each mesh and against the local shards it
holds; a placement the core cannot express (``Partial``, a strided form other than
FSDP2's, torch's uneven cut of a strided dimension) makes the whole layout
*unsupported*, naming the tensor, and every replica takes the gathered path. So do
sources that compute what they publish (merged LoRA weights, adapters).
"""

from __future__ import annotations

from typing import Any

from weightsync.errors import PermanentError
from weightsync.sharding import shards
from weightsync.sharding.boxes import Box
from weightsync.tensors import TensorTable
from weightsync_trainer.naming import View
from weightsync_trainer.sources import ModuleSource


def trainer_layout(source: ModuleSource) -> shards.TrainerLayout:
    """This trainer's layout (see the module doc); the same on every rank."""
    table = source.table()
    world = _world_size()
    if type(source) is not ModuleSource:
        why = f"{type(source).__name__} computes the tensors it publishes from several parameters"
        return shards.TrainerLayout(table, world, unsupported=why)
    try:
        return _read(source, table, world)
    except PermanentError as e:
        return shards.TrainerLayout(table, world, unsupported=str(e))


def _read(source: ModuleSource, table: TensorTable, world: int) -> shards.TrainerLayout:
    meshes: dict[shards.Mesh, int] = {}
    placements = []
    for spec in table:
        param, view = _parameter_of(source, spec.name)
        mesh, placement = _placed(spec.name, param) if view is None else _viewed(view, param, spec.name, spec.shape)
        index = meshes.setdefault(mesh, len(meshes))
        placements.append(shards.Placement(index, placement.shard_dims, placement.order))
    return shards.TrainerLayout(table, world, tuple(meshes), tuple(placements))


def _placed(name: str, param: Any) -> tuple[shards.Mesh, shards.Placement]:
    """The mesh and placement of a parameter published as itself (checked against DTensor's own cut)."""
    if getattr(param, "device_mesh", None) is None:
        return shards.Mesh((1,), (0,)), shards.Placement(0, (shards.REPLICATE,))
    root, torch_placements = _on_root(name, param)
    mesh = shards.Mesh(tuple(root.mesh.shape), tuple(int(r) for r in root.mesh.flatten()))
    kinds = [_kind(name, p) for p in torch_placements]
    try:
        placement = shards.placement_of(0, mesh.shape, kinds)
    except PermanentError as e:
        raise PermanentError(f"tensor {name!r}: {e}") from None
    _check(name, param, root, torch_placements, mesh, placement)
    return mesh, placement


def _parameter_of(source: ModuleSource, name: str) -> tuple[Any, View | None]:
    """The trainer's parameter published as ``name`` (view None), or the one ``name`` is cut from and how (an
    expert of a fused expert parameter)."""
    try:
        return source.parameter(name), None
    except KeyError:
        view = source.view(name)
        if view is None:
            raise PermanentError(
                f"tensor {name!r} is no parameter of the trainer and no box of one: the source computes it from others"
            ) from None
        return source.parameter(view.param), view


def _viewed(view: View, param: Any, name: str, shape: tuple[int, ...]) -> tuple[shards.Mesh, shards.Placement]:
    """A tensor cut from one parameter (``view`` of ``param``): held whole by the ranks whose shard of that
    parameter holds its whole box, which must be every rank holding any of it."""
    mesh, placement = _placed(view.param, param)
    box = Box(view.offsets, view.lengths(shape))
    whole: list[int] = []
    part: list[int] = []
    for rank, coord in mesh.coordinates():
        held = shards.local_box(tuple(param.shape), mesh.shape, coord, placement)
        (whole if held.intersect(box) == box else part if held.overlaps(box) else []).append(rank)
    if part or not whole:
        raise PermanentError(
            f"tensor {name!r}, a box of {view.param!r}, is split across the trainer's shards of it (ranks "
            f"{sorted(part)} hold part of it): the sharded path sends tensors each rank holds whole or as its "
            "own placement cuts them"
        )
    return shards.Mesh((len(whole),), tuple(sorted(whole))), shards.Placement(0, (shards.REPLICATE,))


def _on_root(name: str, param: Any) -> tuple[Any, list[Any]]:
    """The tensor's mesh and placements on the root of its device mesh.

    A tensor on a slice of a bigger mesh (FSDP2's ``mesh["dp"]`` beside tensor parallelism) lists only the
    slice's ranks, a different list on each rank; on the root mesh it is replicated along the other
    dimensions, which every rank describes alike.
    """
    from torch.distributed.tensor import Replicate

    mesh = param.device_mesh
    root = mesh._get_root_mesh()
    if root is mesh:
        return mesh, list(param.placements)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or any(n not in root_names for n in names):
        raise PermanentError(
            f"tensor {name!r} lives on a slice {names} of a device mesh with dimensions {root_names}, "
            "which the layout cannot place on the whole mesh"
        )
    placements: list[Any] = [Replicate()] * len(root_names)
    for n, p in zip(names, param.placements, strict=True):
        placements[root_names.index(n)] = p
    return root, placements


def _kind(name: str, placement: Any) -> tuple[str, int, int]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return shards.STRIDED, int(placement.dim), int(placement.split_factor)
    if isinstance(placement, Shard):
        return shards.SHARD, int(placement.dim), 0
    if isinstance(placement, Replicate):
        return "replicate", shards.REPLICATE, 0
    raise PermanentError(f"tensor {name!r} has a {placement} placement, which the sharded path cannot send from")


def _check(
    name: str, param: Any, root: Any, torch_placements: list[Any], mesh: shards.Mesh, placement: shards.Placement
) -> None:
    """The core's boxes must be DTensor's, for every rank of the mesh and for the shard this rank holds."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape = tuple(param.shape)
    for rank, coord in mesh.coordinates():
        local, offset = _compute_local_shape_and_global_offset(shape, mesh.shape, list(coord), torch_placements)
        box = shards.local_box(shape, mesh.shape, coord, placement)
        if box.lengths != tuple(local) or (box.numel and box.offsets != tuple(offset)):
            raise PermanentError(
                f"tensor {name!r} ({', '.join(map(str, torch_placements))} on mesh {list(mesh.shape)}): rank {rank} "
                f"holds {list(local)} at {list(offset)} in DTensor's cut, {box} in the layout's"
            )
    coordinate = root.get_coordinate()
    held = tuple(param.to_local().shape)
    if coordinate is not None:
        box = shards.local_box(shape, mesh.shape, coordinate, placement)
        if box.lengths != held:
            raise PermanentError(
                f"tensor {name!r}: this rank holds a shard of shape {list(held)}, the layout says {box}"
            )


def agreed(layout: shards.TrainerLayout) -> shards.TrainerLayout:
    """``layout`` when every rank computed the same one, else the same table marked unsupported (every replica
    then takes the gathered path), on every rank. Collective: call it on every rank, in the same order.

    The ranks compare 60 bits of the layout digest with one all-reduce (max of the word and of its negation),
    on the default group's device, so nothing is pickled."""
    import torch
    import torch.distributed as dist

    if _world_size() == 1:
        return layout
    word = int(layout.digest().removeprefix("sha256:")[:15], 16)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    both = torch.tensor([word, -word], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = int(both[0]), -int(both[1])
    if high == low == word:
        return layout
    why = (
        f"the trainer's ranks computed different layouts (digest words from {low:015x} to {high:015x}; this rank's "
        f"{word:015x}{': ' + layout.unsupported if layout.unsupported else ''}); the sharded path needs one layout"
    )
    return shards.TrainerLayout(layout.table, layout.world_size, unsupported=why)


def local_shards(source: ModuleSource, layout: shards.TrainerLayout, rank: int) -> list[Any]:
    """This rank's local shard of each published tensor (None where the layout gives it none), in the table's
    dtype (a cast copy only where the trainer keeps another), where the trainer keeps it: what ``regions.send``
    cuts the plan's regions from, with no gather."""
    from weightsync.channels.wire import TORCH_DTYPES

    out: list[Any] = []
    for t, spec in enumerate(layout.table):
        held = None if layout.shard(t, rank) is None else local_tensor(source, spec.name, spec.shape)
        out.append(None if held is None else held.to(TORCH_DTYPES[spec.dtype]))
    return out


def local_tensor(source: ModuleSource, name: str, shape: tuple[int, ...]) -> Any:
    """What this rank holds of published tensor ``name`` (the layout says it holds some), neither gathered nor
    cast: its shard of the parameter, or the tensor's box cut from its shard of the parameter it is cut from."""
    held, view = _parameter_of(source, name)
    param = held.detach()
    if not hasattr(param, "to_local"):  # a plain tensor: rank 0's, whole
        return param if view is None else view.cut(param, (0,) * param.dim(), shape)
    if view is None:
        return param.to_local()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return view.cut(param.to_local(), tuple(int(o) for o in offsets), shape)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


__all__ = ["agreed", "local_shards", "local_tensor", "trainer_layout"]
