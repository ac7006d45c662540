"""The NCCL channel: layer groups broadcast from the trainer's GPU straight into the engine's parameters.

Scheme (chosen by measurement, bench/gpu_channels.py and docs/gpu-channels.md): the
trainer is rank 0 of an NCCL group whose other ranks are the replicas' workers. Each
layer group of the table is one NCCL launch: its tensors are broadcast one by one
inside torch's coalescing (``_start_coalescing``/``_end_coalescing``), so one kernel
moves the whole group and there is no packing copy on either side. The receiver
points each broadcast at its destination: a view of the engine's own parameter
(rows of a fused qkv/gate_up included, see ``placement``) where the dtype and shape
allow, else a slot of a staging buffer whose views are yielded to vLLM's loaders
(dtype casts, tensor-parallel shards, quantized layers). At most two groups are in
flight on either side, so the trainer can gather the next group while the last one
is on the wire and extra memory stays bounded by two groups.

The group is a ``ProcessGroupNCCL`` on the channel's own TCPStore (the trainer's
default group is never touched), one per membership the coordinator plans: every
replica planned on NCCL shares it, and ``take_plan`` rebuilds it (in the background,
while the replicas' workers join) when the membership's generation changes. Who is
in the communicator is the sender's roster (``rosters``), not the plan alone: a
replica whose workers did not all join by the join deadline is left out and the rest
form it without it; a member found silent mid-version (dead, frozen, cut off) is left
out of a new attempt of the group that the survivors form within another join
deadline, and they finish the version from the group the slowest of them had not
completed (the sender keeps its last ``RESUME_WINDOW`` groups for that). Each loss is
told at once (``Sender.lose``), so that replica alone takes the volume. Before
the first broadcast of a version the sender puts the version's table on the store,
under the membership's secret prefix; each receiver reads it there and checks it
against the coordinator's layout digest, so it posts exactly the broadcasts the
sender makes. Every wait is bounded: a collective that does not complete within the
ticket's timeout aborts the communicator (so the stuck kernel returns) and raises
``TransferTimeoutError``.

``WEIGHTSYNC_NCCL_TRANSPORT=gloo`` runs this same channel (rendezvous, generations,
in-band table, in-place destinations, verification) over gloo with CPU tensors: how
the CPU-only tests and machines exercise its code path. Production uses NCCL.

With verification on, each group is followed by a small broadcast of its tensors'
digests (computed on the trainer's GPU), checked on the receiver's GPU before the
group is handed over.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Self

import torch

from weightsync.channels import digests, gpu, rosters, wire
from weightsync.channels.base import (
    Endpoint,
    NoReceiver,
    Offer,
    Placement,
    Receiver,
    Rendezvous,
    Sender,
    SenderConfig,
    SendReport,
    UpdateTicket,
    WorkerContext,
)
from weightsync.channels.wire import TORCH_DTYPES, Group, dist, fits_in_place
from weightsync.errors import PermanentError, TransferTimeoutError
from weightsync.tensors import TensorSpec, TensorTable, align
from weightsync.vocabulary import Channel

IN_FLIGHT_GROUPS = 2
RESUME_WINDOW = IN_FLIGHT_GROUPS + 2
"""Groups the sender keeps after sending them, so the survivors of a lost member can resume within them."""
WATCHDOG_FACTOR = 4
"""torch's NCCL watchdog is the backstop only (it may end the process): it fires well after our own abort."""
TRANSPORT_ENV = "WEIGHTSYNC_NCCL_TRANSPORT"


def transport() -> str:
    """``nccl`` (the default) or ``gloo`` (CPU tensors, for tests and CPU-only machines)."""
    value = os.environ.get(TRANSPORT_ENV, "nccl")
    if value not in ("nccl", "gloo"):
        raise PermanentError(f"{TRANSPORT_ENV}={value!r}; use nccl (default) or gloo")
    return value


def _device(device: str | torch.device) -> torch.device:
    return gpu.cuda_device(device) if transport() == "nccl" else torch.device("cpu")


class _Works:
    """Several gloo works waited on as one (gloo has no coalescing)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class _Reform(Exception):
    """The sender started a new attempt of the group (a member was lost): arrive there and go on."""


class _Lost(Exception):
    """A member of the group is gone (``ranks``: the silent ones; empty when the collective failed outright)."""

    def __init__(self, ranks: set[int], why: str) -> None:
        super().__init__(why)
        self.ranks, self.why = ranks, why


class NcclGroup:
    """One member's handle on one membership's group (the sender hosts the store), formed per roster attempt."""

    def __init__(self, store: Any, rendezvous: Rendezvous, rank: int, device: torch.device, bind: str) -> None:
        self.rdv, self.rank, self.device, self.bind = rendezvous, rank, device, bind
        self.timeout_s, self.join_timeout_s = rendezvous.timeout_s, rendezvous.join_timeout_s
        self.store = dist.PrefixStore(rendezvous.prefix, store)
        # the roster keys a member polls while it waits: each read ends within the join deadline, for a member that
        # cannot hear the sender that long has been left out by it (the sender hosts the store: its reads are local)
        self.keys: Any = (
            self.store
            if rank == 0
            else wire.BoundedStore(self.store, self.join_timeout_s, f"group {rendezvous.group!r}", Channel.NCCL)
        )
        self.roster: rosters.Roster | None = None
        self._pg: Any = None
        self._posted: list[Any] = []
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def form(self, roster: rosters.Roster) -> None:
        """Form the communicator of ``roster``'s attempt (every member in it calls this), within the join deadline."""
        self.roster = roster
        store = dist.PrefixStore(f"a{roster.attempt}/", self.store)
        what = f"forming group {self.rdv.group!r} (attempt {roster.attempt}, {len(roster.ranks)} ranks)"
        rank, world_size = roster.index(self.rank), len(roster.ranks)
        self._pg = wire.bounded(lambda: self._make(store, rank, world_size), self.join_timeout_s, what, Channel.NCCL)

    def _make(self, store: Any, rank: int, world_size: int) -> Any:
        if transport() == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=self.timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind)]
            return dist.ProcessGroupGloo(store, rank, world_size, opts)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=self.timeout_s * WATCHDOG_FACTOR)
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        pg.eager_connect_single_device(self.device)
        return pg

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> Any:
        """One NCCL launch broadcasting every tensor of ``tensors`` from rank 0."""
        if self._pg is None:
            raise PermanentError("nccl channel: the group is not connected (it failed, or was never formed)")
        if transport() == "gloo":
            works = [self._pg.broadcast([t], self._opts) for t in tensors]
            self._posted = [w for w in self._posted if not w.is_completed()] + works
            return _Works(works)
        self._pg._start_coalescing()
        for t in tensors:
            self._pg.broadcast([t], self._opts)
        return self._pg._end_coalescing()

    def wait(self, work: Any, timeout_s: float, what: str, watch: Callable[[], None] | None = None) -> None:
        gpu.wait(work, timeout_s, f"nccl channel: {what}", self.abort, watch)
        work.wait()  # completed: raises if NCCL reported an error for it

    def abort(self) -> None:
        """End the communicator: NCCL's abort makes kernels stuck on a dead peer return; a gloo group is let go of
        once its posted works ended (its destructor would wait for them holding the GIL)."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if transport() == "gloo":
            wire.let_go(pg, self._posted, f"weightsync-nccl-release-{self.rdv.group}")
            self._posted = []
        elif hasattr(pg, "abort"):
            pg.abort()


class NcclSender(Sender):
    """Rank 0 of the planned membership's group; see the module docstring."""

    channel: ClassVar[Channel] = Channel.NCCL

    def __init__(
        self, device: str | torch.device = "cuda", host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0
    ) -> None:
        self.device = _device(device)
        self.host, self.timeout_s = host, timeout_s
        self._store = wire.serve_store(host, port, timeout_s)
        self.port = int(self._store.port)
        self._group: NcclGroup | None = None
        self._tables = wire.Tables()
        self._forming: threading.Thread | None = None
        self._form_error = ""
        self.members: dict[str, Rendezvous] = {}
        self._owner: dict[int, str] = {}
        """Rank -> the replica it belongs to, for the planned membership."""
        self._wanted: set[str] | None = None
        """The members still planned on this channel (``ready``); None: every planned one."""
        self._attempts: dict[str, int] = {}
        """The last roster attempt per membership prefix: a membership formed again starts past it."""

    @classmethod
    def create(cls, config: SenderConfig) -> Self:
        return cls(device=config.device, host=config.host, timeout_s=config.timeout_s)

    def offer(self) -> Offer:
        return Offer(Channel.NCCL, Endpoint(self.host, self.port))

    def _in(self, roster: rosters.Roster | None) -> set[str]:
        """The replicas a roster holds."""
        return {self._owner[r] for r in roster.ranks[1:]} if roster is not None else set()

    def take_plan(self, receivers: Mapping[str, Rendezvous]) -> None:
        """One group for every receiver planned on NCCL; formed again when its generation changes. (A membership
        that lost a member gets a new generation from the coordinator, so every member joins again; one planned
        again on the same generation anyway stays out of the roster it was left out of.)"""
        plans = dict(receivers)
        memberships = {(r.group, r.secret, r.generation, r.world_size) for r in plans.values()}
        if len(memberships) > 1:
            raise PermanentError(f"nccl channel: the plan names {len(memberships)} groups; one was expected")
        wanted = next(iter(plans.values()), None)
        current = self._group
        alive = current is not None and (current.connected or self._forming is not None)
        if wanted is not None and alive and wanted.same_membership(current.rdv if current else None):
            self.members, self._wanted = plans, None
            return
        self._await()
        if self._group is not None:
            self._group.abort()
            self._group = None
        self.members, self._wanted = plans, None
        if wanted is None:
            return
        self._owner = rosters.owners({rid: r.rank for rid, r in plans.items()}, wanted.world_size)
        group = NcclGroup(
            wire.own_connection(self._store), wanted.with_timeout(self.timeout_s), 0, self.device, self.host
        )
        attempt = self._attempts.get(wanted.prefix, 0) + 1
        self._attempts[wanted.prefix] = attempt
        self._group, self._form_error, self._tables = group, "", wire.Tables()
        deadline = time.monotonic() + wanted.join_timeout_s
        self._forming = threading.Thread(  # a daemon, as the cpu channel's: exiting never waits for a formation
            target=self._form, args=(group, attempt, deadline), name=f"weightsync-nccl-{wanted.group}", daemon=True
        )
        self._forming.start()

    def _wanted_ranks(self) -> set[int]:
        return {r for r, rid in self._owner.items() if self._wanted is None or rid in self._wanted}

    def _form(self, group: NcclGroup, attempt: int, deadline: float) -> None:
        try:
            roster = rosters.lead(group.store, attempt, self._wanted_ranks, self._owner, deadline)
            if len(roster.ranks) > 1:
                group.form(roster)
            else:
                group.roster = roster
                self._form_error = f"no receiver joined within the join deadline of {group.join_timeout_s:g}s"
        except (TransferTimeoutError, RuntimeError) as e:
            self._form_error = str(e)

    def _await(self, timeout_s: float | None = None) -> None:
        forming = self._forming
        if forming is None:
            return
        group = self._group
        waited = (group.join_timeout_s if group else self.timeout_s) + wire.GRACE_S if timeout_s is None else timeout_s
        forming.join(waited)
        self._forming = None
        if forming.is_alive():  # the communicator did not form in time: end it once its formation ends
            self._group = None
            self._form_error = f"the group did not form within {waited:g}s"
            if group is not None:
                wire.end_when_done(forming, group.abort)

    def _left_out(self) -> dict[str, str]:
        group = self._group
        roster = group.roster if group is not None else None
        inside = self._in(roster) if group is not None and group.connected else set()
        out: dict[str, str] = {}
        for rid in self.members:
            if self._wanted is not None and rid not in self._wanted:
                out[rid] = "nccl channel: no longer planned on this channel (the coordinator moved it)"
            elif rid in inside:
                continue
            elif roster is not None and group is not None and group.connected:
                out[rid] = (
                    f"nccl channel: not every worker of it joined group {group.rdv.group!r} within the join deadline "
                    f"of {group.join_timeout_s:g}s; the others go on without it"
                )
            else:
                out[rid] = f"nccl channel: the group is not formed: {self._form_error or 'no receiver joined'}"
        return out

    def narrow(self, members: Collection[str]) -> None:
        self._wanted = set(members)  # the roster being decided reads it at every poll

    def ready(self, timeout_s: float, members: Collection[str] | None = None) -> dict[str, str]:
        self._wanted = set(members) if members is not None else None
        self._await(timeout_s)
        left_out = self._left_out()
        if self._group is None or not self._group.connected:
            why = self._form_error or "no receiver is planned on it"
            raise NoReceiver(f"nccl channel: the group is not formed: {why}", left_out)
        return left_out

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> SendReport:
        if ticket.table is None:
            raise PermanentError(f"nccl channel: the sender's ticket for v{ticket.version} has no table")
        self._await()
        group = self._group
        if group is None or not group.connected:
            why = self._form_error or "no receiver is planned on it (call take_plan first)"
            raise TransferTimeoutError(f"nccl channel: the group is not formed: {why}")
        failed = self._left_out()
        for rid, why in failed.items():  # left out before the first byte, when the publisher did not ask ``ready``
            self.lose(rid, why)
        self._tables.publish(group.store, ticket.table)
        lost: dict[str, str] = {}
        assert group.roster is not None
        # a formed group may hold a member the coordinator has moved off since (its lease ran out, its side failed):
        # form the group again without it before the first byte instead of waiting for it to fall silent
        moved = {r for r in group.roster.ranks[1:] if self._wanted is not None and self._owner[r] not in self._wanted}
        try:
            if moved:
                self._reform(group, _Lost(moved, "no longer planned on this channel (the coordinator moved it)"), lost)
            found = self._send(group, ticket, ticket.table, groups, lost)
        except (TransferTimeoutError, RuntimeError, PermanentError) as e:
            with contextlib.suppress(RuntimeError):  # the members stop waiting for a new attempt
                rosters.abandon(group.store, f"v{ticket.version}: {e}"[:500])
            group.abort()
            self._group = None  # broken: the next plan forms a new group, whatever its membership
            raise
        return SendReport(found, {**failed, **lost})

    def _send(
        self,
        group: NcclGroup,
        ticket: UpdateTicket,
        table: TensorTable,
        groups: Iterable[Sequence[torch.Tensor]],
        lost: dict[str, str],
    ) -> dict[str, str]:
        """Stream every group, at most ``IN_FLIGHT_GROUPS`` in flight; when a member is lost, form the group again
        without it and go on from the group the slowest survivor had not completed (the last ``RESUME_WINDOW``
        groups sent are kept for that)."""
        sent_words: dict[int, torch.Tensor] = {}
        kept: deque[tuple[int, tuple[TensorSpec, ...], list[torch.Tensor]]] = deque(maxlen=RESUME_WINDOW)
        redo: deque[tuple[int, tuple[TensorSpec, ...], list[torch.Tensor]]] = deque()
        # per group: (its works, tensors kept alive until the device is done with them, what); a group's digests
        # travel with it and do not count against the groups in flight (counted, they halved the pipeline)
        in_flight: deque[tuple[list[Any], list[torch.Tensor], str]] = deque()
        source = wire.table_groups(table, groups)
        more = True
        while True:
            try:
                while in_flight and (len(in_flight) >= IN_FLIGHT_GROUPS or not (redo or more)):
                    works, _, what = in_flight.popleft()
                    for work in works:
                        self._wait(group, work, ticket.timeout_s, what)
                if not (redo or more):
                    break
                if redo:
                    i, specs, wire_tensors = redo.popleft()
                else:
                    item = next(source, None)
                    if item is None:
                        more = False
                        continue
                    i, specs, tensors = item
                    wire_tensors = gpu.wire_group(specs, tensors, self.device)
                    kept.append((i, specs, wire_tensors))
                what = f"group {i} broadcast (starting at {specs[0].name!r})"
                works = [group.broadcast([t for t in wire_tensors if t.numel()])]
                alive = list(wire_tensors)
                if ticket.verify:
                    # digests computed on the device while the group is on the wire; no host sync until the end
                    words = digests.words(wire_tensors, self.device)
                    sent_words[i] = words
                    works.append(group.broadcast([words]))
                    alive.append(words)
                in_flight.append((works, alive, what))
            except _Lost as e:
                resume = self._reform(group, e, lost)
                in_flight.clear()
                if not kept or resume < kept[0][0]:
                    raise TransferTimeoutError(
                        f"nccl channel: after a member was lost, the others had completed only {resume} groups, and "
                        f"the sender keeps the last {RESUME_WINDOW} (from group {kept[0][0] if kept else 0}): the "
                        "version cannot be finished in this group"
                    ) from None
                redo = deque(k for k in kept if k[0] >= resume)
        if not sent_words:
            return {}
        return digests.from_words(table.tensors, torch.cat([sent_words[i] for i in sorted(sent_words)]).cpu())

    def _wait(self, group: NcclGroup, work: Any, timeout_s: float, what: str) -> None:
        """One collective's wait, watching the members' heartbeats once it is slow: one silent for longer than the
        join deadline is lost (``_Lost``), as is any when the collective fails outright (a peer's connection closed)."""
        assert group.roster is not None
        silence: rosters.Silence | None = None

        def watch() -> None:
            nonlocal silence
            if silence is None:
                assert group.roster is not None
                silence = rosters.Silence(group.store, group.roster.ranks[1:], group.join_timeout_s)
                return
            quiet = silence.silent()
            if quiet:
                raise _Lost(quiet, f"{what}: silent for over the join deadline of {group.join_timeout_s:g}s")

        try:
            group.wait(work, timeout_s, what, watch)
        except RuntimeError as e:
            raise _Lost(set(), f"{what} failed ({e})") from e

    def _reform(self, group: NcclGroup, lost: _Lost, report: dict[str, str]) -> int:
        """Form the group again without the lost members (a new attempt: the survivors arrive within the join
        deadline, each with the groups it completed); tell ``lose`` of every replica left out. Returns the group
        to resume from."""
        old = group.roster
        assert old is not None
        group.abort()
        dead = {self._owner[r] for r in lost.ranks}
        attempt = old.attempt + 1
        self._attempts[group.rdv.prefix] = attempt

        def wanted() -> set[int]:
            return {r for r in old.ranks[1:] if self._owner[r] not in dead} & self._wanted_ranks()

        deadline = time.monotonic() + group.join_timeout_s
        roster = rosters.lead(group.store, attempt, wanted, self._owner, deadline)
        for rid in sorted(self._in(old) - self._in(roster)):
            why = lost.why if rid in dead else f"{lost.why}; it did not arrive at attempt {attempt} in time"
            report[rid] = f"nccl channel: {why}; the others finish the version without it"
            self.lose(rid, report[rid])
        if len(roster.ranks) < 2:
            raise TransferTimeoutError(f"nccl channel: every receiver of group {group.rdv.group!r} was lost")
        group.form(roster)
        return roster.resume

    def close(self) -> None:
        self._await()
        if self._group is not None:
            self._group.abort()
            self._group = None


class NcclReceiver(Receiver):
    """One receiving worker (rank >= 1) on its replica's device."""

    channel: ClassVar[Channel] = Channel.NCCL
    needs = ("endpoint", "group", "secret", "generation", "world_size", "rank")

    def __init__(self, rendezvous: Rendezvous, rank: int, device: str | torch.device) -> None:
        assert rendezvous.endpoint is not None
        self.device = _device(device)
        join_s = rendezvous.join_timeout_s
        store = wire.join_store(rendezvous.endpoint, join_s, rendezvous.timeout_s, Channel.NCCL)
        self._group = NcclGroup(store, rendezvous, rank, self.device, wire.local_address_for(rendezvous.endpoint))
        # its own connection: the main one may be inside a wait when a beat is due
        beats = wire.join_store(rendezvous.endpoint, join_s, rendezvous.timeout_s, Channel.NCCL)
        self._heartbeat = rosters.Heartbeat(dist.PrefixStore(rendezvous.prefix, beats), rank)
        try:
            attempt = rosters.first_attempt(self._group.keys, join_s, rendezvous.group)
            roster = rosters.join(self._group.keys, rank, attempt, 0, join_s + wire.GRACE_S, rendezvous.group)
            self._group.form(roster)
        except BaseException:
            self._heartbeat.stop()
            raise
        self._tables = wire.Tables()
        self._staging = [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in range(IN_FLIGHT_GROUPS)]

    @classmethod
    def from_rendezvous(cls, rendezvous: Rendezvous, ctx: WorkerContext) -> NcclReceiver:
        return cls(rendezvous, rendezvous.rank + ctx.rank, ctx.device)

    def _targets(
        self, specs: Sequence[TensorSpec], slot: int, destinations: dict[str, torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Where each tensor of a group lands: its destination view when it fits, else a staging slot."""
        direct = [fits_in_place(s, self.device, destinations.get(s.name)) for s in specs]
        need = sum(align(s.nbytes, 256) for s, d in zip(specs, direct, strict=True) if not d)
        if self._staging[slot].numel() < need:
            self._staging[slot] = torch.empty(need, dtype=torch.uint8, device=self.device)
        targets, offset = [], 0
        for spec, d in zip(specs, direct, strict=True):
            if d:
                targets.append(destinations[spec.name])
                continue
            raw = self._staging[slot][offset : offset + spec.nbytes]
            targets.append(raw.view(TORCH_DTYPES[spec.dtype]).view(spec.shape))
            offset += align(spec.nbytes, 256)
        return targets, direct

    def receive(self, ticket: UpdateTicket, place: Placement | None = None) -> Iterator[Group]:
        self.begin()
        # the sender puts the table there when it starts (at the latest at the join deadline): the transfer timeout
        # counts from then, not from this receiver's join
        first_wait_s = ticket.join_timeout_s + ticket.timeout_s
        table = self.table = self._tables.fetch(self._group.keys, ticket, first_wait_s, Channel.NCCL)
        dests = dict(place(table)) if place is not None else {}
        done, start = 0, 0
        while True:
            try:
                for i, staged in self._groups(ticket, table.groups(), dests, start, done):
                    done = i + 1
                    if staged:
                        yield staged
                break
            except _Reform:
                # a member was lost: arrive at the sender's new attempt with what this one completed, go on from
                # where the slowest survivor was (groups before ``done`` were loaded here already)
                self._group.abort()
                attempt = rosters.current_attempt(self._group.keys)
                wait_s = self._group.join_timeout_s + wire.GRACE_S
                roster = rosters.join(self._group.keys, self._group.rank, attempt, done, wait_s, self._group.rdv.group)
                self._group.form(roster)
                start = roster.resume
        self.checks_done()

    def _groups(
        self,
        ticket: UpdateTicket,
        groups: Sequence[tuple[TensorSpec, ...]],
        dests: dict[str, torch.Tensor],
        start: int,
        loaded: int,
    ) -> Iterator[tuple[int, Group]]:
        """(index, what to hand the loader) of each group from ``start``, received and verified; groups before
        ``loaded`` were handed over already and are received again only to keep the collectives in step."""

        def post(i: int) -> tuple[list[torch.Tensor], list[bool], Any, torch.Tensor | None, Any | None]:
            targets, direct = self._targets(groups[i], i % IN_FLIGHT_GROUPS, dests)
            self.in_place.update(s.name for s, d in zip(groups[i], direct, strict=True) if d)
            work = self._group.broadcast([t for t in targets if t.numel()])
            if not ticket.verify:
                return targets, direct, work, None, None
            words = torch.empty(len(groups[i]), dtype=torch.int64, device=self.device)
            return targets, direct, work, words, self._group.broadcast([words])

        pending = post(start) if start < len(groups) else None
        for i in range(start, len(groups)):
            specs = groups[i]
            assert pending is not None
            targets, direct, work, words, dwork = pending
            pending = post(i + 1) if i + 1 < len(groups) else None
            self._wait(work, ticket.timeout_s, f"group {i} broadcast (starting at {specs[0].name!r})")
            group: Group = list(zip(specs, targets, strict=True))
            staged = [pair for pair, d in zip(group, direct, strict=True) if not d]
            if words is not None and dwork is not None:
                self._wait(dwork, ticket.timeout_s, f"group {i} digests")
                if i < loaded:
                    pass  # checked when it was handed over
                elif staged:  # the loader gets only verified bytes: compare now
                    self.check(group, digests.from_words(specs, words.cpu()))
                else:
                    self.check_later(group, words)
            yield i, staged if i >= loaded else []

    def _wait(self, work: Any, timeout_s: float, what: str) -> None:
        """One collective's wait; a new attempt announced by the sender (a member was lost) ends it (``_Reform``),
        and so does a collective that failed outright once the sender announces one within the join deadline."""
        group = self._group
        assert group.roster is not None
        attempt = group.roster.attempt

        def watch() -> None:
            gave_up = rosters.abandoned(group.keys)
            if gave_up:
                group.abort()
                raise TransferTimeoutError(f"nccl channel: {what}: the sender gave up on the group ({gave_up})")
            if rosters.current_attempt(group.keys) > attempt:
                raise _Reform()

        try:
            group.wait(work, timeout_s, what, watch)
        except RuntimeError as e:  # the collective failed outright: a new attempt follows, or the sender gave up
            deadline = time.monotonic() + group.join_timeout_s + wire.GRACE_S
            while time.monotonic() < deadline:
                try:
                    watch()
                except _Reform:
                    raise _Reform() from e
                time.sleep(rosters.POLL_S)
            raise TransferTimeoutError(f"nccl channel: {what} failed and the sender formed no new attempt ({e})") from e

    def close(self) -> None:
        self._heartbeat.stop()
        self._group.abort()


SENDER = NcclSender
RECEIVER = NcclReceiver
