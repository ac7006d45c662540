"""The durable copy of a sharded trainer: every rank writes its own shards, never a gathered tensor.

When the trainer's layout is readable (``layouts.trainer_layout``: FSDP2, tensor parallel,
on more than one rank) and a checkpoint volume is configured, the publisher's volume copy
is the sharded volume (``weightsync.channels.sharded_volume``, format v2) instead of rank
0's gathered copy (v1): every rank snapshots its own shards (``local_shards``: its box of
each tensor it writes, cast to the wire dtype, copied so training may go on) and the ranks
write them together. A plain trainer (one rank, or a layout the core cannot describe)
keeps the gathered v1 copy.

The write is a collective over the ranks (``ShardedVolumeWriter``), while only rank 0
talks to the coordinator and decides whether and when a version is written (now, when a
replica waits for it; in the background otherwise; not at all when the version was not
opened). So each publish is one *round* (``ShardedCopies.round``) in which every rank
submits exactly one job to a thread of its own that runs the jobs in order: rank 0 the
version (or 0: nothing this round), the others their snapshot, whose version rank 0's
broadcast names. The collectives thus match across ranks whatever rank 0 decided, and
never run on the training thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch

from weightsync.channels import manifests, sharded_volume
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.coordinator.client import CoordinatorClient
from weightsync.errors import WeightsyncError
from weightsync.sharding.shards import TrainerLayout
from weightsync.tensors import manifest_checksum
from weightsync_trainer import layouts
from weightsync_trainer.durable import Snapshot, VolumeCopies
from weightsync_trainer.sources import ModuleSource, WeightSource

log = logging.getLogger(__name__)

Job = tuple[int, int, dict[int, torch.Tensor], "Future[str]"]


def local_shards(source: ModuleSource, layout: TrainerLayout, rank: int) -> dict[int, torch.Tensor]:
    """This rank's box of every tensor it writes, by table index, on the CPU in the table's dtype."""
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for t, _box in sharded_volume.writes(layout, rank):
            spec = layout.table.tensors[t]
            local = layouts.local_tensor(source, spec.name, spec.shape)
            out[t] = local.to(device="cpu", dtype=TORCH_DTYPES[spec.dtype], copy=True)
    return out


def sharded_copies(
    source: WeightSource,
    checkpoint_dir: str | os.PathLike[str] | None,
    client: CoordinatorClient | None,
    verify: bool,
    timeout_s: float,
) -> ShardedCopies | None:
    """The sharded copy when this trainer can write one (the same answer on every rank: call it on all of them,
    it creates the writer's group when the answer is yes), else None (the gathered v1 copy)."""
    import torch.distributed as dist

    if not checkpoint_dir or type(source) is not ModuleSource:
        return None
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    layout = layouts.trainer_layout(source)
    if layout.unsupported:
        log.info("the volume copy is gathered (v1): %s", layout.unsupported)
        return None
    writer = sharded_volume.ShardedVolumeWriter(checkpoint_dir, timeout_s=timeout_s)
    return ShardedCopies(writer, source, layout, client, verify)


class ShardedCopies(VolumeCopies):
    """Rank 0's ``VolumeCopies`` contract (``write``, ``write_later``, ``wait``) over the collective writer, and
    every rank's part of it (``round``); see the module doc."""

    def __init__(
        self,
        writer: sharded_volume.ShardedVolumeWriter,
        source: ModuleSource,
        layout: TrainerLayout,
        client: CoordinatorClient | None,
        verify: bool,
    ) -> None:
        super().__init__(None, client, layout.table, verify, source.groups)  # type: ignore[arg-type]
        self.writer, self.source, self.layout = writer, source, layout
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._pending: list[Future[str]] = []
        self._submitted = False
        self._thread = threading.Thread(target=self._run, name="weightsync-sharded-volume", daemon=True)
        self._thread.start()

    @contextmanager
    def round(self) -> Iterator[None]:
        """One publish: rank 0 submits its version (``write``/``write_later``) or, if it did not, nothing (0);
        every other rank submits its snapshot when the publish ends."""
        self._submitted = False
        try:
            yield
        finally:
            if not self._submitted:
                self._submit(0, 0, snapshot=self.writer.rank != 0)

    def write(self, version: int, step: int, snapshot: Snapshot) -> str:
        """Write ``version`` now (every rank's shards) and mark it durable; why not, if not."""
        if self._submitted:
            return ""  # this round's copy was submitted already (a retry after the coordinator went away)
        return self._submit(version, step).result()

    def write_later(self, version: int, step: int, snapshot: Snapshot) -> None:
        if not self._submitted:
            self._submit(version, step)

    def wait(self, timeout_s: float | None = None) -> None:
        for fut in list(self._pending):
            fut.exception(timeout_s)

    def _submit(self, version: int, step: int, snapshot: bool = True) -> Future[str]:
        self._submitted = True
        shards = local_shards(self.source, self.layout, self.writer.rank) if snapshot else {}
        fut: Future[str] = Future()
        self._pending = [f for f in self._pending if not f.done()] + [fut]
        self._jobs.put((version, step, shards, fut))
        return fut

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            version, step, shards, fut = job
            fut.set_result(self._write(version, step, shards))

    def _write(self, version: int, step: int, shards: dict[int, torch.Tensor]) -> str:
        try:
            manifest = self.writer.write(version, step, self.layout, shards)
            if manifest is None or self.writer.rank != 0:
                return ""
            assert self.client is not None
            path = manifests.manifest_path(Path(self.writer.root), manifest.version)
            # no content digest: a sharded copy lists tile digests, not the per-tensor ones a digest combines
            self.client.mark_durable(manifest.version, str(path), manifest_checksum(path.read_bytes()), "")
        except (WeightsyncError, OSError) as e:
            log.error("v%d: the sharded volume copy failed at rank %d: %s", version, self.writer.rank, e)
            self.errors.append(f"version {version}: {e}")
            return str(e)
        return ""

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(self.writer.timeout_s)


__all__ = ["ShardedCopies", "local_shards", "sharded_copies"]
