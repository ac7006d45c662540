"""Regions point to point: every trainer rank sends its own shards, every worker receives only its slice.

The sharded path's data path (``docs/sharded.md``). A transfer plan
(``weightsync.sharding.plans``) lists, in plan order, which trainer rank sends which
box of which tensor to which worker of a replica. Over one torch.distributed group per
replica (gloo for CPU fleets; the calls are point-to-point, which NCCL has too), whose
ranks are the trainer's ranks first (group rank = trainer rank) and then the replica's
workers (group rank = trainer world size + worker):

- ``send``: a trainer rank cuts its regions (in plan order) from its local shard (the region's box minus the
  shard's offsets: no gather) and packs each link's (one link: the rank to one worker) into buckets of about
  ``BUCKET`` bytes where the shard lives: the regions copied in and digested as they are written
  (``digests.copy_words``: one batched kernel per bucket on a GPU), every region's digest word appended, so a
  bucket is one message;
- ``receive``: a worker posts the receives of its buckets (it cuts the same buckets from the same plan; messages
  between two group ranks arrive in the order they were sent), yields each region as a ``(Fill, tensor)`` piece
  (a view of the bucket) for ``weightsync_inference.landing`` once its bucket arrived, with its own digest of the
  bytes queued (one batched kernel per bucket; a link that copies regions itself digests them as it writes them),
  and checks every region's word against the one its rank sent at the end of the walk (one host sync for the
  version). A region whose bytes changed on the way fails the walk
  naming tensor, box, sending rank and worker; it may have landed by then, as every region before it did: a
  failed walk leaves the worker torn, which it is from its first landed byte anyway (the updater's fail-stop
  state).

Both sides go in rounds, round ``k`` being the ``k``-th bucket of each of the side's links: on a group whose
backend batches point-to-point calls (NCCL), a round is one ``batch_isend_irecv`` (the links move at once; a
send or receive per region, each its own serialized NCCL launch, ran 4-40x the link bound), elsewhere (gloo) one
call per bucket. ``WINDOW`` rounds are in flight, so packing the next overlaps the wire; the host waits on the
oldest round's works only, and reads the digest words once, at the end (a sync per round, where each side's
GPU is time-sliced with the other's process, cost a wait for the other's slice each time). Both return each
region's digest in their own plan order; ``combine`` puts a replica's digests (all its workers', or all ranks')
back in plan order into one digest, the sender's and the engine's side alike. Every wait is bounded by the
group's timeout (gloo's point-to-point calls take the one the group was formed with, NCCL's watchdog its own): a
rank that dies mid-send makes its peers' receives fail at once or at that timeout.

Each link takes its bytes from its own transport (``links``, keyed by the other end: worker on the sending side,
trainer rank on the receiving side): a ``Wire`` (a group and the other end's rank in it; by default the one
``pg``, group ranks as above), or, where the worker's process reads the rank's GPU (the same GPU, or a peer one:
``sharding.links.copied``), a CUDA IPC copy (``ipc_regions``): the rank publishes the link's digest words (a
``Shared`` end) and the worker copies the regions out of the rank's shard into the same buckets the wire would have
filled (a ``Copied`` end), checked the same way. So one version can move some links by IPC and the others over
NCCL, and the walk is the same. Given where the worker's regions land (``Places``: the engine's ``Landing``), an
IPC link copies each region straight into its parameter, digesting it as it writes it: on a GPU holding a rank and
a worker that link is most of the bytes, and a bucket would read and write them twice more (into the bucket, then
the landing copy out of it).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from weightsync.channels import collector, digests
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import IntegrityError, ModelMismatchError, PermanentError, TransferTimeoutError
from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import Fill
from weightsync.sharding.plans import Region
from weightsync.sharding.shards import TrainerLayout
from weightsync.tensors import TensorTable

BUCKET = 512 << 20
"""Bytes a sender packs into one message per link (a region larger goes alone). Every message costs a copy into
the bucket, a digest kernel and a host sync per round, whatever its size: on 2x H200 (1 rank -> 1 worker, Qwen3-8B,
16.4 GB, ``bench/sharded_gpu.py --bucket-mb``) 16 MiB buckets took 2.15x the link bound, 64 MiB 2.9x, 256 MiB 1.44x,
512 MiB 1.04x, 1 GiB 1.03x. 512 MiB is where the curve flattens; the memory in flight stays
``WINDOW`` x links x ``BUCKET`` per side at most (a bucket is as large as its regions). Both sides cut the same
buckets from the same plan: they must use the same value (``send``'s and ``receive``'s ``bucket``)."""
WINDOW = 2
"""Rounds in flight per side (a round: the next bucket of every link of the rank): the next round is packed, or
posted, while the previous one is on the wire (double buffering); the host waits (one sync for the round's digest
words) on the oldest only. Memory: ``WINDOW`` x links x ``BUCKET`` per side."""
DIRECT_BUCKET = 2 << 30
"""Bytes of regions a worker copies itself straight into their places per round of a direct link (``Places``): its
bucket holds only the few regions without a place, and every round costs host time whatever its bytes (its
launch table, the launch, the words; a walk is host-bound on 2x H200 with 512 MiB rounds), while a larger round
leaves the device idle longer before its first copy (its regions' places and views are found first)."""
_ALIGN = 16
"""Each region starts at a multiple of 16 bytes in its bucket, so one batched kernel digests a bucket's regions."""
_TAG = 24


@dataclass
class Tally:
    """What one side moved: each region's digest in its order, and bytes."""

    digests: list[str] = field(default_factory=list)
    nbytes: int = 0


@dataclass(frozen=True)
class Wire:
    """A link over a torch.distributed group: ``peer`` is the other end's rank in ``pg``."""

    pg: Any
    peer: int


class Shared(Protocol):
    """The sending end of a co-located link (``ipc_regions``): the worker reads the regions itself."""

    def share(self, regions: Sequence[Region], cuts: Sequence[torch.Tensor]) -> list[int]:
        """Publish ``regions`` (the link's, in plan order; ``cuts`` their views of the rank's shard) for the
        worker; return each region's digest word, computed where the shard lives."""
        ...


class Copied(Protocol):
    """The receiving end of a link the worker reads itself (``ipc_regions``, ``nixl_regions``): fills buckets from
    the rank's shard."""

    @property
    def direct(self) -> bool:
        """Whether ``fill`` writes into any memory of the worker's device (CUDA IPC's copies), so a region can go
        straight into its parameter (``Places``); NIXL reads into registered memory only: the walk's buckets."""
        ...

    def fill(self, regions: Sequence[Region], into: Sequence[torch.Tensor], words: torch.Tensor) -> torch.Tensor | None:
        """Copy ``regions`` (the link's next ones, in plan order) into ``into`` (each a flat uint8 view of a bucket
        or, on a ``direct`` link, possibly a view of the region's shape and dtype in its parameter), and the rank's
        digest words for them into ``words`` now or at the latest in ``settle``. Return the digest word of each
        ``into`` as written (computed in the same pass: CUDA IPC's copies), or None: the walk digests ``into``
        once it arrived."""
        ...

    def arrived(self) -> None:
        """Return once the bytes of every bucket filled so far are in place, or ordered before the kernels the walk
        queues next on the current stream (bounded): the walk calls it before it yields a round."""
        ...

    def settle(self) -> None:
        """Write the words of every bucket filled so far (bounded): the walk calls it once, before its check."""
        ...

    def release(self) -> None:
        """Tell the rank this worker is done reading its shard (after the copies finished), whatever happened."""
        ...


class Places(Protocol):
    """Where a worker's regions land (``weightsync_inference.landing.Landing``), for the links that copy regions
    themselves (``Copied.direct``): such a region is copied straight into its place, digested there, and not
    yielded; a bucket and a landing copy fewer (the co-located link of a GPU is most of its bytes)."""

    def place(self, fill: Fill) -> torch.Tensor | None:
        """The memory ``fill``'s bytes land in, as a view of the fill's source shape and dtype, ready to be written;
        None where it must come as a piece (a tensor the loader takes whole, a box no view can be)."""
        ...

    def landed(self, fill: Fill) -> None:
        """``fill``'s bytes were written into its place (queued on the current stream)."""
        ...


@dataclass(frozen=True)
class _Bucket:
    """One message of one link: regions (with their index in the side's own list), packed at 16-byte boundaries,
    then each region's digest word (int64, little-endian)."""

    peer: int
    regions: tuple[tuple[int, Region], ...]

    @property
    def offsets(self) -> list[int]:
        at, out = 0, []
        for _, r in self.regions:
            out.append(at)
            at += aligned(r.nbytes)
        return out

    @property
    def words_at(self) -> int:
        return sum(aligned(r.nbytes) for _, r in self.regions)

    @property
    def nbytes(self) -> int:
        return self.words_at + 8 * len(self.regions)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each region's bytes in ``buffer``."""
        return [buffer[at : at + r.nbytes] for at, (_, r) in zip(self.offsets, self.regions, strict=True)]

    def words(self, buffer: torch.Tensor) -> torch.Tensor:
        """The digest words that travel with the regions."""
        return buffer[self.words_at :].view(torch.int64)


def aligned(n: int) -> int:
    """``n`` bytes rounded up to a region's alignment in a bucket."""
    return -(-n // _ALIGN) * _ALIGN


def _rounds(
    regions: Sequence[Region],
    peer: Callable[[Region], int],
    bucket: int,
    skip: frozenset[int] = frozenset(),
    larger: frozenset[int] = frozenset(),
) -> list[list[_Bucket]]:
    """``regions`` (one side's, in plan order) cut into buckets per link (``peer``: the other end, the key of its
    link), each link's in order, leaving out the links in ``skip`` and cutting those in ``larger`` at
    ``DIRECT_BUCKET`` bytes instead; round ``k`` holds the ``k``-th bucket of every link that has one. Sender and
    receiver cut the same buckets of a wire link, so each pair of ranks exchanges its messages in the same order."""
    links: dict[int, list[list[tuple[int, Region]]]] = {}
    filled: dict[int, int] = {}  # bytes in each link's last bucket
    for i, r in enumerate(regions):
        p, n = peer(r), aligned(r.nbytes)
        if p in skip:
            continue
        own = links.setdefault(p, [[]])
        if own[-1] and filled[p] + n > (DIRECT_BUCKET if p in larger else bucket):
            own.append([])
            filled[p] = 0
        own[-1].append((i, r))
        filled[p] = filled.get(p, 0) + n
    deepest = max((len(b) for b in links.values()), default=0)
    return [[_Bucket(p, tuple(b[k])) for p, b in links.items() if k < len(b)] for k in range(deepest)]


def _post(pg: Any, ops: Sequence[tuple[str, torch.Tensor, int]]) -> list[Any]:
    """Post ``(\"send\"|\"recv\", tensor, group rank)`` ops. On NCCL (a group whose backend coalesces, or a bare
    communicator) as one batch: one grouped launch, the links of the round moving at once; otherwise (gloo, which
    has no batching, and the bare backends the CPU stream forms) one op each, as it arrives."""
    if not ops:
        return []
    if _bare_nccl(pg):  # a region group's own communicator (``region_groups``): one grouped launch too
        pg._start_coalescing()
        for kind, t, peer in ops:
            pg.send([t], peer, _TAG) if kind == "send" else pg.recv([t], peer, _TAG)
        return [pg._end_coalescing()]
    if _coalesces(pg, ops[0][1].device):
        batch = [
            dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, group=pg, tag=_TAG, group_peer=peer)
            for kind, t, peer in ops
        ]
        return list(dist.batch_isend_irecv(batch))
    return [pg.send([t], peer, _TAG) if kind == "send" else pg.recv([t], peer, _TAG) for kind, t, peer in ops]


def _post_links(ops: Sequence[tuple[str, torch.Tensor, Wire]]) -> list[tuple[Any, list[int]]]:
    """Post ops whose links may be over several groups (one batch per group): each work with the indices of the
    ops it stands for (one each, or the whole batch of its group)."""
    by_group: dict[int, list[int]] = {}
    for k, (_, _, link) in enumerate(ops):
        by_group.setdefault(id(link.pg), []).append(k)
    out: list[tuple[Any, list[int]]] = []
    for ks in by_group.values():
        pg = ops[ks[0]][2].pg
        works = _post(pg, [(ops[k][0], ops[k][1], ops[k][2].peer) for k in ks])
        out += [(w, [k]) for w, k in zip(works, ks, strict=True)] if len(works) == len(ks) else [(w, ks) for w in works]
    return out


def _bare_nccl(pg: Any) -> bool:
    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from torch builds without CUDA
    return nccl is not None and isinstance(pg, nccl)


def _coalesces(pg: Any, device: torch.device) -> bool:
    return isinstance(pg, dist.ProcessGroup) and bool(pg._get_backend(device).supports_coalescing)


Bound = Callable[[Any, str], None]
"""A bounded wait of a work (``region_groups.bound``): returns once it completed, raises past the group's timeout.
NCCL's works need it: their own ``wait`` returns at once and the host blocks later, on a sync."""


def _wait(works: Sequence[Any], bound: Bound | None, what: str) -> None:
    for work in works:
        if bound is not None:
            bound(work, what)
        work.wait()


class Cuts:
    """A rank's regions as views of its local shards, kept while the shards stay in the same memory: a version of
    an unchanged plan cuts none again. A cut is a view and its checks (``_cut``: about 20 us a region in an H200
    host's Python, ~600 regions a link for Qwen3-8B), and a co-located link's digest words wait for all of them.
    Keep one per replica across versions (``send``'s ``cuts``); one thread at a time."""

    def __init__(self) -> None:
        self._shards: tuple[Any, ...] = ()
        self._views: dict[tuple[int, Box], torch.Tensor] = {}

    def hold(self, layout: TrainerLayout, rank: int, local: Sequence[torch.Tensor | None]) -> None:
        """Keep the views while ``local`` is the same shards in the same memory as last time, else drop them."""
        shards = (layout, rank, memory_of(local))
        if shards != self._shards:
            self._shards, self._views = shards, {}

    def cut(self, layout: TrainerLayout, rank: int, local: Sequence[torch.Tensor | None], r: Region) -> torch.Tensor:
        """``_cut``, made once while ``hold`` keeps it."""
        view = self._views.get((r.tensor, r.source))
        if view is None:
            view = self._views[r.tensor, r.source] = _cut(layout, rank, local, r)
        return view


def memory_of(local: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
    """Where a rank's local shards lie (pointer, shape, strides, dtype; None where it holds none): equal for the same
    shards in the same memory, which views of them (``Cuts``) and exports of it (``shard_reads``) keep reading."""
    return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in local)


@collector.during
def send(
    pg: Any,
    layout: TrainerLayout,
    rank: int,
    local: Sequence[torch.Tensor | None],
    regions: Sequence[Region],
    window: int = WINDOW,
    bucket: int = BUCKET,
    links: Mapping[int, Wire | Shared] | None = None,
    bound: Bound | None = None,
    cuts: Cuts | None = None,
) -> Tally:
    """Send trainer ``rank``'s ``regions`` (its ``sends``, in plan order, one replica's) from its local shards.

    ``local[i]`` is the rank's local shard of table tensor ``i`` (None where it holds none). Each link's regions
    go packed in buckets of about ``bucket`` bytes with their digest words; the links of a round go at once.
    ``links`` maps a worker to its link's transport (default: ``Wire(pg, layout.world_size + worker)``); a
    ``Shared`` link's regions are handed to it whole, once the wire's first ``window`` rounds are posted.
    ``bound``: the group's bounded wait, where a work's own wait does not block (NCCL). ``cuts``: the regions'
    views kept from the versions before (``Cuts``; default: each cut anew).
    """
    cuts = cuts or Cuts()
    cuts.hold(layout, rank, local)
    got: list[str] = [""] * len(regions)
    tally = Tally()
    route = _routes(links, lambda w: Wire(pg, layout.world_size + w), (r.worker for r in regions), "worker")
    shared = {w: link for w, link in route.items() if not isinstance(link, Wire)}

    def account(indexed: Iterable[tuple[int, Region]], words: Sequence[int]) -> None:
        for (i, r), word in zip(indexed, words, strict=True):
            got[i] = _digest(r.nbytes, word)
            tally.nbytes += r.nbytes

    def share() -> None:
        for w, link in shared.items():
            own = [(i, r) for i, r in enumerate(regions) if r.worker == w]
            account(own, link.share([r for _, r in own], [cuts.cut(layout, rank, local, r) for _, r in own]))

    rounds = _rounds(regions, worker_of, bucket, frozenset(shared))
    # the shared links' words once the wire's first rounds are on their way: a worker that reads its regions itself
    # needs them only at its walk's end, a worker on the wire needs its buckets now
    first = min(window, len(rounds))
    if not first:
        share()
    posted: collections.deque[tuple[list[_Bucket], list[Any], list[torch.Tensor]]] = collections.deque()
    sent: list[tuple[list[_Bucket], torch.Tensor]] = []  # each round's regions and its words, read at the end

    def done() -> None:
        rnd, works, buffers = posted.popleft()
        _wait(works, bound, f"trainer rank {rank}'s sends to worker {', '.join(str(b.peer) for b in rnd)}")
        # the buffers had to live until here; their words go on without them
        sent.append((rnd, torch.cat([b.words(buf) for b, buf in zip(rnd, buffers, strict=True)])))

    try:
        for k, rnd in enumerate(rounds):
            buffers = [_pack(layout, rank, local, b, cuts) for b in rnd]
            ops = [("send", buf, route[b.peer]) for b, buf in zip(rnd, buffers, strict=True)]
            posted.append((rnd, [w for w, _ in _post_links(ops)], buffers))
            if k + 1 == first:
                share()
            while len(posted) > window:
                done()
        while posted:
            done()
    except RuntimeError as e:
        raise TransferTimeoutError(
            f"trainer rank {rank}: sending its regions failed or exceeded the group's timeout ({e}); the version "
            "fails and the group must be rebuilt"
        ) from e
    if sent:  # one host sync
        account((x for rnd, _ in sent for b in rnd for x in b.regions), torch.cat([w for _, w in sent]).tolist())
    tally.digests = got
    return tally


def _routes(links: Mapping[int, Any] | None, default: Callable[[int], Wire], ends: Any, what: str) -> dict[int, Any]:
    """Each other end's link: ``links``' (which must name every end the regions have), or the default wire."""
    wanted = sorted(set(ends))
    if links is None:
        return {e: default(e) for e in wanted}
    missing = [e for e in wanted if e not in links]
    if missing:
        raise PermanentError(
            f"regions: no link given for {what} {', '.join(map(str, missing))} (links name {sorted(links)}); every "
            f"{what} the regions name needs a transport (a Wire, or an IPC end where both are on one GPU)"
        )
    return {e: links[e] for e in wanted}


def _pack(
    layout: TrainerLayout, rank: int, local: Sequence[torch.Tensor | None], b: _Bucket, cuts: Cuts
) -> torch.Tensor:
    """One bucket: each region cut from the rank's shard and copied in, digested as it is written (on a GPU one
    launch for the bucket, strided cuts read as their rows: each byte read once, written once), then the words."""
    pieces = [cuts.cut(layout, rank, local, r) for _, r in b.regions]
    buffer = torch.empty(b.nbytes, dtype=torch.uint8, device=pieces[0].device)
    into = [v.view(p.dtype).view(p.shape) for v, p in zip(b.views(buffer), pieces, strict=True)]
    b.words(buffer).copy_(digests.copy_words(into, pieces))
    return buffer


def _cut(layout: TrainerLayout, rank: int, local: Sequence[torch.Tensor | None], r: Region) -> torch.Tensor:
    """The region as a view of the rank's own shard (where the shard lives). Called for every region of every
    version (about 480 per rank and replica for Qwen3-1.7B at TP=2): no new box, one view call (slicing each
    dimension cost about 20 us a region, most of a co-located rank's time before its digests on an H200)."""
    shard = layout.shards(rank)[r.tensor]
    tensor = local[r.tensor] if r.tensor < len(local) else None
    if r.rank != rank or shard is None or not shard.contains(r.source):
        raise PermanentError(
            f"trainer rank {rank} was given region {r.source} of tensor {layout.table.tensors[r.tensor].name!r} "
            f"(planned for rank {r.rank}), but holds {shard if shard is not None else 'none of it'}; the plan and "
            "the trainer's layout disagree"
        )
    spec = layout.table.tensors[r.tensor]
    if tensor is None or tensor.shape != shard.lengths or tensor.dtype != TORCH_DTYPES[spec.dtype]:
        got = "nothing" if tensor is None else f"{list(tensor.shape)} of {tensor.dtype}"
        raise ModelMismatchError(
            f"trainer rank {rank}: its local shard of {spec.name!r} is {got}; its layout says box {shard} of "
            f"{spec.dtype}: the trainer's layout was read from other tensors than the ones it sends"
        )
    return view_of(tensor.detach(), shard, r.source)


def view_of(tensor: torch.Tensor, held: Box, box: Box) -> torch.Tensor:
    """Box ``box`` of a tensor as a view of ``tensor``, which holds box ``held`` of it (``held`` contains ``box``):
    one call, where slicing each dimension costs several (a walk takes hundreds of regions a version)."""
    strides = tensor.stride()
    at = sum((a - b) * s for a, b, s in zip(box.offsets, held.offsets, strides, strict=True))
    return tensor.as_strided(box.lengths, strides, tensor.storage_offset() + at)


@dataclass(frozen=True)
class _Posted:
    """A round of ``receive`` in flight: its buckets, their works (with the buckets each stands for), each bucket's
    region views (in its buffer, or a region's place on a direct link), which of them are in their place already,
    and where the words its rank sent are (in the bucket, or apart for a copied link)."""

    rnd: list[_Bucket]
    works: list[tuple[Any, list[int]]]
    views: list[list[torch.Tensor]]
    placed: list[list[bool]]
    sent: list[torch.Tensor]
    written: list[torch.Tensor | None]
    """Per bucket, our digest words of its regions as a copied link wrote them (None: digested once arrived)."""


_Arrived = tuple[list[_Bucket], torch.Tensor, list[torch.Tensor]]
"""A round that arrived: its buckets, our digest words of their regions, the words their ranks sent (per bucket)."""


@collector.during_steps
def receive(
    pg: Any,
    trainers: int,
    worker: int,
    table: TensorTable,
    regions: Sequence[Region],
    tally: Tally,
    device: torch.device | str = "cpu",
    window: int = WINDOW,
    bucket: int = BUCKET,
    links: Mapping[int, Wire | Copied] | None = None,
    bound: Bound | None = None,
    places: Places | None = None,
) -> Iterator[tuple[Fill, torch.Tensor]]:
    """Receive ``worker``'s ``regions`` (its replica's, in plan order) from ``trainers`` trainer ranks; yield each
    as a ``(Fill, tensor)`` piece once its bucket arrived, bucket by bucket (the links of a round interleaved, not
    in plan order), and check every region's digest once all arrived (the walk raises then, after the last piece).
    ``tally`` gets each region's digest (in plan order) and bytes once they checked. ``bucket`` must be the
    senders' (``send``) on wire links. ``links`` maps a trainer rank to its link's transport (default:
    ``Wire(pg, rank)``); a ``Copied`` link fills its buckets itself, is checked like the rest, and is released
    when the walk ends, however it ends. With ``places``, a ``direct`` copied link copies each region straight
    into its place (``Places.place``), where the walk digests it and tells ``places`` it landed instead of
    yielding it. ``bound``: as for ``send``."""
    mine = [r for r in regions if r.worker == worker]
    route = _routes(links, lambda r: Wire(pg, r), (r.rank for r in mine), "trainer rank")
    copied = {r: link for r, link in route.items() if not isinstance(link, Wire)}
    direct = frozenset(r for r, link in copied.items() if link.direct) if places is not None else frozenset()
    rounds = iter(_rounds(mine, rank_of, bucket, larger=direct))
    posted: collections.deque[_Posted] = collections.deque()
    arrived: list[_Arrived] = []

    def post() -> None:
        rnd = next(rounds, None)
        if rnd is None:
            return
        views, placed, buffers = [], [], []
        for b in rnd:
            if b.peer in direct and places is not None:
                into, put, buffer = _placed(b, places, table, device)
            else:
                buffer = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
                into, put = b.views(buffer), [False] * len(b.regions)  # the views once: the walk's per-region cost
            views.append(into)
            placed.append(put)
            buffers.append(buffer)
        wired = [k for k, b in enumerate(rnd) if b.peer not in copied]
        try:  # gloo refuses to post on a pair its peer already closed
            works = _post_links([("recv", buffers[k], route[rnd[k].peer]) for k in wired])
        except RuntimeError as e:
            raise TransferTimeoutError(
                f"worker {worker}: posting the receives from trainer rank {', '.join(str(b.peer) for b in rnd)} "
                f"failed ({e}); the version fails and the group must be rebuilt"
            ) from e
        # a copied link's words go apart from its bucket: written at ``settle``, after the bucket is gone
        sent = [
            torch.empty(len(b.regions), dtype=torch.int64, device=device) if b.peer in copied else b.words(buf)
            for b, buf in zip(rnd, buffers, strict=True)
        ]
        # the copies after the wire's receives are posted: a rank slow to place its shards holds no other rank's
        written = [
            copied[b.peer].fill([r for _, r in b.regions], into, words) if b.peer in copied else None
            for b, into, words in zip(rnd, views, sent, strict=True)
        ]
        posted.append(_Posted(rnd, [(w, [wired[k] for k in ks]) for w, ks in works], views, placed, sent, written))

    try:
        for _ in range(window):
            post()
        while posted:
            p = posted.popleft()
            # one work per bucket (gloo), or one for a group's batch (NCCL): name the ranks it waited for
            for work, ks in p.works:
                late = [p.rnd[k] for k in ks]
                try:
                    _wait([work], bound, f"worker {worker}'s receives from trainer rank {late[0].peer}")
                except (RuntimeError, TransferTimeoutError) as e:
                    first = late[0].regions[0][1]
                    raise TransferTimeoutError(
                        f"worker {worker}: the regions from trainer rank {', '.join(str(b.peer) for b in late)} "
                        f"(from region {first.source} of {table.tensors[first.tensor].name!r} on) did not arrive "
                        f"({e}); the version fails and the group must be rebuilt"
                    ) from e
            post()
            for peer in dict.fromkeys(b.peer for b in p.rnd if b.peer in copied):
                copied[peer].arrived()
            # our words queued now, the wire's kept apart from their bucket: the round's buffers go with it
            ours = torch.cat([digests.words(v) if w is None else w for v, w in zip(p.views, p.written, strict=True)])
            sent = [w if b.peer in copied else w.clone() for b, w in zip(p.rnd, p.sent, strict=True)]
            arrived.append((p.rnd, ours, sent))
            for b, into, put in zip(p.rnd, p.views, p.placed, strict=True):
                for (_, r), data, done in zip(b.regions, into, put, strict=True):
                    fill = Fill(r.tensor, r.source, r.param, r.dest)
                    if done and places is not None:
                        places.landed(fill)
                        continue
                    yield fill, data.view(TORCH_DTYPES[table.tensors[r.tensor].dtype]).view(r.source.lengths)
        for link in copied.values():
            link.settle()
        tally.digests.extend(_check(worker, table, arrived))
        tally.nbytes += sum(r.nbytes for r in mine)
    finally:
        for link in copied.values():
            link.release()


def _placed(
    b: _Bucket, places: Places, table: TensorTable, device: torch.device | str
) -> tuple[list[torch.Tensor], list[bool], torch.Tensor]:
    """A direct link's bucket: each region's place, or, for the regions without one, a view of a buffer of those
    alone (the buffer returned)."""
    dests = [places.place(Fill(r.tensor, r.source, r.param, r.dest)) for _, r in b.regions]
    for (_, r), d in zip(b.regions, dests, strict=True):
        spec = table.tensors[r.tensor]
        if d is not None and (d.dtype != TORCH_DTYPES[spec.dtype] or tuple(d.shape) != r.source.lengths):
            raise PermanentError(
                f"the place given for region {r.source} of tensor {spec.name!r} is {list(d.shape)} of {d.dtype}; "
                f"the region is {list(r.source.lengths)} of {spec.dtype} (a place is a view of the region's shape "
                "and dtype, or None)"
            )
    rest = [r for (_, r), d in zip(b.regions, dests, strict=True) if d is None]
    buffer = torch.empty(sum(aligned(r.nbytes) for r in rest), dtype=torch.uint8, device=device)
    at, views = 0, []
    for (_, r), d in zip(b.regions, dests, strict=True):
        if d is None:
            d = buffer[at : at + r.nbytes]
            at += aligned(r.nbytes)
        views.append(d)
    return views, [d is not None for d in dests], buffer


def _check(worker: int, table: TensorTable, rounds: Sequence[_Arrived]) -> list[str]:
    """Each region's digest of what arrived against the word its rank sent with it (one host sync for all
    ``rounds``: each its buckets, our words, theirs per bucket), in the worker's plan order; a difference fails
    naming tensor, box, sending rank and worker."""
    regions = [x for rnd, _, _ in rounds for b in rnd for x in b.regions]
    if not regions:
        return []
    ours = torch.cat([o for _, o, _ in rounds])
    both = torch.cat([ours, *(t for _, _, theirs in rounds for t in theirs)]).tolist()
    half = len(both) // 2
    out = [""] * len(regions)
    for (i, r), got, sent in zip(regions, both[:half], both[half:], strict=True):
        if got != sent:
            raise IntegrityError(
                f"worker {worker}: region {r.source} of tensor {table.tensors[r.tensor].name!r} from trainer rank "
                f"{r.rank} arrived with digest {_digest(r.nbytes, got)}, but the rank sent {_digest(r.nbytes, sent)}: "
                "its bytes changed on the way; the version fails"
            )
        out[i] = _digest(r.nbytes, got)
    return out


def combine(regions: Sequence[Region], lists: Mapping[int, Sequence[str]], by: Callable[[Region], int]) -> str:
    """One digest over ``regions`` in plan order from per-side lists in each side's order: ``by`` is ``rank_of``
    for the senders' lists (by trainer rank), ``worker_of`` for the workers' (by worker)."""
    at: dict[int, int] = collections.Counter()
    h = hashlib.sha256()
    for r in regions:
        key = by(r)
        own = lists.get(key, ())
        if at[key] >= len(own):
            raise IntegrityError(f"side {key} reported {len(own)} region digests; the plan gives it more")
        h.update(f"{r.tensor}:{r.source}:{own[at[key]]}\n".encode())
        at[key] += 1
    extra = {k: len(v) - at[k] for k, v in lists.items() if len(v) > at[k]}
    if extra:
        raise IntegrityError(f"digests beyond the plan's regions (side: count): {extra}")
    return "sha256:" + h.hexdigest()


def rank_of(r: Region) -> int:
    return r.rank


def worker_of(r: Region) -> int:
    return r.worker


def _digest(nbytes: int, word: int) -> str:
    return f"{nbytes}:{word & ((1 << 64) - 1):016x}"


__all__ = [
    "Copied",
    "Cuts",
    "Places",
    "Shared",
    "Tally",
    "Wire",
    "combine",
    "memory_of",
    "rank_of",
    "receive",
    "send",
    "view_of",
    "worker_of",
]
