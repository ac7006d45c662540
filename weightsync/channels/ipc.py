"""The CUDA IPC channel: a replica on the trainer's GPU copies straight from the trainer's memory.

No wire at all: the trainer exports CUDA IPC handles of the storages that hold the
tensors of a version, and the replica maps them once and copies each tensor into its
own parameter (rows of fused qkv/gate_up included, see ``placement``) or hands a
zero-copy view to vLLM's loaders when it cannot be written in place.

Handles are exported once per buffer, not per step. The sender keeps each exported
storage alive and reuses its export while the trainer hands the same storage again
(a trainer's parameters, or the sender's own cast buffer); the receiver keeps each
mapping open until a version no longer refers to it. A trainer that hands new
storages every step (gathered shards) costs one export per new storage.

Handles, tensor locations and the version's table travel as explicit metadata, JSON
on the channel's TCPStore under the membership's secret prefix (hex handles, integer
offsets; nothing pickled): ``send`` publishes a version's metadata when the trainer's GPU
has finished writing, ``receive`` waits for it (bounded by the ticket's timeout), checks
the table against the coordinator's layout digest, and acknowledges when its copies are
done, which the trainer awaits with ``release`` before it overwrites its tensors. Like
the table, the tensors' locations are published only when they change (an epoch the
version's metadata names): in the steady state a version's metadata is a few bytes and
the sender checks the whole version's tensors at once, not one by one (0.7 ms of the
sender's time for Qwen3-1.7B's 310 tensors). The ack leaves on a thread of its own: the
replica's copies are done and it need not wait for the trainer's store to answer.

The copies of a version into the engine's parameters are prepared once per layout as one
batched copy kernel (``batched.copies``): hundreds of small copies cost one launch (the
calibration showed per-tensor launches, not bytes, make 310 copies 1.5x one flat copy; a
CUDA graph of them, used before, still cost 1.36x).
"""

from __future__ import annotations

import json
import logging
import operator
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Self

import torch

from weightsync.channels import batched, digests, gpu, wire
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
from weightsync.channels.wire import TORCH_DTYPES, Group, dist, wait_key
from weightsync.errors import PermanentError
from weightsync.tensors import TensorSpec, TensorTable
from weightsync.vocabulary import Channel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Export:
    """A CUDA storage shared over IPC, as plain data (torch's ``_share_cuda_`` fields)."""

    device: int
    handle: str
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str
    event_sync_required: bool
    uuid: str = ""
    """The GPU the storage lives on (``gpu.uuid``): a process that maps it on another GPU reads it peer-to-peer."""

    @classmethod
    def of(cls, storage: torch.UntypedStorage) -> Export:
        dev, handle, size, offset, ref_handle, ref_offset, event, sync = storage._share_cuda_()  # type: ignore[no-untyped-call]
        return cls(
            int(dev),
            bytes(handle).hex(),
            int(size),
            int(offset),
            bytes(ref_handle).hex(),
            int(ref_offset),
            bytes(event or b"").hex(),
            bool(sync),
            gpu.uuid(storage.device),
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Export:
        try:
            return cls(
                int(d["device"]),
                str(d["handle"]),
                int(d["size_bytes"]),
                int(d["offset_bytes"]),
                str(d["ref_counter_handle"]),
                int(d["ref_counter_offset"]),
                str(d["event_handle"]),
                bool(d["event_sync_required"]),
                str(d.get("uuid", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PermanentError(f"ipc channel: malformed buffer export {dict(d)!r}: {e}") from None

    def open(self, on: int | None = None) -> torch.Tensor:
        """Map the storage in this process, as a flat uint8 tensor: on the device it lives on (by the exporter's
        index), or into device ``on``'s address space, which then reads it peer-to-peer (NVLink or PCIe P2P, as
        its own memory: kernels and copy engines alike), though the tensor says ``cuda:<on>``."""
        device = self.device if on is None else on
        storage = torch.UntypedStorage._new_shared_cuda(
            device,
            bytes.fromhex(self.handle),
            self.size_bytes,
            self.offset_bytes,
            bytes.fromhex(self.ref_counter_handle),
            self.ref_counter_offset,
            bytes.fromhex(self.event_handle),
            self.event_sync_required,
        )
        return torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)


class Exports:
    """The storages one process shares, each exported once (``buf/<id>`` on ``store``, JSON) and kept alive while
    shared: the sender's half of the export cache, used by this channel and by the sharded path's co-located
    region links (``ipc_regions``)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        # storage (data_ptr, nbytes) -> (storage kept alive, its export id)
        self._exports: dict[tuple[int, int], tuple[torch.UntypedStorage, int]] = {}
        self._next_id = 0

    def id_of(self, tensor: torch.Tensor) -> int:
        """The id of the export of ``tensor``'s storage, exporting it (once) when new."""
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        cached = self._exports.get(key)
        if cached is None:
            cached = (storage, self._next_id)
            self._store.set(f"buf/{self._next_id}", json.dumps(Export.of(storage).to_dict()))
            self._exports[key] = cached
            self._next_id += 1
        return cached[1]

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Drop (and unpublish) every export no tensor of ``tensors`` lives in."""
        live = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
        for key in [k for k in self._exports if k not in live]:
            self._store.delete_key(f"buf/{self._exports.pop(key)[1]}")

    @property
    def exported(self) -> int:
        """Exports made so far (one per new storage)."""
        return self._next_id


class Mappings:
    """The other side: another process's exports mapped in this one, each once, kept open while used."""

    def __init__(self, store: Any, channel: Channel = Channel.IPC) -> None:
        self._store, self._channel = store, channel
        self._mapped: dict[int, torch.Tensor] = {}
        self._gpus: dict[int, str] = {}

    def map(
        self, used: Iterable[int], timeout_s: float, whose: str = "", on: int | None = None
    ) -> Mapping[int, torch.Tensor]:
        """Export id -> the storage as a flat uint8 tensor, for the ids in ``used``: new ones mapped (waiting up to
        ``timeout_s`` for their handles; into device ``on``'s address space, ``Export.open``), ones no longer used
        closed."""
        wanted = set(used)
        for buf in sorted(wanted - self._mapped.keys()):
            raw = wait_key(self._store, f"buf/{buf}", timeout_s, f"{whose}buffer {buf}'s handle", self._channel)
            export = Export.from_dict(json.loads(raw))
            self._mapped[buf], self._gpus[buf] = export.open(on), export.uuid
        self._mapped = {k: v for k, v in self._mapped.items() if k in wanted}
        self._gpus = {k: v for k, v in self._gpus.items() if k in wanted}
        return self._mapped

    def gpu(self, buf: int) -> str:
        """The UUID of the GPU mapped export ``buf`` lives on."""
        return self._gpus[buf]

    def clear(self) -> None:
        self._mapped, self._gpus = {}, {}


class _Shared(NamedTuple):
    """What the sender shares for one of the trainer's tensors."""

    tensor: torch.Tensor
    """The trainer's tensor."""
    wire: torch.Tensor
    """What replicas read: the trainer's tensor's own memory, or the sender's buffer for it (a cast, a copy)."""
    location: list[int] | None
    """[export id, byte offset] (None for an empty tensor)."""
    address: int
    """The trainer's tensor's address when it was shared: while it still holds that memory, the export stands."""
    buffered: bool
    """``wire`` is the sender's buffer, refreshed from the tensor every version."""


class IpcSender(Sender):
    """The trainer's side: offers its store and the GPU its buffers live on."""

    channel: ClassVar[Channel] = Channel.IPC

    def __init__(
        self, device: str | torch.device = "cuda", host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0
    ) -> None:
        self.device = gpu.cuda_device(device)
        self.timeout_s = timeout_s
        self._base = wire.serve_store(host, port, timeout_s)
        self.host, self.port = host, int(self._base.port)
        self._store: Any = None
        self._membership: Rendezvous | None = None
        self._tables = wire.Tables()
        self._located: dict[str, _Shared] = {}  # in table order, kept alive until replaced
        self._layout = ""
        self._addresses: list[int] = []  # the trainer's tensors' addresses when last shared
        self._refresh: list[_Shared] = []  # the sender's buffers, refreshed every version in one call
        self._epoch = 0  # of the published locations, one more each time they change
        self._cast: dict[str, torch.Tensor] = {}
        self._exports = Exports(None)

    @classmethod
    def create(cls, config: SenderConfig) -> Self:
        return cls(device=config.device, host=config.host, timeout_s=config.timeout_s)

    def offer(self) -> Offer:
        return Offer(Channel.IPC, Endpoint(self.host, self.port), devices=(gpu.uuid(self.device),))

    def take_plan(self, receivers: Mapping[str, Rendezvous]) -> None:
        """A new membership publishes under a new prefix: its exports are published there again."""
        wanted = next(iter(receivers.values()), None)
        if wanted is None or wanted.same_membership(self._membership):
            return
        self._membership = wanted
        self._store = dist.PrefixStore(wanted.prefix, self._base)
        self._located, self._exports, self._tables = {}, Exports(self._store), wire.Tables()
        self._layout, self._addresses, self._refresh = "", [], []

    def _wire(self, spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
        """The trainer's tensor itself when it can be shared as is, else the sender's own buffer for it.

        The buffer (a cast to the wire dtype, a contiguous copy) is allocated once per
        name, so it is exported once too.
        """
        gpu.check_wire(spec, tensor)
        t = tensor.detach()
        if t.device == self.device and t.dtype == TORCH_DTYPES[spec.dtype] and t.is_contiguous():
            return t
        buf = self._cast.get(spec.name)
        if buf is None:
            buf = self._cast[spec.name] = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device=self.device)
        return buf.copy_(t, non_blocking=True)

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> SendReport:
        if ticket.table is None or self._store is None:
            raise PermanentError("ipc channel: send needs a ticket with the table and a plan (take_plan) first")
        table = ticket.table
        tensors = [t for _, _, group in wire.table_groups(table, groups) for t in group]
        if not self._steady(table, tensors):
            self._share(table, tensors)
        elif self._refresh:
            refresh = self._refresh
            torch._foreach_copy_([s.wire for s in refresh], [s.tensor.detach() for s in refresh], non_blocking=True)
        found: dict[str, str] = {}
        if ticket.verify:  # kernels for every tensor, one host sync for the version
            words = digests.words([s.wire for s in self._located.values()], self.device)
            found = digests.from_words(table.tensors, words.cpu())
        torch.cuda.current_stream(self.device).synchronize()  # the replica reads only finished bytes
        layout = self._tables.publish(self._store, table)
        meta = {"version": ticket.version, "layout_digest": layout, "locations_epoch": self._epoch, "digests": found}
        self._store.set(f"v{ticket.version}/meta", json.dumps(meta, separators=(",", ":")))
        return SendReport(found)

    def _steady(self, table: TensorTable, tensors: list[torch.Tensor]) -> bool:
        """The same layout, the same tensors in the same memory as last version: every export and location stands.

        Checked for the whole version at once (a few C-level passes): per tensor in Python it was most of the
        sender's time."""
        return (
            table.layout_digest() == self._layout
            and len(tensors) == len(self._addresses)
            and all(map(operator.is_, tensors, (s.tensor for s in self._located.values())))
            and [t.data_ptr() for t in tensors] == self._addresses
        )

    def _share(self, table: TensorTable, tensors: list[torch.Tensor]) -> None:
        """Share each tensor (reusing what still stands), drop exports no tensor uses, publish the new locations."""
        located: dict[str, _Shared] = {}
        for spec, tensor in zip(table, tensors, strict=True):
            last = self._located.get(spec.name)
            if last is not None and last.tensor is tensor and tensor.data_ptr() == last.address:
                located[spec.name] = last
                if last.buffered:
                    last.wire.copy_(tensor, non_blocking=True)
                continue
            wire = self._wire(spec, tensor)
            offset = int(wire.storage_offset()) * wire.element_size()
            loc = [self._exports.id_of(wire), offset] if wire.numel() else None
            located[spec.name] = _Shared(tensor, wire, loc, tensor.data_ptr(), wire.data_ptr() != tensor.data_ptr())
        self._exports.keep(s.wire for s in located.values())
        self._located, self._layout = located, table.layout_digest()
        self._addresses = [t.data_ptr() for t in tensors]
        self._refresh = [s for s in located.values() if s.buffered]
        self._epoch += 1
        self._store.set(f"locations/{self._epoch}", json.dumps([s.location for s in located.values()]))
        # a receiver reads the epoch its version's metadata names before it acks, and the trainer sends the next
        # version after every ack (``release``) or its timeout: two epochs back is read by no live receiver
        self._store.delete_key(f"locations/{self._epoch - 2}")

    def release(self, version: int, timeout_s: float) -> None:
        """Block until every planned receiving worker copied ``version`` (before the trainer overwrites its tensors)."""
        if self._membership is not None:
            wire.await_consumed(self._store, version, self._membership.world_size, timeout_s, Channel.IPC)

    def close(self) -> None:
        self._located, self._exports, self._cast = {}, Exports(None), {}


@dataclass(frozen=True)
class _Prepared:
    """What a receiver reuses across versions while the layout stays the same."""

    tensors: tuple[TensorSpec, ...]
    locations_epoch: int
    dests: Mapping[str, torch.Tensor]
    groups: list[Group]  # every tensor: its destination when copied there, else its view of the trainer's memory
    staged: list[Group]  # the tensors handed to the loader
    direct: frozenset[str]  # the tensors copied into their destinations
    copy: Callable[[], None] | None


class IpcReceiver(Receiver):
    """A colocated replica worker: maps the trainer's buffers once and copies from them."""

    channel: ClassVar[Channel] = Channel.IPC
    needs = ("endpoint", "group", "secret", "world_size", "rank")

    def __init__(self, rendezvous: Rendezvous, rank: int, device: str | torch.device) -> None:
        assert rendezvous.endpoint is not None
        self.rank, self.device = rank, gpu.cuda_device(device)
        base = wire.join_store(rendezvous.endpoint, rendezvous.join_timeout_s, rendezvous.timeout_s, Channel.IPC)
        self._store = dist.PrefixStore(rendezvous.prefix, base)
        self._mappings = Mappings(self._store)
        self._prepared: _Prepared | None = None
        self._tables = wire.Tables()

    @classmethod
    def from_rendezvous(cls, rendezvous: Rendezvous, ctx: WorkerContext) -> IpcReceiver:
        return cls(rendezvous, rendezvous.rank + ctx.rank, ctx.device)

    def _views(self, ticket: UpdateTicket, table: TensorTable, meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Each tensor of the version as a view of the trainer's memory, mapping new buffers once."""
        epoch = meta["locations_epoch"]
        if not isinstance(epoch, int):
            raise PermanentError(f"ipc channel: v{ticket.version} metadata names locations epoch {epoch!r}")
        what = f"the locations of v{ticket.version}'s tensors (epoch {epoch})"
        locations = json.loads(wait_key(self._store, f"locations/{epoch}", ticket.timeout_s, what, Channel.IPC))
        if not isinstance(locations, list) or len(locations) != len(table):
            got = f"{len(locations)} tensors" if isinstance(locations, list) else repr(locations)[:80]
            raise PermanentError(f"ipc channel: v{ticket.version}'s locations give {got}, the table has {len(table)}")
        mapped = self._mappings.map({loc[0] for loc in locations if loc is not None}, ticket.timeout_s)
        views: dict[str, torch.Tensor] = {}
        for spec, loc in zip(table, locations, strict=True):
            dtype = TORCH_DTYPES[spec.dtype]
            if loc is None:
                views[spec.name] = torch.empty(spec.shape, dtype=dtype, device=self.device)
                continue
            buf, offset = loc
            views[spec.name] = mapped[buf][offset : offset + spec.nbytes].view(dtype).view(spec.shape)
        return views

    def _prepare(
        self, ticket: UpdateTicket, table: TensorTable, meta: Mapping[str, Any], dests: Mapping[str, torch.Tensor]
    ) -> _Prepared:
        """The version's groups and its direct copies, as one batched copy.

        Reused as long as the table, the trainer's buffers and the destinations are the
        same as last time (the steady state): a version then costs one launch, not
        hundreds of Python-level views and copies.
        """
        p = self._prepared
        if p and p.tensors == table.tensors and p.locations_epoch == meta["locations_epoch"] and p.dests is dests:
            return p
        views = self._views(ticket, table, meta)
        direct = {
            s.name
            for s in table
            if (d := dests.get(s.name)) is not None
            and s.nbytes
            and d.dtype == views[s.name].dtype
            and d.shape == views[s.name].shape
            and d.device == self.device
        }
        pairs = [(dests[s.name], views[s.name]) for s in table if s.name in direct]
        copy = batched.copies([d for d, _ in pairs], [v for _, v in pairs]) if pairs else None
        groups = [[(s, dests[s.name] if s.name in direct else views[s.name]) for s in g] for g in table.groups()]
        staged = [[(s, t) for s, t in g if s.name not in direct] for g in groups]
        self._prepared = _Prepared(
            table.tensors, meta["locations_epoch"], dests, groups, staged, frozenset(direct), copy
        )
        return self._prepared

    def receive(self, ticket: UpdateTicket, place: Placement | None = None) -> Iterator[Group]:
        """Copy the version into its destinations (one launch); yield the rest as views of the trainer's memory.

        ``place`` should return the same mapping for the same table, so the recorded copies are kept.
        """
        self.begin()
        key = f"v{ticket.version}/meta"
        # published when the sender starts (at the latest at the join deadline): the transfer timeout counts from then
        first_wait_s = ticket.join_timeout_s + ticket.timeout_s
        meta = json.loads(wait_key(self._store, key, first_wait_s, f"v{ticket.version} handles", Channel.IPC))
        table = self.table = self._tables.fetch(
            self._store, ticket, ticket.timeout_s, Channel.IPC, str(meta["layout_digest"])
        )
        prepared = self._prepare(ticket, table, meta, place(table) if place is not None else {})
        self.in_place = set(prepared.direct)
        if prepared.copy is not None:
            prepared.copy()
        expected = digests.to_words([meta["digests"][s.name] for s in table], self.device) if ticket.verify else None
        start = 0
        for group, staged in zip(prepared.groups, prepared.staged, strict=True):
            if expected is not None:
                if staged:  # the loader gets only verified bytes: compare now
                    self.check(group, meta["digests"])
                else:
                    self.check_later(group, expected[start : start + len(group)])
            start += len(group)
            if staged:
                yield staged
        self.checks_done()
        torch.cuda.current_stream(self.device).synchronize()
        threading.Thread(target=self._ack, args=(ticket,), name="weightsync-ipc-ack", daemon=True).start()

    def _ack(self, ticket: UpdateTicket) -> None:
        """Tell the trainer this worker's copies of the version are done. On a daemon thread of its own: a store
        that does not answer (a partitioned trainer) holds this thread, not the replica, and the trainer's
        ``release`` names the missing ack."""
        try:
            self._store.set(f"v{ticket.version}/done/{self.rank}", "1")
        except RuntimeError as e:
            log.warning("ipc channel: the ack of v%d did not reach the trainer: %s", ticket.version, e)

    def close(self) -> None:
        self._mappings.clear()
        self._prepared = None


SENDER = IpcSender
RECEIVER = IpcReceiver
