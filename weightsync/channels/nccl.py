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
default group is never touched), built explicitly for a member list: ``rebuild``
with the new list when replicas come or go, or after a failure. Every wait is
bounded: a collective that does not complete within the ticket's timeout aborts the
communicator (so the stuck kernel returns) and raises ``TransferTimeoutError``.

With verification on, each group is followed by a small broadcast of its tensors'
digests (computed on the trainer's GPU), checked on the receiver's GPU before the
group is handed over.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from weightsync.channels import digests, gpu
from weightsync.channels.base import (
    TORCH_DTYPES,
    Group,
    Receiver,
    Sender,
    UpdateTicket,
    WorkerContext,
    dist,
    fits_in_place,
    init_field,
    tcp_store,
    verify_group,
)
from weightsync.errors import PermanentError, TransferTimeoutError
from weightsync.tensors import TensorSpec, align
from weightsync.vocabulary import Channel

IN_FLIGHT_GROUPS = 2
_WATCHDOG_FACTOR = 4
"""torch's NCCL watchdog is the backstop only (it may end the process): it fires well after our own abort."""


class NcclGroup:
    """One member's handle on the channel's NCCL group (rank 0 hosts the store)."""

    def __init__(self, host: str, port: int, rank: int, device: torch.device, timeout_s: float) -> None:
        self.host, self.rank, self.device, self.timeout_s = host, rank, device, timeout_s
        self._store = tcp_store(host, port, rank == 0, timeout_s)
        self.port = self._store.port
        self._pg: Any = None
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def connect(self, generation: int, world_size: int) -> None:
        """Form the group of ``world_size`` for membership ``generation``; all members call this.

        Members first meet on the store (a bounded wait), so a member that never comes
        fails the others within the timeout instead of leaving them inside NCCL's init.
        """
        self.abort()
        store = dist.PrefixStore(f"weightsync/nccl/{generation}/", self._store)
        store.set(f"joined/{self.rank}", "1")
        try:
            store.wait([f"joined/{r}" for r in range(world_size)], datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise TransferTimeoutError(
                f"nccl channel: not all {world_size} members of group {generation} at {self.host}:{self.port} "
                f"joined within {self.timeout_s:.0f}s: {e}"
            ) from e
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=self.timeout_s * _WATCHDOG_FACTOR)
        pg = dist.ProcessGroupNCCL(store, self.rank, world_size, opts)
        pg.eager_connect_single_device(self.device)
        self._pg = pg

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> Any:
        """One NCCL launch broadcasting every tensor of ``tensors`` from rank 0."""
        if self._pg is None:
            raise PermanentError("nccl channel: the group is not connected (connect/rebuild first, or after a failure)")
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
            pg.abort()


def _words(group_digests: list[str], device: torch.device) -> torch.Tensor:
    return digests.to_words(group_digests).to(device)


class NcclSender(Sender):
    """Rank 0. Create it, hand ``init_info(member)`` to each receiving worker, then ``connect()``.

    ``members`` names every receiving worker (one per tensor-parallel rank of each
    replica); a member's rank is 1 + its index.
    """

    channel: ClassVar[Channel] = Channel.NCCL

    def __init__(
        self,
        members: Sequence[str],
        device: str | torch.device = "cuda",
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 120.0,
    ) -> None:
        self.device = gpu.cuda_device(device)
        self._group = NcclGroup(host, port, 0, self.device, timeout_s)
        self.members: list[str] = []
        self.generation = 0
        self._set_members(members)

    def _set_members(self, members: Sequence[str]) -> None:
        if not members or len(set(members)) != len(members):
            raise PermanentError(f"nccl channel: members must be distinct and non-empty, got {list(members)}")
        self.members = list(members)
        self.generation += 1

    @property
    def address(self) -> str:
        return f"{self._group.host}:{self._group.port}"

    def init_info(self, member: str) -> dict[str, Any]:
        """What a receiving worker needs; a tensor-parallel replica passes its first worker's name."""
        if member not in self.members:
            raise PermanentError(f"nccl channel: {member!r} is not a member; members: {self.members}")
        return {
            "address": self.address,
            "world_size": 1 + len(self.members),
            "rank_offset": 1 + self.members.index(member),
            "generation": self.generation,
            "timeout_s": self._group.timeout_s,
        }

    def connect(self) -> None:
        self._group.connect(self.generation, 1 + len(self.members))

    def rebuild(self, members: Sequence[str]) -> None:
        """Drop the current group and take a new member list; hand out ``init_info`` again, then ``connect()``."""
        self._group.abort()
        self._set_members(members)

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> dict[str, str]:
        found: dict[str, str] = {}
        source = iter(groups)
        # (work, tensors kept alive until the GPU is done with them, what)
        in_flight: deque[tuple[Any, list[torch.Tensor], str]] = deque()
        for i, specs in enumerate(ticket.table.groups()):
            tensors = next(source, None)
            if tensors is None or len(tensors) != len(specs):
                got = "nothing" if tensors is None else f"{len(tensors)} tensors"
                raise PermanentError(f"group {i} (starting at {specs[0].name!r}): got {got}, expected {len(specs)}")
            wire = [gpu.wire_tensor(s, t, self.device) for s, t in zip(specs, tensors, strict=True)]
            while len(in_flight) >= IN_FLIGHT_GROUPS:
                self._group.wait(in_flight[0][0], ticket.timeout_s, in_flight[0][2])
                in_flight.popleft()
            what = f"group {i} broadcast (starting at {specs[0].name!r})"
            in_flight.append((self._group.broadcast([t for t in wire if t.numel()]), wire, what))
            if ticket.verify:
                group_digests = [digests.digest(t) for t in wire]
                found.update({s.name: d for s, d in zip(specs, group_digests, strict=True)})
                words = _words(group_digests, self.device)
                in_flight.append((self._group.broadcast([words]), [words], f"group {i} digests"))
        for work, _, what in in_flight:
            self._group.wait(work, ticket.timeout_s, what)
        if next(source, None) is not None:
            raise PermanentError("the trainer yielded more groups than the table lists")
        return found

    def close(self) -> None:
        self._group.abort()


class NcclReceiver(Receiver):
    """One receiving worker (rank >= 1) on its replica's GPU."""

    channel: ClassVar[Channel] = Channel.NCCL

    def __init__(
        self, address: str, world_size: int, rank: int, device: str | torch.device, generation: int, timeout_s: float
    ) -> None:
        host, _, port = address.rpartition(":")
        self.device = gpu.cuda_device(device)
        self._group = NcclGroup(host, int(port), rank, self.device, timeout_s)
        self._group.connect(generation, world_size)
        self._staging = [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in range(IN_FLIGHT_GROUPS)]

    @classmethod
    def from_init(cls, init: Mapping[str, Any], ctx: WorkerContext) -> NcclReceiver:
        """``init_info``: address, world_size, rank_offset (this replica's first rank), generation, timeout_s."""
        return cls(
            address=str(init_field(init, "address", Channel.NCCL)),
            world_size=int(init_field(init, "world_size", Channel.NCCL)),
            rank=int(init_field(init, "rank_offset", Channel.NCCL)) + ctx.rank,
            device=ctx.device,
            generation=int(init_field(init, "generation", Channel.NCCL)),
            timeout_s=float(init.get("timeout_s", 120.0)),
        )

    def _targets(
        self, specs: Sequence[TensorSpec], slot: int, destinations: Mapping[str, torch.Tensor]
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

    def receive(self, ticket: UpdateTicket, destinations: Mapping[str, torch.Tensor] | None = None) -> Iterator[Group]:
        self.verified = {}
        groups = ticket.table.groups()
        dests = destinations or {}

        def post(i: int) -> tuple[list[torch.Tensor], list[bool], Any, torch.Tensor | None, Any | None]:
            targets, direct = self._targets(groups[i], i % IN_FLIGHT_GROUPS, dests)
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
            if words is not None and dwork is not None:
                self._group.wait(dwork, ticket.timeout_s, f"group {i} digests")
                self.verified.update(verify_group(group, digests.from_words(specs, words.cpu())))
            staged = [pair for pair, d in zip(group, direct, strict=True) if not d]
            if staged:
                yield staged

    def close(self) -> None:
        self._group.abort()


SENDER = NcclSender
RECEIVER = NcclReceiver
