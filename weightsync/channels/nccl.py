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
while the replicas' workers join) when the membership's generation changes. Before
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

import datetime
import os
import threading
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Self

import torch

from weightsync.channels import digests, gpu, wire
from weightsync.channels.base import (
    Endpoint,
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
_WATCHDOG_FACTOR = 4
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


class NcclGroup:
    """One member's handle on one membership's group (the sender hosts the store)."""

    def __init__(self, store: Any, rendezvous: Rendezvous, rank: int, device: torch.device, bind: str) -> None:
        self.rdv, self.rank, self.device, self.bind = rendezvous, rank, device, bind
        self.timeout_s = rendezvous.timeout_s
        self.store = dist.PrefixStore(rendezvous.prefix, store)
        self._pg: Any = None
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def connect(self) -> None:
        """Form the group; every member calls this.

        Members first meet on the store (a bounded wait), so a member that never comes
        fails the others within the timeout instead of leaving them inside NCCL's init.
        """
        world_size = self.rdv.world_size

        def meet() -> None:
            self.store.set(f"joined/{self.rank}", "1")
            try:
                self.store.wait([f"joined/{r}" for r in range(world_size)], datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                raise TransferTimeoutError(
                    f"nccl channel: not all {world_size} members of group {self.rdv.group!r} at {self.rdv.endpoint} "
                    f"joined within {self.timeout_s:.0f}s: {e}"
                ) from e

        wire.bounded(meet, self.timeout_s, f"joining group {self.rdv.group!r}", Channel.NCCL)
        self._pg = wire.bounded(self._form, self.timeout_s, f"forming group {self.rdv.group!r}", Channel.NCCL)

    def _form(self) -> Any:
        world_size = self.rdv.world_size
        if transport() == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=self.timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind)]
            return dist.ProcessGroupGloo(self.store, self.rank, world_size, opts)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=self.timeout_s * _WATCHDOG_FACTOR)
        pg = dist.ProcessGroupNCCL(self.store, self.rank, world_size, opts)
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
            return _Works([self._pg.broadcast([t], self._opts) for t in tensors])
        self._pg._start_coalescing()
        for t in tensors:
            self._pg.broadcast([t], self._opts)
        return self._pg._end_coalescing()

    def wait(self, work: Any, timeout_s: float, what: str) -> None:
        gpu.wait(work, timeout_s, f"nccl channel: {what}", self.abort)
        work.wait()  # completed: raises if NCCL reported an error for it

    def abort(self) -> None:
        if self._pg is not None:
            pg, self._pg = self._pg, None
            if hasattr(pg, "abort"):
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

    @classmethod
    def create(cls, config: SenderConfig) -> Self:
        return cls(device=config.device, host=config.host, timeout_s=config.timeout_s)

    def offer(self) -> Offer:
        return Offer(Channel.NCCL, Endpoint(self.host, self.port))

    def take_plan(self, receivers: Mapping[str, Rendezvous]) -> None:
        """One group for every receiver planned on NCCL; rebuilt when its generation changes."""
        plans = dict(receivers)
        memberships = {(r.group, r.secret, r.generation, r.world_size) for r in plans.values()}
        if len(memberships) > 1:
            raise PermanentError(f"nccl channel: the plan names {len(memberships)} groups; one was expected")
        wanted = next(iter(plans.values()), None)
        current = self._group
        alive = current is not None and (current.connected or self._forming is not None)
        if wanted is not None and alive and wanted.same_membership(current.rdv if current else None):
            self.members = plans
            return
        self._await()
        if self._group is not None:
            self._group.abort()
            self._group = None
        self.members = plans
        if wanted is None:
            return
        group = NcclGroup(
            wire.own_connection(self._store), wanted.with_timeout(self.timeout_s), 0, self.device, self.host
        )
        self._group, self._form_error, self._tables = group, "", wire.Tables()
        self._forming = threading.Thread(  # a daemon, as the cpu channel's: exiting never waits for a formation
            target=self._form, args=(group,), name=f"weightsync-nccl-{wanted.group}", daemon=True
        )
        self._forming.start()

    def _form(self, group: NcclGroup) -> None:
        try:
            group.connect()
        except (TransferTimeoutError, RuntimeError) as e:
            self._form_error = str(e)

    def _await(self, timeout_s: float | None = None) -> None:
        forming = self._forming
        if forming is None:
            return
        waited = self.timeout_s + 5 if timeout_s is None else timeout_s
        forming.join(waited)
        self._forming = None
        if forming.is_alive():  # a member never joined: this group cannot form; end it once its wait ends
            group, self._group = self._group, None
            self._form_error = f"not every receiver joined within {waited:g}s"
            if group is not None:
                wire.end_when_done(forming, group.abort)

    def ready(self, timeout_s: float, members: Collection[str] | None = None) -> dict[str, str]:
        self._await(timeout_s)
        if self._group is None or not self._group.connected:
            why = self._form_error or "no receiver is planned on it"
            raise TransferTimeoutError(f"nccl channel: the group is not formed: {why}")
        return {}

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> SendReport:
        if ticket.table is None:
            raise PermanentError(f"nccl channel: the sender's ticket for v{ticket.version} has no table")
        self._await()
        group = self._group
        if group is None or not group.connected:
            why = self._form_error or "no receiver is planned on it (call take_plan first)"
            raise TransferTimeoutError(f"nccl channel: the group is not formed: {why}")
        self._tables.publish(group.store, ticket.table)
        try:
            return SendReport(self._send(group, ticket, ticket.table, groups))
        except (TransferTimeoutError, RuntimeError):
            group.abort()
            self._group = None  # broken: the next plan forms a new group, whatever its membership
            raise

    def _send(
        self, group: NcclGroup, ticket: UpdateTicket, table: TensorTable, groups: Iterable[Sequence[torch.Tensor]]
    ) -> dict[str, str]:
        sent_words: list[torch.Tensor] = []
        # per group: (its works, tensors kept alive until the device is done with them, what); a group's digests
        # travel with it and do not count against the groups in flight (counted, they halved the pipeline)
        in_flight: deque[tuple[list[Any], list[torch.Tensor], str]] = deque()
        for i, specs, tensors in wire.table_groups(table, groups):
            wire_tensors = gpu.wire_group(specs, tensors, self.device)
            while len(in_flight) >= IN_FLIGHT_GROUPS:
                works, _, what = in_flight.popleft()
                for work in works:
                    group.wait(work, ticket.timeout_s, what)
            what = f"group {i} broadcast (starting at {specs[0].name!r})"
            works = [group.broadcast([t for t in wire_tensors if t.numel()])]
            if ticket.verify:
                # digests computed on the device while the group is on the wire; no host sync until the end
                words = digests.words(wire_tensors, self.device)
                sent_words.append(words)
                works.append(group.broadcast([words]))
                wire_tensors.append(words)
            in_flight.append((works, wire_tensors, what))
        for works, _, what in in_flight:
            for work in works:
                group.wait(work, ticket.timeout_s, what)
        return digests.from_words(table.tensors, torch.cat(sent_words).cpu()) if sent_words else {}

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
        store = wire.join_store(rendezvous.endpoint, rendezvous.join_timeout_s, rendezvous.timeout_s, Channel.NCCL)
        self._group = NcclGroup(store, rendezvous, rank, self.device, wire.local_address_for(rendezvous.endpoint))
        self._group.connect()
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
        table = self.table = self._tables.fetch(self._group.store, ticket, ticket.timeout_s, Channel.NCCL)
        groups = table.groups()
        dests = dict(place(table)) if place is not None else {}

        def post(i: int) -> tuple[list[torch.Tensor], list[bool], Any, torch.Tensor | None, Any | None]:
            targets, direct = self._targets(groups[i], i % IN_FLIGHT_GROUPS, dests)
            self.in_place.update(s.name for s, d in zip(groups[i], direct, strict=True) if d)
            work = self._group.broadcast([t for t in targets if t.numel()])
            if not ticket.verify:
                return targets, direct, work, None, None
            words = torch.empty(len(groups[i]), dtype=torch.int64, device=self.device)
            return targets, direct, work, words, self._group.broadcast([words])

        pending = post(0) if groups else None
        for i, specs in enumerate(groups):
            assert pending is not None
            targets, direct, work, words, dwork = pending
            pending = post(i + 1) if i + 1 < len(groups) else None
            self._group.wait(work, ticket.timeout_s, f"group {i} broadcast (starting at {specs[0].name!r})")
            group: Group = list(zip(specs, targets, strict=True))
            staged = [pair for pair, d in zip(group, direct, strict=True) if not d]
            if words is not None and dwork is not None:
                self._group.wait(dwork, ticket.timeout_s, f"group {i} digests")
                if staged:  # the loader gets only verified bytes: compare now
                    self.check(group, digests.from_words(specs, words.cpu()))
                else:
                    self.check_later(group, words)
            if staged:
                yield staged
        self.checks_done()

    def close(self) -> None:
        self._group.abort()


SENDER = NcclSender
RECEIVER = NcclReceiver
