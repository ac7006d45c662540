"""The transfer plan: which trainer rank sends which region to which worker of which replica.

``plan`` is a pure function of the trainer's layout (who holds which box of each
tensor), the replicas' engine layouts (what each worker keeps and where it lands) and
the membership (which replicas take part, and whether each one's channel can take
regions at all). For every need of every worker it cuts the needed box at the
trainer's shard boundaries and picks, for each piece, one rank that holds it: where a
piece is replicated over several ranks, the least loaded so far (then the lowest
rank), so the bytes spread over the trainer's links. It guarantees:

- every worker receives exactly the boxes its layout needs: each element of each
  need arrives once, from one rank, and nothing else arrives;
- each region comes from a rank that holds all of it (no gather on the trainer);
- a replica is never sent a byte twice over one link: a worker's needs of one tensor
  do not overlap, so neither do its regions;
- the order is deterministic: tensors in table order (the trainer's send groups), then
  replicas in membership order, workers by rank, needs in layout order, pieces by
  offset. A replica's regions in this order are what its per-region digests combine
  in; a rank sends its regions in this order.

A replica that cannot take regions (its channel cannot, its layout could not be
recorded or was recorded against another table, or the trainer's layout is
unreadable) is planned on the gathered path and the plan says why. ``PlanCache``
keeps plans by (trainer layout, engine layouts, membership), so a version reuses the
previous version's plan until one of them changes.
"""

from __future__ import annotations

import bisect
import collections
import functools
import hashlib
import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.errors import PermanentError
from weightsync.sharding.boxes import Box, carry
from weightsync.sharding.fills import EngineLayout
from weightsync.sharding.shards import TrainerLayout
from weightsync.tensors import ITEMSIZE


@dataclass(frozen=True, slots=True)
class Region:
    """Box ``source`` of table tensor ``tensor``, sent by trainer ``rank`` to ``worker``, landing in box ``dest``
    of the worker's parameter ``param`` (``fills.WHOLE``: into the whole tensor handed to vLLM's loader)."""

    tensor: int
    rank: int
    worker: int
    source: Box
    param: int
    dest: Box
    nbytes: int


@dataclass(frozen=True, slots=True)
class Member:
    """A replica in the membership: its engine layout (None: its agent reported none) and, when its planned
    channel cannot take regions, why (the caller fills this from the channel rules)."""

    replica_id: str
    layout: EngineLayout | None
    refused: str = ""


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica's part: its regions in plan order, or the reason it takes the gathered path."""

    replica_id: str
    regions: tuple[Region, ...] = ()
    gathered: str = ""
    copied: frozenset[tuple[int, int]] = frozenset()
    """The (trainer rank, worker) links whose worker reads the rank's GPU (the same GPU, or a peer every worker of
    the replica reaches): the worker copies their regions by CUDA IPC (``channels.ipc_regions``); the coordinator
    fills it from both ends' GPUs (``sharding.links.copied``)."""

    @property
    def sharded(self) -> bool:
        return not self.gathered

    def receives(self, worker: int) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if r.worker == worker)


@dataclass(frozen=True)
class TransferPlan:
    key: str
    """Identifies the (trainer layout, engine layouts, membership) the plan was computed for."""
    replicas: tuple[ReplicaPlan, ...]

    @functools.cached_property
    def _order(self) -> tuple[tuple[int, int], ...]:
        """(replica index, region index) in the global order: tensor-major, then replica, then each replica's
        own order; a merge, since every replica's regions are already tensor-major."""
        streams = [[(r.tensor, ri, gi) for gi, r in enumerate(rp.regions)] for ri, rp in enumerate(self.replicas)]
        return tuple((ri, gi) for _, ri, gi in heapq.merge(*streams))

    def replica(self, replica_id: str) -> ReplicaPlan:
        for r in self.replicas:
            if r.replica_id == replica_id:
                return r
        planned = [r.replica_id for r in self.replicas]
        raise PermanentError(f"replica {replica_id!r} is not in this plan; planned: {planned}")

    def ordered(self) -> Iterator[tuple[str, Region]]:
        """Every region of every sharded replica, in the plan's global order."""
        for ri, gi in self._order:
            yield self.replicas[ri].replica_id, self.replicas[ri].regions[gi]

    def sends(self, rank: int) -> list[tuple[str, Region]]:
        """What trainer ``rank`` sends, in the order it sends it."""
        return [(rid, r) for rid, r in self.ordered() if r.rank == rank]

    def part_for_replica(self, replica_id: str) -> TransferPlan:
        """A replica's part: its own regions (every worker's), or why it takes the gathered path."""
        return TransferPlan(self.key, (self.replica(replica_id),))

    def bytes_sent(self) -> dict[int, int]:
        out: dict[int, int] = collections.Counter()
        for _, r in self.ordered():
            out[r.rank] += r.nbytes
        return dict(out)

    def bytes_received(self) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = collections.Counter()
        for rid, r in self.ordered():
            out[rid, r.worker] += r.nbytes
        return dict(out)

    def links(self) -> dict[tuple[int, str, int], int]:
        """Bytes per link, (trainer rank, replica, worker) -> bytes."""
        out: dict[tuple[int, str, int], int] = collections.Counter()
        for rid, r in self.ordered():
            out[r.rank, rid, r.worker] += r.nbytes
        return dict(out)


def plan_key(trainer: TrainerLayout, members: Sequence[Member]) -> str:
    h = hashlib.sha256(trainer.digest().encode())
    for m in members:
        h.update(f"\n{m.replica_id}\0{m.layout.digest() if m.layout else ''}\0{m.refused}".encode())
    return "sha256:" + h.hexdigest()


def plan(trainer: TrainerLayout, members: Sequence[Member]) -> TransferPlan:
    """The transfer plan for ``members`` (in membership order) from ``trainer`` (see the module doc)."""
    ids = [m.replica_id for m in members]
    if len(set(ids)) != len(ids):
        raise PermanentError(f"membership lists a replica twice: {ids}")
    table = trainer.table
    gathered = {m.replica_id: _why_gathered(trainer, m) for m in members}
    sharded = [m for m in members if not gathered[m.replica_id]]
    load: dict[int, int] = collections.Counter()
    regions: dict[str, list[Region]] = {m.replica_id: [] for m in members}
    for t, spec in enumerate(table.tensors):
        itemsize = ITEMSIZE[spec.dtype]
        holders = trainer.holders(t) if sharded else ()
        cuts = _Cuts(holders)
        # every piece on one rank (FSDP2): no choice of sender, so replicas of one engine layout get the same
        # regions of this tensor, cut once (8 replicas of Qwen3-235B: 355,584 regions each)
        forced = all(len(ranks) == 1 for _, ranks in holders)
        cut: dict[str, list[Region]] = {}  # this tensor's regions by engine layout, where forced
        for m in sharded:
            assert m.layout is not None  # _why_gathered planned a member without one on the gathered path
            out = regions[m.replica_id]
            same = cut.get(m.layout.digest()) if forced else None
            if same is not None:
                out.extend(same)
                for r in same:
                    load[r.rank] += r.nbytes
                continue
            mine: list[Region] = []
            for w in m.layout.workers:
                for need in w.needs().get(t, ()):
                    for box, ranks in cuts.pieces(need.source):
                        rank = min(ranks, key=lambda r: (load[r], r))
                        load[rank] += box.numel * itemsize
                        dest = carry(box, need.source, need.dest)
                        mine.append(Region(t, rank, w.rank, box, need.param, dest, box.numel * itemsize))
            out.extend(mine)
            if forced:
                cut[m.layout.digest()] = mine
    parts: list[tuple[Region, ...]] = []  # each distinct list of regions once: identical replicas share one
    for m in members:
        part = tuple(regions[m.replica_id])
        parts.append(next((p for p in parts if p == part), part))  # the same objects compare at once
    return TransferPlan(
        plan_key(trainer, members),
        tuple(ReplicaPlan(m.replica_id, p, gathered[m.replica_id]) for m, p in zip(members, parts, strict=True)),
    )


def _why_gathered(trainer: TrainerLayout, m: Member) -> str:
    if trainer.unsupported:
        return f"the trainer's layout cannot be read: {trainer.unsupported}"
    if m.refused:
        return m.refused
    if m.layout is None:
        return "its agent reported no engine layout"
    return m.layout.why_not(trainer.table)


class _Cuts:
    """A tensor's holder grid, searchable: the boxes partition the tensor into a product of intervals per
    dimension (``shards``), so a need's pieces come from a bisect per dimension, not a scan of every box."""

    def __init__(self, holders: Sequence[tuple[Box, tuple[int, ...]]]) -> None:
        self.cells = {box.offsets: (box, ranks) for box, ranks in holders}
        ndim = holders[0][0].ndim if holders else 0
        self.starts = [sorted({box.offsets[d] for box, _ in holders}) for d in range(ndim)]

    def pieces(self, need: Box) -> Iterable[tuple[Box, tuple[int, ...]]]:
        per_dim = []
        for d, starts in enumerate(self.starts):
            first = bisect.bisect_right(starts, need.offsets[d]) - 1
            last = bisect.bisect_left(starts, need.ends[d])
            per_dim.append(starts[max(first, 0) : last])
        for corner in _product(per_dim):
            box, ranks = self.cells[corner]
            piece = box.intersect(need)
            if piece is not None:
                yield piece, ranks


def _product(axes: Sequence[Sequence[int]]) -> Iterator[tuple[int, ...]]:
    if not axes:
        yield ()
        return
    for head in axes[0]:
        for tail in _product(axes[1:]):
            yield (head, *tail)


class Unplanned(Exception):
    """A plan the cache does not hold, asked for without computing it: ``plan(trainer, members)`` makes it."""

    def __init__(self, trainer: TrainerLayout, members: tuple[Member, ...]) -> None:
        super().__init__(f"no plan yet for {len(members)} members")
        self.trainer, self.members = trainer, members


class PlanCache:
    """Plans by (trainer layout, engine layouts, membership): computed once, reused every version until one
    of them changes. Bounded (least recently used goes first)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._plans: collections.OrderedDict[str, TransferPlan] = collections.OrderedDict()
        self.computed = 0

    def get(self, trainer: TrainerLayout, members: Sequence[Member], compute: bool = True) -> TransferPlan:
        """The plan, computed here when the cache lacks it, or, without ``compute``, ``Unplanned`` raised (the
        caller computes it where it blocks no one, then ``put``s it)."""
        key = plan_key(trainer, members)
        found = self._plans.get(key)
        if found is None:
            if not compute:
                raise Unplanned(trainer, tuple(members))
            found = self.put(plan(trainer, members))
        self._plans.move_to_end(key)
        return found

    def put(self, computed: TransferPlan) -> TransferPlan:
        self._plans[computed.key] = computed
        self._plans.move_to_end(computed.key)
        self.computed += 1
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return computed

    def find(self, key: str) -> TransferPlan | None:
        """The plan computed under ``key``, while the cache holds it (no use: what ``get`` keeps is unchanged)."""
        return self._plans.get(key)


def regions_to(items: Sequence[Region]) -> list[list[Any]]:
    """Regions as JSON rows (what crosses vLLM's ``collective_rpc`` and the trainer ranks' control group)."""
    return [[r.tensor, r.rank, r.worker, *_box_to(r.source), r.param, *_box_to(r.dest), r.nbytes] for r in items]


def regions_from(rows: Sequence[Sequence[Any]]) -> list[Region]:
    try:
        return [
            Region(int(t), int(rank), int(w), Box(tuple(so), tuple(sl)), int(p), Box(tuple(do), tuple(dl)), int(n))
            for t, rank, w, so, sl, p, do, dl, n in rows
        ]
    except (TypeError, ValueError) as e:
        raise PermanentError(
            f"malformed regions ({type(e).__name__}: {e}); expected the form of regions_to()"
        ) from None


def links_to(links: Iterable[tuple[int, int]]) -> list[list[int]]:
    """(trainer rank, worker) links as JSON rows, sorted (``ReplicaPlan.copied`` across the trainer's ranks and to
    the workers)."""
    return [[rank, worker] for rank, worker in sorted(links)]


def links_from(rows: Iterable[Sequence[Any]]) -> frozenset[tuple[int, int]]:
    return frozenset((int(rank), int(worker)) for rank, worker in rows)


def _box_to(box: Box) -> tuple[list[int], list[int]]:
    return list(box.offsets), list(box.lengths)


__all__ = [
    "Member",
    "PlanCache",
    "Region",
    "ReplicaPlan",
    "TransferPlan",
    "links_from",
    "links_to",
    "plan",
    "plan_key",
    "regions_from",
    "regions_to",
]
