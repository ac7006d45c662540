"""What a sharded trainer rank writes to the checkpoint volume: its own shards, never a gathered tensor.

``local_shards`` copies this rank's box of each tensor it writes (``sharded_volume.writes``:
the lowest rank holding a box writes it) out of its DTensors' local shards, cast to the
table's wire dtype: a snapshot, so training may go on while the copy is written.
``write_version`` hands them to the collective writer (``ShardedVolumeWriter``), which
every rank calls together with the same layout.
"""

from __future__ import annotations

import torch

from weightsync.channels import sharded_volume
from weightsync.channels.manifests import Manifest
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.sharding.shards import TrainerLayout
from weightsync_trainer.sources import ModuleSource


def local_shards(source: ModuleSource, layout: TrainerLayout, rank: int) -> dict[int, torch.Tensor]:
    """This rank's box of every tensor it writes, by table index, on the CPU in the table's dtype."""
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for t, _box in sharded_volume.writes(layout, rank):
            spec = layout.table.tensors[t]
            param = source.parameter(spec.name).detach()
            local = param.to_local() if hasattr(param, "to_local") else param  # a plain tensor: rank 0's, whole
            out[t] = local.to(device="cpu", dtype=TORCH_DTYPES[spec.dtype], copy=True)
    return out


def write_version(
    writer: sharded_volume.ShardedVolumeWriter, source: ModuleSource, layout: TrainerLayout, version: int, step: int
) -> Manifest | None:
    """Write ``version`` from every rank's own shards (collective: every rank calls it; rank 0's version counts)."""
    return writer.write(version, step, layout, local_shards(source, layout, writer.rank))


__all__ = ["local_shards", "write_version"]
