"""The CPU stream: packed buckets broadcast over a torch.distributed gloo group.

For CPU engines (the embedded default and the tests). The sender is rank 0 of a
group whose other members are the replicas' workers; it copies whole layer groups
into a bucket (tensors at their table offsets, so the receiver can view them in
place), broadcasts it, and packs the next bucket into a second buffer while the
first is in flight. Receivers post the next bucket's broadcast before handing the
current one to the engine, so loading overlaps the wire. With verification on, each
bucket is followed by a small broadcast of its tensors' digests, checked before the
engine sees a byte.

Why gloo over shared memory: the same code reaches a replica on another host, and
the benchmark (bench/cpu_channels.py) shows the stream within a small factor of a raw
flat gloo broadcast on one host; shared memory would only win on one host.

Groups come from the plan: one per replica (a gloo collective fails for every member
when one dies, so a dead replica breaks only its own group), each a membership with its
own generation and secret (``Rendezvous``). ``take_plan`` forms the groups the sender
lacks in the background while the replicas' agents join them, and drops the ones no
longer planned. Both ends bind gloo to an address of their own host: the sender to the
one it offered, a receiver to its local address on the route to the sender.

Every wait has a timeout, and a fault stays with the replica it happened to:

- joining (the store, the group's formation) is bounded by the plan's join deadline
  (``Rendezvous.join_timeout_s``); the sender streams to the groups formed by then and
  ``ready`` names the others, which take the version from the volume on their own;
- a receiver's first wait (the header) lasts the join deadline plus the transfer timeout,
  so the transfer timeout counts from the moment the sender starts, not from its join;
- a peer that dies mid-broadcast makes the other side raise ``TransferTimeoutError`` (or
  gloo's own connection error) at once; the group is then unusable and is rebuilt with
  the next plan;
- a peer that stops reading without closing its connection (a frozen process, a host
  whose network went away) gives no error at all, so the sender waits on every group's
  broadcast at once and drops a group that falls behind the others by more than the join
  deadline (the transfer timeout applies only when no group took a step). The moment a
  group is dropped, ``Sender.lose`` tells the publisher, which tells the coordinator: that
  replica moves to the volume before its own receive timeout. A dropped group is released
  on a thread of its own: gloo's destructor waits out every send still queued to the
  frozen peer.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Self

import torch

from weightsync.channels import digests, wire
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
from weightsync.channels.wire import Group, as_bytes, check_tensor, dist, view_from_bytes
from weightsync.errors import IntegrityError, PermanentError, TransferTimeoutError
from weightsync.tensors import TensorSpec, TensorTable, align
from weightsync.vocabulary import Channel

DEFAULT_BUCKET_BYTES = 64 << 20
HEADER_BUCKET_BYTES = "bucket_bytes"
"""The header's field naming the bucket size the sender used, so both ends plan the same buckets."""
MAX_HEADER_BYTES = 64 << 20
_POLL_S = 0.001


def plan_buckets(table: TensorTable, bucket_bytes: int) -> list[list[tuple[TensorSpec, ...]]]:
    """Whole layer groups per bucket, at most ``bucket_bytes`` each unless one group alone is larger.

    Both ends compute the same plan from the table and the bucket size agreed at init,
    so bucket boundaries never travel.
    """
    buckets: list[list[tuple[TensorSpec, ...]]] = [[]]
    start = 0
    for group in table.groups():
        if buckets[-1] and align(group[-1].end) - start > bucket_bytes:
            buckets.append([])
        if not buckets[-1]:
            start = group[0].offset
        buckets[-1].append(group)
    return [b for b in buckets if b]


def _span(bucket: list[tuple[TensorSpec, ...]]) -> tuple[int, int]:
    return bucket[0][0].offset, align(bucket[-1][-1].end)


class GlooGroup:
    """One membership's gloo process group, on the sender's store under the membership's secret prefix."""

    def __init__(self, store: Any, bind: str, rendezvous: Rendezvous, rank: int) -> None:
        if rendezvous.world_size < 2:
            raise PermanentError(
                f"cpu channel: world_size must be >= 2 (sender and receivers), got {rendezvous.world_size}"
            )
        self.store, self.bind, self.rdv, self.rank = store, bind, rendezvous, rank
        self.timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        self.pg: Any = None
        self._posted: list[Any] = []

    def connect(self) -> None:
        """Rendezvous with every member: bounded by the join deadline, after which the sender has gone on without
        a member that was not there (gloo's own wait ends at the same deadline, so no formation outlives it)."""
        join_s = self.rdv.join_timeout_s
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=join_s)  # the formation's; each broadcast carries its own
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind)]
        store = dist.PrefixStore(self.rdv.prefix, self.store)
        try:
            self.pg = wire.bounded(
                lambda: dist.ProcessGroupGloo(store, self.rank, self.rdv.world_size, opts),
                join_s,
                f"forming group {self.rdv.group!r}",
                Channel.CPU,
            )
        except RuntimeError as e:
            raise TransferTimeoutError(
                f"cpu channel: group {self.rdv.group!r} of {self.rdv.world_size} at {self.rdv.endpoint} did not form "
                f"within the join deadline of {join_s:g}s: {e}"
            ) from e

    def broadcast(self, tensor: torch.Tensor, timeout_s: float | None = None) -> Any:
        """Post one broadcast from rank 0, failing after ``timeout_s`` (default: the transfer timeout)."""
        if self.pg is None:
            raise PermanentError("cpu channel: the group is not connected")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else self.timeout
        work = self.pg.broadcast([tensor], opts)
        self._posted = [w for w in self._posted if not w.is_completed()] + [work]
        return work

    def wait(self, work: Any, what: str) -> None:
        try:
            work.wait()  # bounded by the broadcast's own timeout; wait(timeout) returns early on gloo
        except RuntimeError as e:
            self.pg = None
            raise TransferTimeoutError(
                f"cpu channel: {what} failed or exceeded its timeout ({e}); the group is broken and must be rebuilt"
            ) from e

    def close(self) -> None:
        """Let go of the group without waiting for it: gloo's destructor blocks (holding the GIL, so every thread
        of the process stops) until each send still queued to the peer ended, a frozen one's after gloo's timeout.
        The group is kept on a thread of its own until they did."""
        pg, self.pg = self.pg, None
        posted, self._posted = self._posted, []
        if pg is not None:
            wire.let_go(pg, posted, f"weightsync-cpu-release-{self.rdv.group}")
            del pg


def member(rendezvous: Rendezvous, rank: int) -> GlooGroup:
    """Group rank ``rank``'s side of ``rendezvous`` (a receiver, a trainer rank of a region group), not formed yet
    (``connect``): on the store at its endpoint, bound to this host's address on the route there."""
    if rendezvous.endpoint is None:
        raise PermanentError(f"cpu channel: the rendezvous of group {rendezvous.group!r} names no endpoint")
    store = wire.join_store(rendezvous.endpoint, rendezvous.join_timeout_s, rendezvous.timeout_s, Channel.CPU)
    return GlooGroup(store, wire.local_address_for(rendezvous.endpoint), rendezvous, rank)


class CpuSender(Sender):
    """Rank 0 of one group per planned replica; see the module docstring."""

    channel: ClassVar[Channel] = Channel.CPU

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 120.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        self.host, self.timeout_s, self.bucket_bytes = host, timeout_s, bucket_bytes
        self._store = wire.serve_store(host, port, timeout_s)
        self.port = int(self._store.port)
        self.groups: dict[str, GlooGroup] = {}
        """Formed groups by replica id."""
        self._forming: dict[str, tuple[threading.Thread, GlooGroup]] = {}
        self._members: dict[str, Rendezvous] = {}
        self.failed: dict[str, str] = {}
        """Receivers lost during this version's ``send`` (replica id -> why)."""
        self._buffers: list[torch.Tensor] = []

    @classmethod
    def create(cls, config: SenderConfig) -> Self:
        return cls(host=config.host, timeout_s=config.timeout_s)

    def offer(self) -> Offer:
        return Offer(Channel.CPU, Endpoint(self.host, self.port))

    def take_plan(self, receivers: Mapping[str, Rendezvous]) -> None:
        """Keep the groups whose membership is unchanged, drop the rest, form the missing ones in the background
        (each bounded by its rendezvous' join deadline)."""
        self.failed = {}
        for rid in list(self.groups):
            if self._members.get(rid) != receivers.get(rid):
                self._drop(rid, "")
        for rid, rdv in receivers.items():
            if rid in self.groups or rid in self._forming:
                continue
            group = GlooGroup(wire.own_connection(self._store), self.host, rdv.with_timeout(self.timeout_s), 0)
            # a daemon: a trainer that exits must not wait out the formation of a group whose receiver never came
            thread = threading.Thread(target=self._form, args=(group,), name=f"weightsync-cpu-{rdv.group}", daemon=True)
            self._members[rid] = rdv
            self._forming[rid] = (thread, group)
            thread.start()

    @staticmethod
    def _form(group: GlooGroup) -> None:
        with contextlib.suppress(TransferTimeoutError):  # ``_settle`` tells it: the group has no process group
            group.connect()

    def _settle(self, timeout_s: float | None, members: Collection[str] | None) -> dict[str, str]:
        """Wait up to ``timeout_s`` (default: each group's join deadline) for the groups of ``members`` (default:
        every planned receiver) to form; give up on the others. Returns the receivers left out and why."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        left_out: dict[str, str] = {}
        for rid in list(self.groups):
            if members is not None and rid not in members:
                self._drop(rid, "")
                left_out[rid] = "cpu channel: no longer planned on this channel (the coordinator moved it)"
        for rid, (thread, group) in list(self._forming.items()):
            if members is None or rid in members:
                wait = group.rdv.join_timeout_s + wire.GRACE_S if deadline is None else deadline - time.monotonic()
                thread.join(max(0.0, wait))
            del self._forming[rid]
            if group.pg is not None and not thread.is_alive():
                self.groups[rid] = group
                continue
            self._members.pop(rid, None)
            if thread.is_alive():
                wire.end_when_done(thread, group.close)  # a member that joins late must not leave a group behind
            if members is not None and rid not in members:
                left_out[rid] = "cpu channel: no longer planned on this channel (the coordinator moved it)"
            else:
                left_out[rid] = (
                    f"cpu channel: group {group.rdv.group!r} did not form within the join deadline of "
                    f"{group.rdv.join_timeout_s:g}s (the replica did not join in time)"
                )
        return left_out

    def ready(self, timeout_s: float, members: Collection[str] | None = None) -> dict[str, str]:
        left_out = self._settle(timeout_s, members)
        if not self.groups:
            raise NoReceiver("cpu channel: no receiver joined within the join deadline", left_out)
        return left_out

    def _all(self, what: str, post: Any) -> dict[str, Any]:
        """Post ``post(group)`` on every live group; a group that fails is dropped, not fatal."""
        works = {}
        for rid, group in list(self.groups.items()):
            try:
                works[rid] = post(group)
            except (RuntimeError, TransferTimeoutError) as e:
                self._drop(rid, f"{what}: {e}")
        return works

    def _wait(self, works: dict[str, Any], what: str) -> None:
        """Every group's ``works`` at once. A group that falls behind the others by more than its join deadline
        is dropped (a frozen or partitioned replica stops reading without an error); when none has taken them, the
        transfer timeout applies to all (the trainer itself, or the network, may be slow)."""
        deadline = time.monotonic() + self.timeout_s
        first_done: float | None = None
        pending = {rid: work for rid, work in works.items() if rid in self.groups}
        while pending:
            for rid, work in list(pending.items()):
                if work.is_completed():
                    del pending[rid]
                    first_done = first_done or time.monotonic()
                    try:
                        self.groups[rid].wait(work, what)  # done: raises if gloo failed it
                    except TransferTimeoutError as e:
                        self._drop(rid, str(e))
            now = time.monotonic()
            for rid in list(pending):
                slack = self.groups[rid].rdv.join_timeout_s
                if first_done is not None and now - first_done > slack:
                    why = f"{what} still not taken {slack:g}s (the join deadline) after the others took it"
                elif now > deadline:
                    why = f"{what} not taken within the transfer timeout of {self.timeout_s:g}s"
                else:
                    continue
                del pending[rid]
                self._drop(rid, f"cpu channel: {why} (the replica stopped reading)")
            if pending:
                time.sleep(_POLL_S)
        if not self.groups:
            raise TransferTimeoutError(f"cpu channel: every group failed ({'; '.join(self.failed.values())})")

    def _drop(self, rid: str, why: str) -> None:
        if why:
            self.lose(rid, why)
        self._members.pop(rid, None)
        group = self.groups.pop(rid, None)
        if group is not None:
            group.close()

    def lose(self, replica_id: str, why: str) -> None:
        self.failed[replica_id] = why
        super().lose(replica_id, why)

    def _buffer(self, i: int, size: int) -> torch.Tensor:
        while len(self._buffers) <= i:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[i].numel() < size:
            self._buffers[i] = torch.empty(size, dtype=torch.uint8)
        return self._buffers[i][:size]

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> SendReport:
        table = _table(ticket)
        for rid, why in self._settle(None, None).items():
            self.lose(rid, why)
        if not self.groups:
            raise TransferTimeoutError(
                "cpu channel: no receiver joined"
                + (f" ({'; '.join(self.failed.values())})" if self.failed else "; call take_plan() first")
            )
        bucket_bytes = ticket.bucket_bytes or self.bucket_bytes
        self._send_header(ticket, table, bucket_bytes)
        found: dict[str, str] = {}
        source = wire.table_groups(table, groups)
        in_flight: list[tuple[dict[str, Any], str]] = []
        for i, bucket in enumerate(plan_buckets(table, bucket_bytes)):
            base, end = _span(bucket)
            buf = self._buffer(i % 2, end - base)
            # the buffer we are about to overwrite was sent two buckets ago: make sure it left
            while len(in_flight) > 1:
                self._wait(*in_flight.pop(0))
            bucket_digests: list[str] = []
            for specs in bucket:
                _, _, tensors = next(source)
                for spec, tensor in zip(specs, tensors, strict=True):
                    check_tensor(spec, tensor)
                    dst = buf[spec.offset - base : spec.offset - base + spec.nbytes]
                    dst.copy_(as_bytes(tensor.detach().cpu()))
                    if ticket.verify:
                        d = digests.digest(dst)
                        found[spec.name] = d
                        bucket_digests.append(d)
            label = f"bucket {i} broadcast"
            in_flight.append((self._all(label, lambda g, b=buf: g.broadcast(b)), label))
            if ticket.verify:
                # digests travel on their own small broadcast; wait for it so the tensor stays alive
                words = digests.to_words(bucket_digests)
                self._wait(self._all(f"bucket {i} digests", lambda g, w=words: g.broadcast(w)), f"bucket {i} digests")
        for works, label in in_flight:
            self._wait(works, label)
        next(source, None)  # the check for groups beyond the table's
        return SendReport(found, dict(self.failed))

    def _send_header(self, ticket: UpdateTicket, table: TensorTable, bucket_bytes: int) -> None:
        """The version, the whole table and the bucket size go first, so receivers need only a version to start."""
        header = json.dumps(
            {"version": ticket.version, "table": table.to_dict(), HEADER_BUCKET_BYTES: bucket_bytes}
        ).encode()
        size = torch.tensor([len(header)], dtype=torch.int64)
        raw = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self._wait(self._all("header size", lambda g: g.broadcast(size)), "header size")
        self._wait(self._all("header", lambda g: g.broadcast(raw)), "header")

    def close(self) -> None:
        self._settle(None, None)
        for rid in list(self.groups):
            self._drop(rid, "")


def _table(ticket: UpdateTicket) -> TensorTable:
    if ticket.table is None:
        raise PermanentError(f"{ticket.channel.value} channel: the sender's ticket for v{ticket.version} has no table")
    return ticket.table


class CpuReceiver(Receiver):
    """One replica worker's member of its group (rank >= 1)."""

    channel: ClassVar[Channel] = Channel.CPU
    needs = ("endpoint", "group", "secret", "generation", "world_size", "rank")

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        self._group = member(rendezvous, rank)
        self._group.connect()

    @classmethod
    def from_rendezvous(cls, rendezvous: Rendezvous, ctx: WorkerContext) -> CpuReceiver:
        return cls(rendezvous, rendezvous.rank + ctx.rank)

    def _receive_header(self, ticket: UpdateTicket) -> tuple[TensorTable, int]:
        size = torch.zeros(1, dtype=torch.int64)
        # the sender starts once every receiver joined or the join deadline passed: the transfer timeout counts
        # from then, not from this receiver's join
        self._group.wait(self._group.broadcast(size, ticket.join_timeout_s + ticket.timeout_s), "header size")
        if not 0 < int(size) <= MAX_HEADER_BYTES:
            raise IntegrityError(f"cpu channel: header of {int(size)} bytes is outside (0, {MAX_HEADER_BYTES}]")
        raw = torch.empty(int(size), dtype=torch.uint8)
        self._group.wait(self._group.broadcast(raw), "header")
        header = json.loads(raw.numpy().tobytes())
        if int(header["version"]) != ticket.version:
            got = header["version"]
            raise IntegrityError(f"cpu channel: the sender streams version {got}, expected {ticket.version}")
        table = ticket.resolve_table(TensorTable.from_dict(header["table"]), "cpu channel")
        return table, int(header[HEADER_BUCKET_BYTES])

    def receive(self, ticket: UpdateTicket, place: Placement | None = None) -> Iterator[Group]:
        self.begin()
        table, bucket_bytes = self._receive_header(ticket)
        self.table = table
        buckets = plan_buckets(table, bucket_bytes)
        buffers = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]

        def post(i: int) -> tuple[torch.Tensor, Any, torch.Tensor | None, Any | None]:
            base, end = _span(buckets[i])
            if buffers[i % 2].numel() < end - base:
                buffers[i % 2] = torch.empty(end - base, dtype=torch.uint8)
            buf = buffers[i % 2][: end - base]
            work = self._group.broadcast(buf)
            if not ticket.verify:
                return buf, work, None, None
            # collectives are matched by posting order on every rank, so the digests follow the bucket
            words = torch.empty(sum(len(g) for g in buckets[i]), dtype=torch.int64)
            return buf, work, words, self._group.broadcast(words)

        pending = post(0) if buckets else None
        for i, bucket in enumerate(buckets):
            assert pending is not None
            buf, work, words, dwork = pending
            self._group.wait(work, f"bucket {i} broadcast")
            expected: dict[str, str] = {}
            if words is not None and dwork is not None:
                self._group.wait(dwork, f"bucket {i} digests")
                expected = digests.from_words([s for g in bucket for s in g], words)
            pending = post(i + 1) if i + 1 < len(buckets) else None
            base, _ = _span(bucket)
            for specs in bucket:
                group: Group = [(s, view_from_bytes(buf, s, base)) for s in specs]
                if ticket.verify:
                    self.check(group, expected)
                yield group

    def close(self) -> None:
        self._group.close()


SENDER = CpuSender
RECEIVER = CpuReceiver
