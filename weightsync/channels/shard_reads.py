"""Region links a worker reads itself: straight out of a trainer rank's shards, checked like the wire's.

The sharded path's one-sided links. A trainer rank makes the memory of its local shards readable once (kept while
the shard stays in the same memory) and publishes where each shard lies in it, when that changes; each version
(``publish``) it says which placement holds, once its shards are written, and then, per reading worker, the digest
word of each of that link's regions, computed where the shard lives (``regions.send`` hands it the regions' views:
``Exporter.link``). The worker opens the rank's memory once a placement and, inside ``regions.receive``'s walk,
reads each bucket's regions from the rank's shards into the bucket as soon as the version's placement is out
(``Importer.link``), so its reads overlap the rank's digests; before the walk yields a round it waits for its reads
(``arrived``), and before it checks, at its end, it writes the rank's words beside the regions' (``settle``): the
walk then checks every region's digest against the rank's word, failing naming tensor, box, rank and worker, as
for any link. Bytes are counted by the walk: a worker reads exactly its regions' bytes.

How a shard's memory is made readable and read is the link's transport (``Memory`` on the rank, ``Reader`` on the
worker): CUDA IPC where the two share a GPU (``ipc_regions``: the worker maps the rank's memory and copies), NIXL
elsewhere (``nixl_regions``: the worker's one-sided READs, over RDMA, NVLink or TCP as the transport finds).

The rank must not change its shards while a worker reads them: ``Exporter.release`` waits (bounded) until every
reading worker of the version said it is done (``done`` keys, set once the worker's reads finished, also when its
walk failed). A worker waits for a rank's placement and words at most the join deadline plus the transfer timeout
each: a rank that died before it shared them fails the worker with ``TransferTimeoutError`` naming it.

Everything on the store is JSON, nothing pickled, under a prefix per rank (``r<rank>/``): the transport's own keys,
``places/<epoch>`` (per table tensor: null, or [where its memory lies (the transport's), the shard's box offsets,
its lengths, its strides]), ``v<version>/places`` (the epoch of the version's placement), ``v<version>/w<worker>``
(``{"places": epoch, "words": [...]}``), ``v<version>/done/w<worker>``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from weightsync.channels import batched, digests, regions
from weightsync.channels.wire import TORCH_DTYPES, dist, wait_key
from weightsync.errors import IntegrityError, PermanentError, RetryableError, WeightsyncError
from weightsync.sharding.boxes import Box
from weightsync.sharding.plans import Region
from weightsync.sharding.shards import TrainerLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

log = logging.getLogger(__name__)


def prefixed(store: Any, rank: int) -> Any:
    """Trainer ``rank``'s keys on the membership's store."""
    return dist.PrefixStore(f"r{rank}/", store)


class Memory(Protocol):
    """A rank's side of the transport: makes its shards' memory readable and says where each lies."""

    channel: Channel

    def refuses(self, tensor: torch.Tensor) -> str:
        """Why ``tensor`` cannot be read through this transport ("" when it can)."""
        ...

    def where(self, tensor: torch.Tensor) -> list[Any]:
        """Where ``tensor``'s first element lies, as JSON the worker's ``Reader`` understands."""
        ...

    def keep(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Keep exactly ``tensors``' memory readable (after ``where`` for each); True when what a reader must open
        changed, so the placement gets a new epoch even where the places read the same."""
        ...

    def placed(self, epoch: int) -> None:
        """Called before placement ``epoch`` is published: publish what a reader needs for it."""
        ...

    def stage(self, worker: int, cuts: Sequence[torch.Tensor]) -> dict[str, Any]:
        """What ``worker`` needs beyond the places to read these regions of its link (``cuts``: their views of
        the shards, plan order): JSON sent with their digest words, which are computed after it on the stream."""
        ...

    def close(self) -> None: ...


Opened = Mapping[int, tuple[Any, Box]]
"""A rank's shards as a reader opened them: table tensor -> (the reader's handle on the shard, the shard's box)."""


class Reader(Protocol):
    """A worker's side of the transport: opens a rank's placement, reads regions out of it into buckets."""

    channel: Channel
    device: torch.device
    """Where the worker's buckets are."""
    direct: bool
    """Whether ``read`` writes into any memory on ``device`` (a parameter), not only into the walk's buckets."""

    def open(self, rank: int, store: Any, epoch: int, places: Sequence[Any], table: TensorTable) -> Opened:
        """Trainer ``rank``'s shards of placement ``epoch`` (``places``: the rank's list, one entry per tensor)."""
        ...

    def read(
        self,
        rank: int,
        first: int,
        pieces: Sequence[tuple[Any, Box, Region, torch.Tensor]],
        shared: Callable[[], Mapping[str, Any]],
    ) -> torch.Tensor | None:
        """Start reading each ``(shard, its box, region, into)`` (``into``: the region's flat uint8 bucket view, or
        on a ``direct`` reader possibly its place, of its shape and dtype; the first is the link's region ``first``
        in plan order); return the digest word of each ``into`` as written (computed in the same pass, queued), or
        None (the walk digests them once they arrived); ``shared``: the rank's message for this worker (its
        ``Memory.stage`` and the words), waited for when called."""
        ...

    def wait(self, rank: int, timeout_s: float) -> None:
        """Return once every read from ``rank`` started so far has landed; raise past ``timeout_s``."""
        ...

    def finish(self, rank: int) -> str:
        """End this version's reads from ``rank`` (waiting for any still in flight): "ok", or what failed."""
        ...

    def close(self) -> None: ...


class Exporter:
    """A trainer rank's side of its reading workers' links: placements, each version's words, the wait for done.
    A transport's subclass makes its ``Memory`` (``_memory``)."""

    def __init__(self, store: Any, rank: int, timeout_s: float = 120.0) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self._store = prefixed(store, rank)
        self.memory = self._memory(self._store)
        self._places = ""
        self._epoch = 0
        self._version: int | None = None
        self._workers: set[int] = set()
        self._layout: tuple[TrainerLayout, tuple[Any, ...]] | None = (
            None  # what was last published, to skip it when same
        )

    def _memory(self, store: Any) -> Memory:
        """The transport's side on this rank, keeping its keys on ``store`` (the rank's)."""
        raise NotImplementedError

    def publish(self, version: int, layout: TrainerLayout, local: Sequence[torch.Tensor | None]) -> None:
        """Share ``version`` of the rank's local shards (``local[i]``: its shard of table tensor ``i``, or None):
        make new memory readable, publish the places when they changed. Call once the shards are written, before
        ``regions.send``; ``release`` the previous version first."""
        if self._workers:
            raise PermanentError(
                f"trainer rank {self.rank}: v{version} published before v{self._version} was released: a worker may "
                "still read the shards (call Exporter.release first)"
            )
        same = (layout, regions.memory_of(local))
        if self._layout is None or same[0] is not self._layout[0] or same[1] != self._layout[1]:
            self._place(layout, local)  # else the steady state: the same shards in the same memory
        self._version, self._layout = version, same
        for device in {t.device for t in local if t is not None and t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the workers read only finished shards
        # the workers start reading now; the words follow (``link``'s share) while they read
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
            refused = self.memory.refuses(tensor)
            if refused or tuple(tensor.shape) != box.lengths or spec.dtype not in TORCH_DTYPES:
                raise PermanentError(
                    f"trainer rank {self.rank}: its shard of {spec.name!r} is {list(tensor.shape)} on {tensor.device}"
                    f"; a {self.memory.channel.value} region link reads box {box} of it"
                    f"{f' ({refused})' if refused else ' (the layout and the shards disagree)'}"
                )
            t_ = tensor.detach()
            held.append(t_)
            places.append([*self.memory.where(t_), list(box.offsets), list(t_.shape), list(t_.stride())])
        reopen = self.memory.keep(held)
        text = json.dumps(places, separators=(",", ":"))
        if text != self._places or reopen:
            self._epoch += 1
            self.memory.placed(self._epoch)
            self._store.set(f"places/{self._epoch}", text)
            # a worker reads the epoch its version names before it says done, and ``release`` waits for that
            self._store.delete_key(f"places/{self._epoch - 1}")
            self._places = text

    def link(self, worker: int) -> _Shared:
        """The sending end of the link to ``worker`` for the version last published (``regions.send``'s links)."""
        return _Shared(self, worker)

    def _share(self, worker: int, cuts: Sequence[torch.Tensor]) -> list[int]:
        if self._version is None:
            raise PermanentError(f"trainer rank {self.rank}: a region link shared before Exporter.publish")
        staged = self.memory.stage(worker, cuts)
        # kernels where the shard lives; ``tolist`` waits for them and for every write the stream queued before
        words = [int(w) for w in digests.words(list(cuts)).tolist()] if cuts else []
        message = {"places": self._epoch, "words": words, **staged}
        self._store.set(f"v{self._version}/w{worker}", json.dumps(message, separators=(",", ":")))
        self._workers.add(worker)
        return words

    def release(self, timeout_s: float | None = None) -> None:
        """Block until every worker this version was shared with said it is done reading the shards, then drop
        the version's keys; ``TransferTimeoutError`` naming the first that did not within ``timeout_s``."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        workers, self._workers = sorted(self._workers), set()
        channel = self.memory.channel
        for w in workers:
            what = f"worker {w}'s done with trainer rank {self.rank}'s regions of v{self._version}"
            said = wait_key(self._store, f"v{self._version}/done/w{w}", timeout, what, channel).decode()
            if said != "ok":
                log.warning(
                    "%s regions: worker %d failed reading rank %d's v%s: %s", channel, w, self.rank, self._version, said
                )
        self._store.delete_key(f"v{self._version}/places")
        for w in workers:
            self._store.delete_key(f"v{self._version}/w{w}")
            self._store.delete_key(f"v{self._version}/done/w{w}")

    def close(self) -> None:
        """Stop sharing: the memory is no longer readable (a worker that still maps it keeps it until it unmaps)."""
        try:
            self.memory.close()
        except RuntimeError as e:  # rank 0's store is gone with rank 0: nobody reads the keys any more
            log.warning("region links: trainer rank %d could not unpublish its memory: %s", self.rank, e)


class _Shared:
    """``regions.Shared`` for one worker of an ``Exporter``."""

    def __init__(self, exporter: Exporter, worker: int) -> None:
        self._exporter, self._worker = exporter, worker

    def share(self, regions: Sequence[Region], cuts: Sequence[torch.Tensor]) -> list[int]:
        return self._exporter._share(self._worker, cuts)


class Importer:
    """A worker's side of its reading links: each rank's placement opened once an epoch. A transport's subclass
    makes its ``Reader`` (``_reader``)."""

    def __init__(
        self, store: Any, worker: int, device: torch.device | str, timeout_s: float = 120.0, join_timeout_s: float = 0.0
    ) -> None:
        self.worker, self.timeout_s, self.join_timeout_s = worker, timeout_s, join_timeout_s
        self.reader = self._reader(device)
        self._store = store
        self._shards: dict[int, tuple[int, Opened]] = {}  # rank -> (epoch, shards)

    def _reader(self, device: torch.device | str) -> Reader:
        """The transport's side on this worker, reading into buckets on ``device``."""
        raise NotImplementedError

    def link(self, version: int, rank: int, table: TensorTable) -> _Read:
        """The receiving end of the link from trainer ``rank`` for ``version`` (``regions.receive``'s links)."""
        return _Read(self, version, rank, table)

    def _shards_of(self, rank: int, epoch: int, table: TensorTable) -> Opened:
        cached = self._shards.get(rank)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        store = prefixed(self._store, rank)
        what = f"trainer rank {rank}'s shard places (epoch {epoch})"
        places = json.loads(wait_key(store, f"places/{epoch}", self.timeout_s, what, self.reader.channel))
        if not isinstance(places, list) or len(places) != len(table):
            got = f"{len(places)} tensors" if isinstance(places, list) else repr(places)[:80]
            raise PermanentError(
                f"{self.reader.channel} regions: trainer rank {rank}'s places give {got}; the table has {len(table)}"
            )
        shards = self.reader.open(rank, store, epoch, places, table)
        self._shards[rank] = (epoch, shards)
        return shards

    def close(self) -> None:
        """Close every rank's memory (the ranks keep their shards' memory until no worker maps it)."""
        self.reader.close()
        self._shards = {}


class _Read:
    """``regions.Copied`` for one rank and version of an ``Importer``: reads start once the rank published where its
    shards lie (``publish``); the rank's words, computed meanwhile, are fetched when the walk checks, at its end
    (or earlier where the transport needs the rank's message to read), and consumed in plan order (the walk fills
    a link's buckets in order)."""

    def __init__(self, importer: Importer, version: int, rank: int, table: TensorTable) -> None:
        self._importer, self.version, self.rank, self._table = importer, version, rank, table
        self._store = prefixed(importer._store, rank)
        self._words: torch.Tensor | None = None
        self._message: dict[str, Any] | None = None
        self._shards: Opened | None = None
        self._filled = 0  # regions handed to the reader so far
        self._pending: list[tuple[torch.Tensor, int]] = []  # (a bucket's word slots, how many) not yet written
        self._at = 0
        self.nbytes = 0

    @property
    def _channel(self) -> Channel:
        return self._importer.reader.channel

    @property
    def direct(self) -> bool:
        return self._importer.reader.direct

    def _wait(self, key: str, what: str) -> bytes:
        # published when the rank starts sending: the join deadline, then the transfer timeout
        imp = self._importer
        return wait_key(self._store, key, imp.join_timeout_s + imp.timeout_s, what, self._channel)

    def _places(self) -> Opened:
        if self._shards is None:
            what = f"trainer rank {self.rank}'s shards of v{self.version}"
            raw = self._wait(f"v{self.version}/places", what)
            try:
                epoch = int(raw)
            except ValueError:
                raise PermanentError(f"{self._channel} regions: {what}: malformed epoch {raw[:40]!r}") from None
            try:
                self._shards = self._importer._shards_of(self.rank, epoch, self._table)
            except RuntimeError as e:  # the transport refuses the memory of a process that exited or freed it
                raise RetryableError(
                    f"worker {self._importer.worker}: {what} could not be opened ({str(e).splitlines()[0]}): the rank "
                    "exited or freed them before this worker was done; the version fails"
                ) from e
        return self._shards

    def _shared(self) -> dict[str, Any]:
        """The rank's message for this worker: the words, and what its ``Memory.stage`` said (waited for once)."""
        if self._message is None:
            what = f"trainer rank {self.rank}'s regions of v{self.version} for worker {self._importer.worker}"
            raw = self._wait(f"v{self.version}/w{self._importer.worker}", what)
            try:
                message = json.loads(raw)
                words = [int(w) for w in message["words"]]
            except (KeyError, TypeError, ValueError) as e:
                raise PermanentError(f"{self._channel} regions: malformed {what}: {raw[:120]!r} ({e})") from None
            self._message = message
            self._words = batched.upload(torch.tensor(words, dtype=torch.int64), self._importer.reader.device)
        return self._message

    def _sent(self) -> torch.Tensor:
        self._shared()
        assert self._words is not None
        return self._words

    def fill(self, regions: Sequence[Region], into: Sequence[torch.Tensor], words: torch.Tensor) -> torch.Tensor | None:
        shards = self._places()
        pieces = []
        for r, view in zip(regions, into, strict=True):
            shard, box = shards.get(r.tensor, (None, None))
            if shard is None or box is None or not box.contains(r.source):
                raise PermanentError(
                    f"worker {self._importer.worker}: region {r.source} of tensor "
                    f"{self._table.tensors[r.tensor].name!r} is planned from trainer rank {self.rank}, which shares "
                    f"{box if box is not None else 'none of it'}: the plan and the rank's layout disagree"
                )
            pieces.append((shard, box, r, view))
            self.nbytes += r.nbytes
        written = self._importer.reader.read(self.rank, self._filled, pieces, self._shared) if pieces else None
        self._filled += len(pieces)
        self._pending.append((words, len(regions)))
        return written

    def arrived(self) -> None:
        """Wait for the reads so far (bounded)."""
        self._importer.reader.wait(self.rank, self._importer.timeout_s)

    def settle(self) -> None:
        """Wait for the reads so far, then write the rank's words into the word slots of the buckets filled so far
        (bounded)."""
        if not self._pending:
            return
        self.arrived()
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
        """Say done once this worker's reads from the rank's memory have finished (and when the walk failed)."""
        imp = self._importer
        try:
            said = imp.reader.finish(self.rank)
        except (RuntimeError, WeightsyncError) as e:
            said = f"the reads failed: {e}"
        try:
            self._store.set(f"v{self.version}/done/w{imp.worker}", said)
        except RuntimeError as e:  # the rank's store is gone: the rank is gone too, nobody waits for this
            log.warning(
                "%s regions: worker %d could not tell trainer rank %d it is done: %s",
                self._channel,
                imp.worker,
                self.rank,
                e,
            )


__all__ = ["Exporter", "Importer", "Memory", "Opened", "Reader", "prefixed"]
