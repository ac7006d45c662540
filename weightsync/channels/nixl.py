"""The NIXL channel: the replica reads the trainer's registered buffers with one-sided NIXL READs.

Nothing is pushed. The trainer registers the memory that holds each version with its
NIXL agent and publishes where every tensor lies; each replica worker pulls the
layer groups it needs, straight into its destination views (rows of fused
qkv/gate_up included, see ``placement``) or into a bounded staging buffer whose views
are yielded to vLLM's loaders, and tells the trainer when it is done so the trainer
may overwrite. NIXL picks the transport (UCX: CUDA IPC/NVLink on one host, RDMA
between hosts).

Registration happens once per buffer, not per step. The trainer's tensor itself is
registered when it already is what travels (on the sender's device, in the table's
dtype, contiguous) and stays in the same memory from one version to the next (a
trainer's parameters). Otherwise the sender copies it into a buffer of its own for
that tensor, allocated and registered once: a cast (fp32 master weights to a bf16
wire), or a tensor that moved to new memory since the last version (gathered
shards), which from then on always goes through the sender's buffer. Destinations
and staging buffers are registered once on the replica's side too, and the READ
requests of a version are built once and re-posted while the layout stays the same.

Metadata is plain data, never pickled. The sender's offer (and so each receiver's
rendezvous) carries the trainer's TCPStore address, its agent's name and its NIXL
agent metadata (NIXL's own bytes; base64 in ``init_info``). Per version the store
holds JSON under ``v<version>/meta``, beneath the membership's secret prefix: the
version's table (checked against the coordinator's layout digest), the metadata
epoch, each tensor's ``[address, device]`` in the trainer's memory, and (with
verification) the per-tensor digests the trainer computed where the bytes lie. When the trainer's
registrations change, it bumps the epoch and publishes fresh agent metadata under
``md/<epoch>``; a receiver that sees a newer epoch loads it before reading. Each
receiver acknowledges a version under ``v<version>/done/<rank>``, which the
trainer awaits with ``release`` before it changes the tensors.

Every wait is bounded: the version's metadata, a fresh agent metadata, each READ
(polled against the ticket's deadline; a stalled one is released and raises
``TransferTimeoutError`` naming its group) and the trainer's wait for the acks.

The module imports without NIXL (the metadata helpers are plain Python); creating a
sender or a receiver needs the ``nixl`` package (PyPI ``nixl``, the CUDA 13 build
``nixl-cu13``).
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
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
from weightsync.channels.wire import TORCH_DTYPES, Group, dist, fits_in_place, wait_key
from weightsync.errors import PermanentError, RetryableError, TransferTimeoutError
from weightsync.tensors import TensorSpec, TensorTable, align
from weightsync.vocabulary import Channel

BACKENDS = ["UCX"]
DEFAULT_WINDOW = 8
"""Layer groups whose READs are in flight at once on a receiver (and staging slots it may hold).

Picked by measurement (bench/gpu_nixl.py, docs/benchmarks.md): windows of 2..30 groups of the Qwen3-1.7B
set all land within 20.8-23.1 ms on 2x H200; 8 was the fastest and keeps staging bounded.
"""
_SPIN_S = 0.002
_SLEEP_S = 0.0002

Location = tuple[int, int] | None
"""Where a tensor lies in the trainer's memory: (address, device id), or None for an empty tensor."""


# ----------------------------------------------------------------------------- plain metadata


def encode_metadata(md: bytes) -> str:
    """NIXL agent metadata (opaque bytes) as a JSON-safe string."""
    return base64.b64encode(md).decode("ascii")


def decode_metadata(text: Any, what: str) -> bytes:
    """The inverse of ``encode_metadata``; raise naming ``what`` when it is not base64 bytes."""
    if not isinstance(text, str) or not text:
        raise PermanentError(f"nixl channel: {what} must be a non-empty base64 string, got {type(text).__name__}")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise PermanentError(f"nixl channel: {what} is not base64 NIXL agent metadata: {e}") from None


MEMORY_ENV = "WEIGHTSYNC_NIXL_MEMORY"


def memory() -> str:
    """What NIXL may move: ``device`` (the default: weights on a GPU) or ``host`` (CPU engines and trainers too,
    their weights registered as DRAM: CPU fleets, and the tests)."""
    value = os.environ.get(MEMORY_ENV, "device")
    if value not in ("device", "host"):
        raise PermanentError(f"{MEMORY_ENV}={value!r}; use device (default) or host")
    return value


def mem_type(device: torch.device) -> str:
    """NIXL's memory kind for a device: VRAM for CUDA memory, DRAM for host memory."""
    return "VRAM" if device.type == "cuda" else "DRAM"


def device_id(device: torch.device) -> int:
    return int(device.index or 0) if device.type == "cuda" else 0


@dataclass(frozen=True)
class VersionMeta:
    """What the trainer publishes per version (JSON on the channel's store)."""

    version: int
    epoch: int
    mem: str
    locations: tuple[Location, ...]
    digests: Mapping[str, str]
    table: TensorTable

    def to_json(self) -> str:
        locs = [None if loc is None else [loc[0], loc[1]] for loc in self.locations]
        body = {"version": self.version, "epoch": self.epoch, "mem": self.mem, "locations": locs}
        layout = self.table.layout_digest()
        return json.dumps({**body, "digests": dict(self.digests), "layout_digest": layout}, separators=(",", ":"))

    @classmethod
    def parse(cls, raw: bytes | str, ticket: UpdateTicket, table_of: Callable[[str], TensorTable]) -> VersionMeta:
        """Validate the published metadata: its table (``table_of`` its layout digest: fetched once a layout and
        checked against the ticket) and its locations against the table."""
        version = ticket.version
        try:
            d = json.loads(raw)
            table = table_of(str(d["layout_digest"]))
            got_version, epoch, mem, locs = int(d["version"]), int(d["epoch"]), str(d["mem"]), d["locations"]
            found = {str(k): str(v) for k, v in dict(d.get("digests", {})).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise PermanentError(f"nixl channel: v{version} metadata is malformed ({e!r}): {raw!r:.200}") from None
        if got_version != version:
            raise PermanentError(f"nixl channel: metadata published for v{got_version}, the ticket asks for v{version}")
        if mem not in ("VRAM", "DRAM"):
            raise PermanentError(f"nixl channel: v{version} metadata names memory kind {mem!r}; expected VRAM or DRAM")
        if not isinstance(locs, list) or len(locs) != len(table):
            n = len(locs) if isinstance(locs, list) else type(locs).__name__
            raise PermanentError(f"nixl channel: v{version} metadata locates {n} tensors, the table has {len(table)}")
        locations: list[Location] = []
        for spec, loc in zip(table, locs, strict=True):
            if loc is None and spec.nbytes == 0:
                locations.append(None)
                continue
            if (
                not isinstance(loc, list)
                or len(loc) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in loc)
                or (spec.nbytes and loc[0] == 0)
            ):
                raise PermanentError(
                    f"tensor {spec.name!r}: v{version} metadata locates it at {loc!r}; "
                    f"expected [address, device] for its {spec.nbytes} bytes"
                )
            locations.append((loc[0], loc[1]))
        return cls(got_version, epoch, mem, tuple(locations), found, table)


def new_agent(name: str) -> Any:
    try:
        api: Any = importlib.import_module("nixl._api")
    except ImportError as e:
        raise PermanentError(
            f"nixl channel: the NIXL package is not importable here ({e}); install nixl (and nixl-cu13 for CUDA 13)"
        ) from None
    return api.nixl_agent(name, api.nixl_agent_config(backends=BACKENDS))


def poll(agent: Any, handle: Any, deadline: float) -> str:
    """A posted transfer's state once it is DONE or ERR, or its state when ``deadline`` (monotonic) passed: spins
    briefly, then sleeps between checks."""
    start = time.monotonic()
    while True:
        state = str(agent.check_xfer_state(handle))
        now = time.monotonic()
        if state in ("DONE", "ERR") or now > deadline:
            return state
        if now - start > _SPIN_S:
            time.sleep(_SLEEP_S)


def _device(device: str | int | torch.device) -> torch.device:
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    return dev if dev.type == "cpu" else gpu.cuda_device(dev)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Registry:
    """Storages registered with one agent, each once, kept alive while registered."""

    def __init__(self, agent: Any, device: torch.device) -> None:
        self._agent, self._device = agent, device
        self._regs: dict[tuple[int, int], tuple[torch.UntypedStorage, Any]] = {}

    @staticmethod
    def key(tensor: torch.Tensor) -> tuple[int, int]:
        s = tensor.untyped_storage()
        return (s.data_ptr(), s.nbytes())

    def ensure(self, tensor: torch.Tensor) -> bool:
        """Register ``tensor``'s whole storage unless it is already; True when it was new."""
        key = self.key(tensor)
        if key in self._regs or not key[1]:
            return False
        storage = tensor.untyped_storage()
        descs = self._agent.register_memory([(key[0], key[1], device_id(self._device), "")], mem_type(self._device))
        self._regs[key] = (storage, descs)
        return True

    def keep_only(self, live: set[tuple[int, int]]) -> bool:
        """Deregister every storage not in ``live``; True when any was."""
        dropped = [k for k in self._regs if k not in live]
        for k in dropped:
            self._agent.deregister_memory(self._regs.pop(k)[1])
        return bool(dropped)

    def __len__(self) -> int:
        return len(self._regs)

    def clear(self) -> None:
        self.keep_only(set())


# ----------------------------------------------------------------------------- trainer side


class NixlSender(Sender):
    """The trainer's side: registers what travels and publishes where it lies.

    Its offer carries the agent's name and metadata; ``send`` each version, then
    ``release`` before changing the tensors.
    """

    channel: ClassVar[Channel] = Channel.NIXL

    def __init__(
        self,
        device: str | torch.device = "cuda",
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 120.0,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.device = _device(device)
        self.timeout_s, self.window = timeout_s, window
        self.name = f"weightsync-trainer-{uuid.uuid4().hex[:12]}"
        self._agent = new_agent(self.name)
        self._base = wire.serve_store(host, port, timeout_s)
        self.host, self.port = host, int(self._base.port)
        self._store: Any = None
        self._membership: Rendezvous | None = None
        self._tables = wire.Tables()
        self._registry = Registry(self._agent, self.device)
        # name -> (the trainer's tensor, what travels for it, that memory's address then)
        self._located: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._owned: dict[str, torch.Tensor] = {}  # the sender's own buffer per tensor (casts, moved tensors)
        self._moved: set[str] = set()
        self.epoch = 0
        self._published = -1

    @classmethod
    def create(cls, config: SenderConfig) -> Self:
        return cls(device=config.device, host=config.host, timeout_s=config.timeout_s)

    def offer(self) -> Offer:
        return Offer(
            Channel.NIXL,
            Endpoint(self.host, self.port),
            agent=self.name,
            metadata=self._agent.get_agent_metadata(),
            epoch=self.epoch,
        )

    def take_plan(self, receivers: Mapping[str, Rendezvous]) -> None:
        """A new membership reads under a new prefix: the agent metadata is published there again."""
        wanted = next(iter(receivers.values()), None)
        if wanted is None or wanted.same_membership(self._membership):
            return
        self._membership = wanted
        self._store = dist.PrefixStore(wanted.prefix, self._base)
        self._published, self._tables = -1, wire.Tables()
        self._publish_metadata()

    @property
    def registrations(self) -> int:
        """How many storages are registered now (tests check registration happens once per buffer)."""
        return len(self._registry)

    def _publish_metadata(self) -> None:
        if self._published != self.epoch:
            self._store.set(f"md/{self.epoch}", encode_metadata(self._agent.get_agent_metadata()))
            self._published = self.epoch

    def _owned_buffer(self, spec: TensorSpec) -> torch.Tensor:
        buf = self._owned.get(spec.name)
        if buf is None:
            buf = self._owned[spec.name] = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device=self.device)
        return buf

    def _wire(self, spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
        """What travels for ``tensor``: itself when it can and it stayed in place, else the sender's buffer."""
        gpu.check_wire(spec, tensor)
        t = tensor.detach()
        as_is = t.device == self.device and t.dtype == TORCH_DTYPES[spec.dtype] and t.is_contiguous()
        if as_is and spec.name not in self._moved:
            last = self._located.get(spec.name)
            if last is None or last[2] == t.data_ptr():
                return t
            self._moved.add(spec.name)  # new memory every step: copy into one registered buffer from now on
        return self._owned_buffer(spec).copy_(t, non_blocking=True)

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> SendReport:
        if ticket.table is None or self._store is None:
            raise PermanentError("nixl channel: send needs a ticket with the table and a plan (take_plan) first")
        table = ticket.table
        found: dict[str, str] = {}
        located: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        changed = False
        for _, specs, tensors in wire.table_groups(table, groups):
            for spec, tensor in zip(specs, tensors, strict=True):
                buffer = self._wire(spec, tensor)
                if buffer.numel():
                    changed |= self._registry.ensure(buffer)
                located[spec.name] = (tensor, buffer, buffer.data_ptr())
        if ticket.verify:  # kernels for every tensor, one host sync for the version
            words = digests.words([located[s.name][1] for s in table], self.device)
            found = digests.from_words(table.tensors, words.cpu())
        _sync(self.device)  # a replica reads only finished bytes
        live = {Registry.key(w) for _, w, _ in located.values() if w.numel()}
        changed |= self._registry.keep_only(live)
        self._located = located
        if changed:
            self.epoch += 1
            self._publish_metadata()
        dev = device_id(self.device)
        locations = tuple((w.data_ptr(), dev) if w.numel() else None for _, w, _ in (located[s.name] for s in table))
        meta = VersionMeta(ticket.version, self.epoch, mem_type(self.device), locations, found, table)
        self._tables.publish(self._store, table)
        self._store.set(f"v{ticket.version}/meta", meta.to_json())
        return SendReport(found)

    def release(self, version: int, timeout_s: float) -> None:
        """Block until every planned receiving worker read ``version`` (before the trainer overwrites its tensors)."""
        if self._membership is not None:
            wire.await_consumed(self._store, version, self._membership.world_size, timeout_s, Channel.NIXL)

    def close(self) -> None:
        self._registry.clear()
        self._located, self._owned, self._moved = {}, {}, set()


# ----------------------------------------------------------------------------- replica side


@dataclass
class _GroupRead:
    """One layer group's READ, built once per layout and re-posted every version."""

    index: int
    what: str
    handle: Any  # the NIXL transfer request, or None when the group has no bytes
    group: Group  # every tensor: its destination when read in place, else its staging view
    staged: Group


@dataclass(frozen=True)
class _Prepared:
    tensors: tuple[TensorSpec, ...]
    locations: tuple[Location, ...]
    epoch: int
    dests: Mapping[str, torch.Tensor]
    window: int
    reads: list[_GroupRead]


class NixlReceiver(Receiver):
    """One receiving worker: pulls each layer group from the trainer's registered memory."""

    channel: ClassVar[Channel] = Channel.NIXL
    needs = ("endpoint", "group", "secret", "world_size", "rank", "agent", "metadata")

    def __init__(
        self, rendezvous: Rendezvous, rank: int, device: str | torch.device, window: int = DEFAULT_WINDOW
    ) -> None:
        if window < 1:
            raise PermanentError(f"nixl channel: window must be >= 1, got {window}")
        assert rendezvous.endpoint is not None
        self.device, self.receiver, self.window = _device(device), rank, window
        self.timeout_s = rendezvous.timeout_s
        self._agent = new_agent(f"weightsync-replica-{rank}-{uuid.uuid4().hex[:12]}")
        store = wire.join_store(rendezvous.endpoint, rendezvous.join_timeout_s, self.timeout_s, Channel.NIXL)
        self._store = dist.PrefixStore(rendezvous.prefix, store)
        self._remote = rendezvous.agent
        self._load_metadata(rendezvous.metadata, f"the rendezvous' agent metadata (agent {rendezvous.agent!r})")
        self._epoch = rendezvous.epoch
        self._registry = Registry(self._agent, self.device)
        self._staging: list[torch.Tensor] = []
        self._prepared: _Prepared | None = None
        self._tables = wire.Tables()

    @classmethod
    def from_rendezvous(cls, rendezvous: Rendezvous, ctx: WorkerContext) -> NixlReceiver:
        """A tensor-parallel replica's workers read as ranks ``rendezvous.rank + worker rank``."""
        return cls(rendezvous, rendezvous.rank + ctx.rank, ctx.device)

    def _load_metadata(self, metadata: bytes, what: str) -> None:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types; name what failed
            raise PermanentError(f"nixl channel: NIXL could not load {what}: {type(e).__name__}: {e}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != self._remote:
            raise PermanentError(f"nixl channel: {what} describes agent {name!r}, expected {self._remote!r}")

    def _prepare(self, meta: VersionMeta, dests: Mapping[str, torch.Tensor]) -> _Prepared:
        table = meta.table
        p = self._prepared
        if (
            p is not None
            and p.tensors == table.tensors
            and p.locations == meta.locations
            and p.epoch == meta.epoch
            and p.dests is dests
            and p.window == self.window
        ):
            return p
        self._release()
        groups = table.groups()
        direct = {s.name for s in table if s.nbytes and fits_in_place(s, self.device, dests.get(s.name))}
        slots = min(self.window, len(groups))
        need = [0] * slots
        for i, specs in enumerate(groups):
            size = sum(align(s.nbytes, 256) for s in specs if s.name not in direct)
            need[i % slots] = max(need[i % slots], size)
        staging = [
            self._staging[k]
            if k < len(self._staging) and self._staging[k].numel() >= n
            else torch.empty(n, dtype=torch.uint8, device=self.device)
            for k, n in enumerate(need)
        ]
        self._staging = staging
        live = {Registry.key(dests[n]) for n in direct} | {Registry.key(b) for b in staging if b.numel()}
        self._registry.keep_only(live)
        for n in direct:
            self._registry.ensure(dests[n])
        for b in staging:
            if b.numel():
                self._registry.ensure(b)
        kind, here = mem_type(self.device), device_id(self.device)
        index = {s.name: k for k, s in enumerate(table)}
        reads: list[_GroupRead] = []
        for i, specs in enumerate(groups):
            group: Group = []
            local: list[tuple[int, int, int]] = []
            remote: list[tuple[int, int, int]] = []
            offset = 0
            for spec in specs:
                if spec.name in direct:
                    target = dests[spec.name]
                else:
                    raw = staging[i % slots][offset : offset + spec.nbytes]
                    target = raw.view(TORCH_DTYPES[spec.dtype]).view(spec.shape)
                    offset += align(spec.nbytes, 256)
                group.append((spec, target))
                loc = meta.locations[index[spec.name]]
                if spec.nbytes and loc is not None:
                    local.append((target.data_ptr(), spec.nbytes, here))
                    remote.append((loc[0], spec.nbytes, loc[1]))
            what = f"group {i} read (starting at {specs[0].name!r})"
            handle = None
            if local:
                try:
                    handle = self._agent.initialize_xfer(
                        "READ",
                        self._agent.get_xfer_descs(local, kind),
                        self._agent.get_xfer_descs(remote, meta.mem),
                        self._remote,
                    )
                except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                    raise PermanentError(
                        f"nixl channel: {what}: NIXL refused the READ ({type(e).__name__}: {e}); "
                        "the trainer's published locations are not inside its registered memory"
                    ) from None
            staged = [(s, t) for s, t in group if s.name not in direct]
            reads.append(_GroupRead(i, what, handle, group, staged))
        self._prepared = _Prepared(table.tensors, meta.locations, meta.epoch, dests, self.window, reads)
        return self._prepared

    def _post(self, read: _GroupRead) -> None:
        if read.handle is not None and self._agent.transfer(read.handle) == "ERR":
            self._prepared = None
            raise RetryableError(f"nixl channel: {read.what}: NIXL could not post the READ (the trainer went away?)")

    def _wait(self, read: _GroupRead, deadline: float, timeout_s: float) -> None:
        if read.handle is None:
            return
        state = poll(self._agent, read.handle, deadline)
        if state == "DONE":
            return
        self._prepared = None
        if state == "ERR":
            raise RetryableError(f"nixl channel: {read.what} failed in NIXL (the trainer went away or its memory)")
        raise TransferTimeoutError(
            f"nixl channel: {read.what} did not complete within {timeout_s:.1f}s (the trainer died or stalled)"
        )

    def receive(self, ticket: UpdateTicket, place: Placement | None = None) -> Iterator[Group]:
        """Read the version into its destinations where they fit; yield the rest as staging views.

        ``place`` should return the same mapping for the same table, so the prepared READs are kept.
        """
        self.begin()
        # the sender publishes the metadata when it starts (at the latest at the join deadline): the transfer
        # timeout counts from then, not from this receiver's join
        first_wait_s = ticket.join_timeout_s + ticket.timeout_s
        what = f"v{ticket.version} metadata"
        raw = wait_key(self._store, f"v{ticket.version}/meta", first_wait_s, what, Channel.NIXL)
        deadline = time.monotonic() + ticket.timeout_s
        meta = VersionMeta.parse(
            raw, ticket, lambda digest: self._tables.fetch(self._store, ticket, ticket.timeout_s, Channel.NIXL, digest)
        )
        table = self.table = meta.table
        if meta.epoch != self._epoch:
            left = max(deadline - time.monotonic(), 0.001)
            md = wait_key(self._store, f"md/{meta.epoch}", left, f"agent metadata epoch {meta.epoch}", Channel.NIXL)
            self._load_metadata(decode_metadata(md.decode(), f"md/{meta.epoch}"), f"agent metadata epoch {meta.epoch}")
            self._epoch = meta.epoch
        if ticket.verify and meta.digests.keys() != {s.name for s in table}:
            missing = sorted({s.name for s in table} - meta.digests.keys())
            raise PermanentError(f"nixl channel: v{ticket.version} asks for verification, no digest for {missing[:3]}")
        dests = place(table) if place is not None else {}
        prepared = self._prepare(meta, dests)
        self.in_place = {s.name for s in table if s.nbytes and fits_in_place(s, self.device, dests.get(s.name))}
        reads = prepared.reads
        expected = digests.to_words([meta.digests[s.name] for s in table], self.device) if ticket.verify else None
        for read in reads[: self.window]:
            self._post(read)
        start = 0
        for i, read in enumerate(reads):
            self._wait(read, deadline, ticket.timeout_s)
            if expected is not None:
                if read.staged:  # the loader gets only verified bytes: compare now
                    self.check(read.group, meta.digests)
                else:
                    self.check_later(read.group, expected[start : start + len(read.group)])
            start += len(read.group)
            if read.staged:
                yield read.staged
            if i + self.window < len(reads):
                self._post(reads[i + self.window])
        self.checks_done()
        _sync(self.device)
        done = f"v{ticket.version}/done/{self.receiver}"
        wire.set_key(self._store, done, "1", ticket.timeout_s, f"the ack of v{ticket.version}", Channel.NIXL)

    def _release(self) -> None:
        if self._prepared is not None:
            for read in self._prepared.reads:
                if read.handle is not None:
                    read.handle.release()
            self._prepared = None

    def close(self) -> None:
        try:
            self._release()
        finally:
            self._registry.clear()
            self._staging = []


SENDER = NixlSender
RECEIVER = NixlReceiver
