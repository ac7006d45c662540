"""Regions over NIXL: a worker reads its regions straight out of each trainer rank's registered shards.

The sharded path's NIXL links, one transport of ``shard_reads`` (its handshake: placements, each version's digest
words, the worker's done). Nothing is pushed: the rank registers the memory of its local shards with its NIXL agent
once (kept while the shard stays in the same memory, ``nixl.Registry``) and publishes its agent metadata with each
placement (``md/<epoch>``, base64, NIXL's own bytes); a place is ``[address, device, "VRAM"|"DRAM"]``. A strided
region (a column slice of a row-major shard: a run per row) the rank packs into a staging buffer of the worker's
link before it computes the link's words (``stage``: registered once, reused while it fits; a new one is announced
with fresh agent metadata, ``md/<epoch>.<n>``, in the words message). The worker loads a rank's metadata once a
placement (and again when the words message names newer) and, for each bucket of the rank's link, posts one READ
of the bucket's regions: a descriptor per region, from the staging buffer or straight from the shard, merged where
they continue each other in one memory, landing back to back in the bucket, which the worker registers for the
version. NIXL picks the transport (UCX: RDMA
between hosts, NVLink or shared memory on one, TCP where nothing else is). ``settle`` waits for the link's READs
(bounded: a READ past the transfer timeout, or one NIXL fails because the rank went away, fails the worker naming
the rank), and the walk checks every region against the rank's digest word as for any link.

    exporter = Exporter(store, rank, timeout_s)                   # a trainer rank, once per membership
    exporter.publish(version, layout, local)                      # each version, once the shards are written
    regions.send(None, layout, rank, local, mine, links={w: exporter.link(w) for w in workers})
    exporter.release()                                            # before the shards change again

    importer = Importer(store, worker, device, timeout_s)         # a worker, once per membership
    for fill, data in regions.receive(None, ranks, worker, table, regions, tally, device,
                                      links={r: importer.link(version, r, table) for r in ranks}): ...
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weightsync.channels import gpu, nixl, regions, shard_reads
from weightsync.channels.wire import TORCH_DTYPES, wait_key
from weightsync.errors import PermanentError, RetryableError, TransferTimeoutError
from weightsync.sharding.boxes import Box
from weightsync.sharding.plans import Region
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

log = logging.getLogger(__name__)


class _Registered:
    """``shard_reads.Memory`` over NIXL: the rank's shards registered with its agent, a place their address; the
    strided regions of each worker's link packed into a staging buffer of that link (registered once, reused while
    it fits), so that each is one descriptor."""

    channel = Channel.NIXL

    def __init__(self, store: Any, name: str) -> None:
        self._store = store
        self.agent = nixl.new_agent(name)
        self._registries: dict[torch.device, nixl.Registry] = {}
        self._held: list[torch.Tensor] = []
        self._staging: dict[int, torch.Tensor] = {}  # worker -> its link's staging buffer
        self._md = ""  # the key of the newest agent metadata published (it describes every registration)
        self._epoch = 0  # the placement's
        self._republished = 0  # metadata published since, for new staging buffers

    def refuses(self, tensor: torch.Tensor) -> str:
        return ""

    def where(self, tensor: torch.Tensor) -> list[Any]:
        return [tensor.data_ptr(), nixl.device_id(tensor.device), nixl.mem_type(tensor.device)]

    def keep(self, tensors: Sequence[torch.Tensor]) -> bool:
        self._held = list(tensors)
        return self._register()

    def _register(self) -> bool:
        """Register exactly the held shards and the staging buffers; True when that changed anything."""
        kept = [*self._held, *self._staging.values()]
        live = {nixl.Registry.key(t) for t in kept}
        changed = any([r.keep_only(live) for r in self._registries.values()])
        for t in kept:
            registry = self._registries.get(t.device)
            if registry is None:
                registry = self._registries[t.device] = nixl.Registry(self.agent, t.device)
            changed |= registry.ensure(t)
        return changed

    def placed(self, epoch: int) -> None:
        self._epoch = epoch
        self._publish(f"md/{epoch}")

    def _publish(self, key: str) -> None:
        self._store.set(key, nixl.encode_metadata(self.agent.get_agent_metadata()))
        self._md = key

    def stage(self, worker: int, cuts: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Pack the strided regions (a column slice of a row-major shard: a run per row) into ``worker``'s staging
        buffer, at 16-byte boundaries in plan order (so that regions adjacent in a bucket are adjacent here)."""
        at: list[int] = []
        total = 0
        for c in cuts:
            at.append(-1 if c.is_contiguous() else total)
            total += 0 if c.is_contiguous() else regions.aligned(c.numel() * c.element_size())
        if not total:
            return {"md": self._md}
        device = next(c.device for c in cuts if not c.is_contiguous())
        buf = self._staging.get(worker)
        if buf is None or buf.numel() < total or buf.device != device:
            self._staging[worker] = buf = torch.empty(total, dtype=torch.uint8, device=device)
            self._register()
            self._republished += 1
            self._publish(f"md/{self._epoch}.{self._republished}")  # the readers load it before reading
        srcs = [c for c, a in zip(cuts, at, strict=True) if a >= 0]
        dsts = [
            buf[a : a + c.numel() * c.element_size()].view(c.dtype).view(c.shape)
            for c, a in zip(srcs, (a for a in at if a >= 0), strict=True)
        ]
        torch._foreach_copy_(dsts, srcs)
        return {"md": self._md, "staged": self.where(buf), "at": at}

    def close(self) -> None:
        self._held, self._staging = [], {}
        for registry in self._registries.values():
            registry.clear()


class Exporter(shard_reads.Exporter):
    """A trainer rank's side of its NIXL region links (``shard_reads.Exporter`` over NIXL)."""

    def _memory(self, store: Any) -> _Registered:
        return _Registered(store, f"weightsync-r{self.rank}-{uuid.uuid4().hex[:12]}")


@dataclass(frozen=True)
class _Remote:
    """A rank's shard as a worker reads it: where its first element lies, and its shape in elements."""

    address: int
    device: int
    mem: str
    itemsize: int
    strides: tuple[int, ...]

    def runs(self, box: Box, region: Box) -> tuple[np.ndarray, int]:
        """``region`` of the shard (which holds ``box``) as contiguous runs: their addresses, and each run's bytes
        (every run of one region has the same length; row-major order, as the bucket holds it)."""
        lengths, strides = region.lengths, self.strides
        start = self.address + self.itemsize * sum(
            (o - b) * s for o, b, s in zip(region.offsets, box.offsets, strides, strict=True)
        )
        n = len(lengths)
        outer, run = n, 1
        if n and strides[-1] == 1:  # the innermost dimensions that lie back to back make one run
            outer, run = n - 1, lengths[-1]
            while outer and strides[outer - 1] == run:
                outer -= 1
                run *= lengths[outer]
        at = np.zeros(1, dtype=np.int64)
        for d in range(outer):
            at = (at[:, None] + np.arange(lengths[d], dtype=np.int64) * (strides[d] * self.itemsize)).reshape(-1)
        return start + at, run * self.itemsize


def _place(rank: int, spec_name: str, itemsize: int, p: Any) -> tuple[_Remote, Box]:
    """One entry of a rank's places, checked: its shard as the worker reads it, and the shard's box."""
    try:
        address, device, mem, offsets, lengths, strides = p
        ok = all(isinstance(x, int) and x >= 0 for x in (address, device, *offsets, *lengths, *strides))
        if not ok or mem not in ("VRAM", "DRAM") or not len(offsets) == len(lengths) == len(strides):
            raise ValueError(p)
    except (TypeError, ValueError):
        raise PermanentError(
            f"nixl regions: trainer rank {rank}'s place of {spec_name!r} is {str(p)[:120]}; expected [address, "
            "device, VRAM|DRAM, box offsets, lengths, strides]"
        ) from None
    return _Remote(address, device, mem, itemsize, tuple(strides)), Box(tuple(offsets), tuple(lengths))


def _staging(rank: int, message: Mapping[str, Any], upto: int) -> tuple[_Remote | None, list[int]]:
    """The rank's staging buffer for this link (as a one-dimensional shard) and each region's offset in it (-1: read
    from the shard), checked to cover the link's first ``upto`` regions."""
    if "staged" not in message:
        return None, []
    staged, at = message["staged"], message.get("at")
    try:
        address, device, mem = staged
        ok = isinstance(at, list) and len(at) >= upto and all(isinstance(a, int) and a >= -1 for a in at)
        if not ok or not isinstance(address, int) or not isinstance(device, int) or mem not in ("VRAM", "DRAM"):
            raise ValueError(staged)
    except (TypeError, ValueError):
        raise PermanentError(
            f"nixl regions: trainer rank {rank}'s staging for this link is {str(staged)[:80]} at {str(at)[:80]}; "
            f"expected [address, device, VRAM|DRAM] and an offset (or -1) for each of at least {upto} regions"
        ) from None
    return _Remote(address, device, mem, 1, (1,)), [int(a) for a in at or ()]


def _coalesced(local: np.ndarray, remote: np.ndarray, sources: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor rows ``(address, bytes, device)`` paired local-remote, each pair merged into the previous one where
    both continue it from the same remote memory (``sources``: -1 the staging buffer, else the table tensor whose
    shard it is): regions packed back to back on both ends become one descriptor. Two shards may lie back to back in
    the rank's memory, but each is registered apart, and NIXL refuses a descriptor across two registrations."""
    if len(local) < 2:
        return local, remote
    joins = (
        (local[:-1, 0] + local[:-1, 1] == local[1:, 0])
        & (remote[:-1, 0] + remote[:-1, 1] == remote[1:, 0])
        & (sources[:-1] == sources[1:])
    )
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    lengths = np.add.reduceat(local[:, 1], starts)
    merged = [rows[starts].copy() for rows in (local, remote)]
    for rows in merged:
        rows[:, 1] = lengths
    return merged[0], merged[1]


class _Reads:
    """``shard_reads.Reader`` over NIXL: each rank's agent metadata loaded once a placement, one READ per bucket."""

    channel = Channel.NIXL
    direct = False  # READs land in registered memory: the walk's buckets, registered each version

    def __init__(self, worker: int, device: torch.device | str, timeout_s: float) -> None:
        self.worker, self.timeout_s = worker, timeout_s
        dev = torch.device(device)
        self.device = dev if dev.type == "cpu" else gpu.cuda_device(dev)
        self.agent = nixl.new_agent(f"weightsync-w{worker}-{uuid.uuid4().hex[:12]}")
        self._agents: dict[int, str] = {}  # rank -> its agent's name, as loaded
        self._loaded: dict[int, tuple[Any, str]] = {}  # rank -> (its store, the key of its metadata loaded)
        self._buckets: dict[int, nixl.Registry] = {}  # rank -> the buckets of its link registered this version
        self._posted: dict[int, list[Any]] = {}  # rank -> READs in flight

    def _load(self, rank: int, store: Any, key: str) -> None:
        """Load trainer ``rank``'s agent metadata published under ``key`` (it describes all its registrations)."""
        what = f"trainer rank {rank}'s agent metadata ({key})"
        md = nixl.decode_metadata(wait_key(store, key, self.timeout_s, what, Channel.NIXL).decode(), what)
        try:
            name = self.agent.add_remote_agent(md)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types; name what failed
            raise RetryableError(
                f"nixl regions: worker {self.worker}: NIXL could not load {what} ({type(e).__name__}: {e}): the rank "
                "went away, or this is not its agent's metadata; the version fails"
            ) from None
        self._agents[rank] = name.decode() if isinstance(name, bytes) else str(name)
        self._loaded[rank] = (store, key)

    def open(
        self, rank: int, store: Any, epoch: int, places: Sequence[Any], table: TensorTable
    ) -> dict[int, tuple[_Remote, Box]]:
        self._load(rank, store, f"md/{epoch}")
        shards: dict[int, tuple[_Remote, Box]] = {}
        for t, p in enumerate(places):
            if p is None:
                continue
            spec = table.tensors[t]
            shards[t] = _place(rank, spec.name, TORCH_DTYPES[spec.dtype].itemsize, p)
        return shards

    def read(
        self,
        rank: int,
        first: int,
        pieces: Sequence[tuple[Any, Box, Region, torch.Tensor]],
        shared: Callable[[], Mapping[str, Any]],
    ) -> None:  # the walk digests the buckets once the READs landed
        message = shared()  # the rank packed the strided regions before it published this
        staged, at = _staging(rank, message, first + len(pieces))
        store, loaded = self._loaded[rank]
        if message.get("md", loaded) != loaded:  # the rank registered a staging buffer since: load what says so
            self._load(rank, store, str(message["md"]))
        remote_rows, local_rows, sources = [], [], []
        mem = staged.mem if staged is not None else pieces[0][0].mem
        registry = self._buckets.get(rank)
        if registry is None:
            registry = self._buckets[rank] = nixl.Registry(self.agent, self.device)
        for k, (shard, box, r, into) in enumerate(pieces, first):
            registry.ensure(into)
            if staged is not None and at[k] >= 0:
                addresses, run, device = np.array([staged.address + at[k]], dtype=np.int64), r.nbytes, staged.device
                source = -1
            else:
                (addresses, run), device, source = shard.runs(box, r.source), shard.device, r.tensor
            if run * len(addresses) != r.nbytes or into.numel() != r.nbytes or shard.mem != mem:
                raise PermanentError(
                    f"nixl regions: region {r.source} from trainer rank {rank} is {len(addresses)} runs of {run} "
                    f"bytes in {shard.mem}; it holds {r.nbytes} (the rank's place and the plan disagree)"
                )
            lengths = np.full(len(addresses), run, dtype=np.int64)
            remote_rows.append(np.stack([addresses, lengths, np.full_like(lengths, device)], axis=1))
            local = into.data_ptr() + np.arange(len(addresses), dtype=np.int64) * run
            local_rows.append(np.stack([local, lengths, np.full_like(lengths, nixl.device_id(self.device))], axis=1))
            sources.append(np.full_like(lengths, source))
        local_descs, remote_descs = _coalesced(
            np.concatenate(local_rows), np.concatenate(remote_rows), np.concatenate(sources)
        )
        try:
            handle = self.agent.initialize_xfer(
                "READ",
                self.agent.get_xfer_descs(local_descs, nixl.mem_type(self.device)),
                self.agent.get_xfer_descs(remote_descs, mem),
                self._agents[rank],
            )
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
            raise PermanentError(
                f"nixl regions: NIXL refused worker {self.worker}'s READ from trainer rank {rank} "
                f"({type(e).__name__}: {e}): the rank's places are not inside its registered memory"
            ) from None
        self._posted.setdefault(rank, []).append(handle)
        landing_ready(self.device)
        if self._state(rank, lambda: self.agent.transfer(handle)) == "ERR":
            raise RetryableError(
                f"nixl regions: worker {self.worker} could not post its READ from trainer rank {rank} (the rank went "
                "away?); the version fails"
            )

    def _state(self, rank: int, call: Callable[[], str]) -> str:
        """A NIXL call's state; what NIXL raises (a peer that disconnected, say) as a failure naming the rank."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
            raise RetryableError(
                f"nixl regions: worker {self.worker}'s READ from trainer rank {rank} failed in NIXL "
                f"({type(e).__name__}: {e}): the rank went away, or freed its memory; the version fails"
            ) from None

    def wait(self, rank: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        posted = self._posted.get(rank, [])
        while posted:
            state = self._state(rank, lambda: nixl.poll(self.agent, posted[0], deadline))
            if state == "ERR":
                raise RetryableError(
                    f"nixl regions: worker {self.worker}'s READ from trainer rank {rank} failed in NIXL (the rank "
                    "went away, or freed its memory); the version fails"
                )
            if state != "DONE":
                raise TransferTimeoutError(
                    f"nixl regions: worker {self.worker}'s READ from trainer rank {rank} did not complete within "
                    f"{timeout_s:.1f}s (the rank died or stalled); the version fails"
                )
            self.agent.release_xfer_handle(posted.pop(0))

    def finish(self, rank: int) -> str:
        said = "ok"
        try:
            self.wait(rank, self.timeout_s)
        except (RetryableError, TransferTimeoutError) as e:
            said = str(e)
        for handle in self._posted.pop(rank, []):
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types; the version failed already
                said = f"{said}; releasing a READ failed: {type(e).__name__}: {e}"
        registry = self._buckets.pop(rank, None)
        if registry is not None:
            registry.clear()  # the buckets are the walk's: they go with it
        return said

    def close(self) -> None:
        for rank in list(self._posted):
            self.finish(rank)
        for name in self._agents.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001 - the rank may be gone; nothing is read from it any more
                log.debug("nixl regions: worker %d unloading agent %s: %s", self.worker, name, e)
        self._agents = {}


def landing_ready(device: torch.device) -> None:
    """Return once the kernels queued on ``device``'s current stream ran. NIXL's READs land outside the stream's
    order, and the caching allocator hands a block back to its stream's pool at its free, while kernels queued on
    that stream may still write it: a bucket just allocated can be a block a queued kernel (a freed temporary's
    zeroing, say) still writes, which would overwrite bytes that landed (seen: a region that arrived as zeros, about
    once in ten runs of the GPU test). One wait per READ posted, which the walk's rounds overlap."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Importer(shard_reads.Importer):
    """A worker's side of its NIXL region links (``shard_reads.Importer`` over NIXL)."""

    def _reader(self, device: torch.device | str) -> _Reads:
        return _Reads(self.worker, device, self.timeout_s)


__all__ = ["Exporter", "Importer"]
