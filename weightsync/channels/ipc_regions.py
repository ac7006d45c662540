"""Regions over CUDA IPC: a worker on a trainer rank's GPU copies its regions straight out of the rank's shards.

The sharded path's co-located links (``sharding.links.colocated``: a trainer rank and a worker on one GPU, where
NCCL refuses two ranks of one communicator). The rank exports the storages of its local shards once
(``ipc.Exports``, as the whole-tensor IPC channel does: kept alive, reused while the shard stays in the same
memory) and publishes where each shard lies in them (export id, byte offset, the shard's box, its strides) when
that changes; each version (``publish``) it says which placement holds, once its shards are written, and then,
per co-located worker, the digest word of each of that link's regions, computed on the device from the shard
(``regions.send`` hands it the regions' views: ``Exporter.link``). The worker maps the rank's exports once
(``ipc.Mappings``) and, inside ``regions.receive``'s walk, copies each bucket's regions from the mapped shard into
the bucket as soon as the version's placement is out (``Importer.link``), so its copies overlap the rank's digests;
before the walk checks a round it writes the rank's words after the regions (``settle``): the bucket is then what
the wire would have delivered, and the walk checks every region's digest against the rank's word before it yields
it, failing naming tensor, box, rank and worker, as for any link. Bytes are counted by the walk: a worker copies
exactly its regions' bytes.

The rank must not change its shards while a worker reads them: ``Exporter.release`` waits (bounded) until every
co-located worker of the version said it is done (``done`` keys, set after the worker's copies finished on the
device, also when its walk failed). A worker waits for a rank's placement and words at most the join deadline plus
the transfer timeout each: a rank that died before it shared them fails the worker with ``TransferTimeoutError``
naming it.

Everything on the store is JSON (ids, integers, hex handles), nothing pickled, under a prefix per rank
(``r<rank>/``): ``buf/<id>`` (an export), ``places/<epoch>`` (per table tensor: null, or [export id, byte offset,
the shard's box offsets, its lengths, its strides]), ``v<version>/places`` (the epoch of the version's placement),
``v<version>/w<worker>`` (``{"places": epoch, "words": [...]}``), ``v<version>/done/w<worker>``.

    exporter = Exporter(store, rank, timeout_s)                   # a trainer rank, once
    exporter.publish(version, layout, local)                      # each version, once the shards are written
    regions.send(pg, layout, rank, local, mine, links={w: exporter.link(w) if near else Wire(pg, ...)})
    exporter.release()                                            # before the shards change again

    importer = Importer(store, worker, device, timeout_s)         # a worker, once
    for fill, data in regions.receive(pg, ranks, worker, table, regions, tally, device,
                                      links={r: importer.link(version, r, table) if near else Wire(pg, r)}): ...
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from weightsync.channels import digests, gpu, ipc
from weightsync.channels.regions import view_of
from weightsync.channels.wire import TORCH_DTYPES, dist, wait_key
from weightsync.errors import IntegrityError, PermanentError, RetryableError
from weightsync.sharding.boxes import Box
from weightsync.sharding.plans import Region
from weightsync.sharding.shards import TrainerLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

log = logging.getLogger(__name__)


def _prefixed(store: Any, rank: int) -> Any:
    return dist.PrefixStore(f"r{rank}/", store)


class Exporter:
    """A trainer rank's side of its co-located links: exports, places, each version's words, the wait for done."""

    def __init__(self, store: Any, rank: int, timeout_s: float = 120.0) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self._store = _prefixed(store, rank)
        self._exports = ipc.Exports(self._store)
        self._places = ""
        self._epoch = 0
        self._version: int | None = None
        self._workers: set[int] = set()
        self._layout: tuple[TrainerLayout, list[Any]] | None = None  # what was last published, to skip it when same

    @property
    def exported(self) -> int:
        """Exports made so far: one per storage, none for a shard still in the same memory."""
        return self._exports.exported

    def publish(self, version: int, layout: TrainerLayout, local: Sequence[torch.Tensor | None]) -> None:
        """Share ``version`` of the rank's local shards (``local[i]``: its shard of table tensor ``i``, or None):
        export new storages, publish the places when they changed. Call once the shards are written, before
        ``regions.send``; ``release`` the previous version first."""
        if self._workers:
            raise PermanentError(
                f"trainer rank {self.rank}: v{version} published before v{self._version} was released: a worker may "
                "still read the shards (call Exporter.release first)"
            )
        same = (layout, [None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in local])
        if self._layout is None or same[0] is not self._layout[0] or same[1] != self._layout[1]:
            self._place(layout, local)  # else the steady state: the same shards in the same memory
        self._version, self._layout = version, same
        for device in {t.device for t in local if t is not None and t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the workers read only finished shards
        # the workers start copying now; the words follow (``link``'s share) while they copy
        self._store.set(f"v{version}/places", str(self._epoch))

    def _place(self, layout: TrainerLayout, local: Sequence[torch.Tensor | None]) -> None:
        places: list[list[Any] | None] = []
        held: list[torch.Tensor] = []
        for t, spec in enumerate(layout.table):
            tensor = local[t] if t < len(local) else None
            box = layout.shard(t, self.rank)
            if tensor is None or box is None or not tensor.numel():
                places.append(None)
                continue
            if tensor.device.type != "cuda" or tuple(tensor.shape) != box.lengths or spec.dtype not in TORCH_DTYPES:
                raise PermanentError(
                    f"trainer rank {self.rank}: its shard of {spec.name!r} is {list(tensor.shape)} on {tensor.device}; "
                    f"a co-located link reads box {box} from GPU memory (the layout and the shards disagree)"
                )
            t_ = tensor.detach()
            held.append(t_)
            offset = t_.storage_offset() * t_.element_size()
            places.append([self._exports.id_of(t_), offset, list(box.offsets), list(t_.shape), list(t_.stride())])
        self._exports.keep(held)
        text = json.dumps(places, separators=(",", ":"))
        if text != self._places:
            self._epoch += 1
            self._store.set(f"places/{self._epoch}", text)
            # a worker reads the epoch its version names before it says done, and ``release`` waits for that
            self._store.delete_key(f"places/{self._epoch - 1}")
            self._places = text

    def link(self, worker: int) -> _Shared:
        """The sending end of the link to ``worker`` for the version last published (``regions.send``'s links)."""
        return _Shared(self, worker)

    def _share(self, worker: int, cuts: Sequence[torch.Tensor]) -> list[int]:
        if self._version is None:
            raise PermanentError(f"trainer rank {self.rank}: a co-located link shared before Exporter.publish")
        # kernels where the shard lives; ``tolist`` waits for them and for every write the stream queued before
        words = [int(w) for w in digests.words(list(cuts)).tolist()] if cuts else []
        self._store.set(
            f"v{self._version}/w{worker}", json.dumps({"places": self._epoch, "words": words}, separators=(",", ":"))
        )
        self._workers.add(worker)
        return words

    def release(self, timeout_s: float | None = None) -> None:
        """Block until every worker this version was shared with said it is done reading the shards, then drop
        the version's keys; ``TransferTimeoutError`` naming the first that did not within ``timeout_s``."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        workers, self._workers = sorted(self._workers), set()
        for w in workers:
            what = f"worker {w}'s done with trainer rank {self.rank}'s regions of v{self._version}"
            said = wait_key(self._store, f"v{self._version}/done/w{w}", timeout, what, Channel.IPC).decode()
            if said != "ok":
                log.warning(
                    "ipc regions: worker %d failed reading rank %d's v%s: %s", w, self.rank, self._version, said
                )
        self._store.delete_key(f"v{self._version}/places")
        for w in workers:
            self._store.delete_key(f"v{self._version}/w{w}")
            self._store.delete_key(f"v{self._version}/done/w{w}")

    def close(self) -> None:
        """Stop sharing: drop every export (a worker that still maps one keeps its memory until it unmaps)."""
        try:
            self._exports.keep(())
        except RuntimeError as e:  # rank 0's store is gone with rank 0: nobody reads the keys any more
            log.warning("ipc regions: trainer rank %d could not unpublish its exports: %s", self.rank, e)


class _Shared:
    """``regions.Shared`` for one worker of an ``Exporter``."""

    def __init__(self, exporter: Exporter, worker: int) -> None:
        self._exporter, self._worker = exporter, worker

    def share(self, regions: Sequence[Region], cuts: Sequence[torch.Tensor]) -> list[int]:
        return self._exporter._share(self._worker, cuts)


class Importer:
    """A worker's side of its co-located links: each rank's exports mapped once, its places read once an epoch."""

    def __init__(
        self, store: Any, worker: int, device: torch.device | str, timeout_s: float = 120.0, join_timeout_s: float = 0.0
    ) -> None:
        self.worker, self.timeout_s, self.join_timeout_s = worker, timeout_s, join_timeout_s
        self.device = gpu.cuda_device(device)
        self._store = store
        self._mappings: dict[int, ipc.Mappings] = {}
        self._shards: dict[int, tuple[int, dict[int, tuple[torch.Tensor, Box]]]] = {}  # rank -> (epoch, shards)

    def link(self, version: int, rank: int, table: TensorTable) -> _Copied:
        """The receiving end of the link from trainer ``rank`` for ``version`` (``regions.receive``'s links)."""
        return _Copied(self, version, rank, table)

    def _shards_of(self, rank: int, epoch: int, table: TensorTable) -> dict[int, tuple[torch.Tensor, Box]]:
        """Trainer ``rank``'s shards as views of its mapped memory, by table tensor, each with its box."""
        cached = self._shards.get(rank)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        store = _prefixed(self._store, rank)
        what = f"trainer rank {rank}'s shard places (epoch {epoch})"
        places = json.loads(wait_key(store, f"places/{epoch}", self.timeout_s, what, Channel.IPC))
        if not isinstance(places, list) or len(places) != len(table):
            got = f"{len(places)} tensors" if isinstance(places, list) else repr(places)[:80]
            raise PermanentError(f"ipc regions: trainer rank {rank}'s places give {got}; the table has {len(table)}")
        mappings = self._mappings.setdefault(rank, ipc.Mappings(store))
        mapped = mappings.map({p[0] for p in places if p is not None}, self.timeout_s, f"trainer rank {rank}'s ")
        shards: dict[int, tuple[torch.Tensor, Box]] = {}
        for t, p in enumerate(places):
            if p is None:
                continue
            buf, offset, offsets, lengths, strides = p
            dtype = TORCH_DTYPES[table.tensors[t].dtype]
            size = dtype.itemsize
            flat = mapped[buf][: mapped[buf].numel() // size * size].view(dtype)
            if offset % size or flat.device != self.device:
                raise PermanentError(
                    f"ipc regions: trainer rank {rank}'s shard of {table.tensors[t].name!r} lies at byte {offset} of "
                    f"a buffer on {flat.device}; worker {self.worker} reads on {self.device}, whole elements only"
                )
            view = flat.as_strided(tuple(lengths), tuple(strides), offset // size)
            shards[t] = (view, Box(tuple(offsets), tuple(lengths)))
        self._shards[rank] = (epoch, shards)
        return shards

    def close(self) -> None:
        """Unmap every rank's memory (the ranks keep their shards' memory until no worker maps it)."""
        for m in self._mappings.values():
            m.clear()
        self._mappings, self._shards = {}, {}


class _Copied:
    """``regions.Copied`` for one rank and version of an ``Importer``: copies start once the rank published where its
    shards lie (``publish``); the rank's words, computed meanwhile, are fetched when the walk first checks, then
    consumed in plan order (the walk fills a link's buckets in order)."""

    def __init__(self, importer: Importer, version: int, rank: int, table: TensorTable) -> None:
        self._importer, self.version, self.rank, self._table = importer, version, rank, table
        self._store = _prefixed(importer._store, rank)
        self._words: torch.Tensor | None = None
        self._shards: Mapping[int, tuple[torch.Tensor, Box]] | None = None
        self._pending: list[tuple[torch.Tensor, int]] = []  # (a bucket's word slots, how many) not yet written
        self._at = 0
        self.nbytes = 0

    def _wait(self, key: str, what: str) -> bytes:
        # published when the rank starts sending: the join deadline, then the transfer timeout
        imp = self._importer
        return wait_key(self._store, key, imp.join_timeout_s + imp.timeout_s, what, Channel.IPC)

    def _places(self) -> Mapping[int, tuple[torch.Tensor, Box]]:
        if self._shards is None:
            what = f"trainer rank {self.rank}'s shards of v{self.version}"
            raw = self._wait(f"v{self.version}/places", what)
            try:
                epoch = int(raw)
            except ValueError:
                raise PermanentError(f"ipc regions: {what}: malformed epoch {raw[:40]!r}") from None
            try:
                self._shards = self._importer._shards_of(self.rank, epoch, self._table)
            except RuntimeError as e:  # CUDA refuses the handles of a process that exited or freed them
                raise RetryableError(
                    f"worker {self._importer.worker}: {what} could not be mapped ({str(e).splitlines()[0]}): the rank "
                    "exited or freed them before this worker was done; the version fails"
                ) from e
        return self._shards

    def _sent(self) -> torch.Tensor:
        if self._words is None:
            what = f"trainer rank {self.rank}'s regions of v{self.version} for worker {self._importer.worker}"
            raw = self._wait(f"v{self.version}/w{self._importer.worker}", what)
            try:
                words = [int(w) for w in json.loads(raw)["words"]]
            except (KeyError, TypeError, ValueError) as e:
                raise PermanentError(f"ipc regions: malformed {what}: {raw[:120]!r} ({e})") from None
            self._words = torch.tensor(words, dtype=torch.int64).to(self._importer.device, non_blocking=True)
        return self._words

    def fill(self, regions: Sequence[Region], into: Sequence[torch.Tensor], words: torch.Tensor) -> None:
        shards = self._places()
        srcs, dsts = [], []
        for r, view in zip(regions, into, strict=True):
            spec = self._table.tensors[r.tensor]
            shard, box = shards.get(r.tensor, (None, None))
            if shard is None or box is None or not box.contains(r.source):
                raise PermanentError(
                    f"worker {self._importer.worker}: region {r.source} of tensor {spec.name!r} is planned from "
                    f"trainer rank {self.rank}, which shares {box if box is not None else 'none of it'}: the plan "
                    "and the rank's layout disagree"
                )
            srcs.append(view_of(shard, box, r.source))
            dsts.append(view.view(shard.dtype).view(r.source.lengths))
            self.nbytes += r.nbytes
        if srcs:
            torch._foreach_copy_(dsts, srcs)
        self._pending.append((words, len(regions)))

    def settle(self) -> None:
        """Write the rank's words into the buckets filled so far (waiting for them, bounded)."""
        if not self._pending:
            return
        sent = self._sent()
        for words, n in self._pending:
            if self._at + n > sent.numel():
                raise IntegrityError(
                    f"worker {self._importer.worker}: trainer rank {self.rank} published {sent.numel()} region "
                    f"digests for v{self.version}; the plan gives this link more: the two ends planned differently"
                )
            words.copy_(sent[self._at : self._at + n])
            self._at += n
        self._pending = []

    def release(self) -> None:
        """Say done once this worker's copies from the rank's memory have finished (and when the walk failed)."""
        imp = self._importer
        try:
            torch.cuda.current_stream(imp.device).synchronize()
            said = "ok"
        except RuntimeError as e:
            said = f"the copies failed: {e}"
        key = f"v{self.version}/done/w{imp.worker}"
        try:
            _prefixed(imp._store, self.rank).set(key, said)
        except RuntimeError as e:  # the rank's store is gone: the rank is gone too, nobody waits for this
            log.warning(
                "ipc regions: worker %d could not tell trainer rank %d it is done: %s", imp.worker, self.rank, e
            )


__all__ = ["Exporter", "Importer"]
