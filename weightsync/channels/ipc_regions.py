"""Regions over CUDA IPC: a worker that reads a trainer rank's GPU copies its regions straight out of the rank's shards.

The sharded path's copied links (``sharding.links.copied``: a trainer rank and a worker on one GPU, where NCCL
refuses two ranks of one communicator, or on GPUs the worker's process reads peer-to-peer), one transport of
``shard_reads`` (its handshake: placements, each version's digest words, the worker's done). The rank exports the
storages of its local shards once (``ipc.Exports``, as the whole-tensor IPC channel does: kept alive, reused while
the shard stays in the same memory); a place is ``[export id, byte offset]``. The worker maps the rank's exports
once into its own GPU (``ipc.Mappings``; a rank on another GPU is then read peer-to-peer through the same
addresses) and copies each round's regions from the mapped shard into their places in its parameters
(``regions.Places``) or the walk's bucket: from a rank on its GPU in one launch on its stream that digests each
region as it writes it (``digests.copy_words``: each byte read once and written once), from a rank on another GPU
by the copy engines (``peer_copies``: not time-sliced against the other processes' kernels on either GPU, where
an NCCL link between two GPUs that each hold a rank and a worker waits for both processes' slices), digested once
landed; no wait, the walk queues its work after them on the same stream; done once its stream finished them.

    exporter = Exporter(store, rank, timeout_s)                   # a trainer rank, once
    exporter.publish(version, layout, local)                      # each version, once the shards are written
    regions.send(pg, layout, rank, local, mine, links={w: exporter.link(w) if near else Wire(pg, ...)})
    exporter.release()                                            # before the shards change again

    importer = Importer(store, worker, device, timeout_s)         # a worker, once
    for fill, data in regions.receive(pg, ranks, worker, table, regions, tally, device,
                                      links={r: importer.link(version, r, table) if near else Wire(pg, r)}): ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weightsync.channels import digests, gpu, ipc, peer_copies, shard_reads
from weightsync.channels.regions import view_of
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import PermanentError
from weightsync.sharding.boxes import Box
from weightsync.sharding.plans import Region
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel


class _Exported:
    """``shard_reads.Memory`` over CUDA IPC: each storage exported once, a place is [export id, byte offset]."""

    channel = Channel.IPC

    def __init__(self, store: Any) -> None:
        self.exports = ipc.Exports(store)

    def refuses(self, tensor: torch.Tensor) -> str:
        return "" if tensor.device.type == "cuda" else "a co-located link reads GPU memory"

    def where(self, tensor: torch.Tensor) -> list[Any]:
        return [self.exports.id_of(tensor), tensor.storage_offset() * tensor.element_size()]

    def keep(self, tensors: Sequence[torch.Tensor]) -> bool:
        self.exports.keep(tensors)
        return False  # a new export is a new id: the places differ

    def placed(self, epoch: int) -> None: ...

    def stage(self, worker: int, cuts: Sequence[torch.Tensor]) -> dict[str, Any]:
        return {}  # the worker copies strided regions itself, one kernel each

    def close(self) -> None:
        self.exports.keep(())


class Exporter(shard_reads.Exporter):
    """A trainer rank's side of its co-located links (``shard_reads.Exporter`` over CUDA IPC)."""

    memory: _Exported

    def _memory(self, store: Any) -> _Exported:
        return _Exported(store)

    @property
    def exported(self) -> int:
        """Exports made so far: one per storage, none for a shard still in the same memory."""
        return self.memory.exports.exported


class _Mapped:
    """``shard_reads.Reader`` over CUDA IPC: each rank's exports mapped once, regions copied on the stream (into
    the walk's buckets, or straight into their places in the worker's parameters)."""

    channel = Channel.IPC
    direct = True

    def __init__(self, worker: int, device: torch.device | str, timeout_s: float) -> None:
        self.worker, self.timeout_s = worker, timeout_s
        self.device = gpu.cuda_device(device)
        self._gpu = gpu.uuid(self.device)
        self._mappings: dict[int, ipc.Mappings] = {}
        self._far: set[int] = set()  # the ranks whose shards live on another GPU
        self._cuts: dict[int, dict[tuple[int, Box], torch.Tensor]] = {}
        """Per rank, each region's view of its mapped shard (tensor, box): the same while the placement holds."""

    def open(
        self, rank: int, store: Any, epoch: int, places: Sequence[Any], table: TensorTable
    ) -> dict[int, tuple[torch.Tensor, Box]]:
        mappings = self._mappings.setdefault(rank, ipc.Mappings(store))
        used = {p[0] for p in places if p is not None}
        # mapped into this worker's GPU: a rank on another GPU is read peer-to-peer through the same addresses
        mapped = mappings.map(used, self.timeout_s, f"trainer rank {rank}'s ", on=self.device.index)
        self._cuts.pop(rank, None)  # views of the placement before
        if any(mappings.gpu(b) != self._gpu for b in used):
            self._far.add(rank)
        else:
            self._far.discard(rank)
        shards: dict[int, tuple[torch.Tensor, Box]] = {}
        for t, p in enumerate(places):
            if p is None:
                continue
            buf, offset, offsets, lengths, strides = p
            dtype = TORCH_DTYPES[table.tensors[t].dtype]
            size = dtype.itemsize
            flat = mapped[buf][: mapped[buf].numel() // size * size].view(dtype)
            if offset % size:
                raise PermanentError(
                    f"ipc regions: trainer rank {rank}'s shard of {table.tensors[t].name!r} lies at byte {offset} of "
                    f"its buffer; worker {self.worker} reads whole elements only"
                )
            view = flat.as_strided(tuple(lengths), tuple(strides), offset // size)
            shards[t] = (view, Box(tuple(offsets), tuple(lengths)))
        return shards

    def read(
        self,
        rank: int,
        first: int,
        pieces: Sequence[tuple[Any, Box, Region, torch.Tensor]],
        shared: Callable[[], Mapping[str, Any]],
    ) -> torch.Tensor:
        cuts = self._cuts.setdefault(rank, {})
        srcs = []
        for shard, box, r, _ in pieces:
            src = cuts.get((r.tensor, r.source))
            if src is None:
                src = cuts[r.tensor, r.source] = view_of(shard, box, r.source)
            srcs.append(src)
        # a place is of the region's dtype and shape already; a bucket's view is flat bytes
        dsts = [
            into if into.dtype == src.dtype and into.shape == src.shape else into.view(src.dtype).view(src.shape)
            for src, (_, _, _, into) in zip(srcs, pieces, strict=True)
        ]
        if rank not in self._far:
            # each byte read once and written once, digested as it is written (one launch where the runs allow it)
            return digests.copy_words(dsts, srcs)
        # another GPU's shard by the copy engines (no kernel waits for the time slices of the processes on either
        # GPU), then digested here as it landed, queued after the copies
        peer_copies.copy(dsts, srcs)
        return digests.words(dsts)

    def wait(self, rank: int, timeout_s: float) -> None: ...  # the copies are ordered before the walk's kernels

    def finish(self, rank: int) -> str:
        torch.cuda.current_stream(self.device).synchronize()
        return "ok"

    def close(self) -> None:
        for m in self._mappings.values():
            m.clear()
        self._mappings, self._cuts = {}, {}


class Importer(shard_reads.Importer):
    """A worker's side of its co-located links (``shard_reads.Importer`` over CUDA IPC)."""

    def _reader(self, device: torch.device | str) -> _Mapped:
        return _Mapped(self.worker, device, self.timeout_s)


__all__ = ["Exporter", "Importer"]
