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

Every wait has a timeout: a peer that dies mid-broadcast makes the other side raise
``TransferTimeoutError`` (or gloo's own connection error) instead of hanging; the
group is then unusable and must be rebuilt with the new member list.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch

from weightsync.channels import digests
from weightsync.channels.base import (
    Group,
    Receiver,
    Sender,
    UpdateTicket,
    WorkerContext,
    as_bytes,
    check_tensor,
    dist,
    init_field,
    tcp_store,
    verify_group,
    view_from_bytes,
)
from weightsync.errors import IntegrityError, PermanentError, TransferTimeoutError
from weightsync.tensors import TensorSpec, TensorTable, align
from weightsync.vocabulary import Channel

DEFAULT_BUCKET_BYTES = 64 << 20
MAX_HEADER_BYTES = 64 << 20


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


class _Group:
    """A gloo process group on a prefix of a TCPStore, so it never touches the global default group.

    The sender's store lives as long as the sender: each membership is a new group
    under its own prefix, so the sender offers one address for its lifetime.
    """

    def __init__(self, store: Any, host: str, world_size: int, rank: int, timeout_s: float, group_id: str) -> None:
        if world_size < 2:
            raise PermanentError(f"cpu channel: world_size must be >= 2 (sender and receivers), got {world_size}")
        if not 0 <= rank < world_size:
            raise PermanentError(f"cpu channel: rank {rank} is outside world_size {world_size}")
        self.store, self.host, self.world_size, self.rank, self.group_id = store, host, world_size, rank, group_id
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.pg: dist.ProcessGroupGloo | None = None

    def connect(self) -> None:
        """Rendezvous with every member (blocks until all have joined or the timeout passes)."""
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self.timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        store = dist.PrefixStore(f"weightsync/cpu/{self.group_id}/", self.store)
        try:
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        except RuntimeError as e:
            raise TransferTimeoutError(
                f"cpu channel: group {self.group_id!r} of {self.world_size} at {self.host} did not form "
                f"within {self.timeout.total_seconds():.0f}s: {e}"
            ) from e

    def broadcast(self, tensor: torch.Tensor) -> Any:
        if self.pg is None:
            raise PermanentError("cpu channel: connect() was not called")
        return self.pg.broadcast(tensor, 0)

    def wait(self, work: Any, what: str) -> None:
        try:
            work.wait()  # bounded by the group timeout; wait(timeout) returns early on gloo
        except RuntimeError as e:
            self.pg = None
            raise TransferTimeoutError(
                f"cpu channel: {what} failed or exceeded {self.timeout.total_seconds():.0f}s ({e}); "
                "the group is broken and must be rebuilt"
            ) from e

    def close(self) -> None:
        self.pg = None


class CpuSender(Sender):
    """Rank 0 of one or more groups. Create it, hand ``address`` to the receivers, then ``connect()``.

    Each ``connect(world_size, group_id)`` forms one more group under the same store; a
    version is broadcast to every connected group. A group whose member dies mid-stream
    is dropped (named in ``failed``) and the others go on: with one group per replica, a
    replica that dies never costs another replica its version.
    """

    channel: ClassVar[Channel] = Channel.CPU

    def __init__(
        self,
        world_size: int = 2,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 120.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.host, self.world_size, self.timeout_s, self.bucket_bytes = host, world_size, timeout_s, bucket_bytes
        self._store = tcp_store(host, port, True, timeout_s)
        self.port = int(self._store.port)
        self.groups: dict[str, _Group] = {}
        self.failed: dict[str, str] = {}
        self._buffers: list[torch.Tensor] = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def connect(self, world_size: int | None = None, group_id: str = "") -> None:
        """Form a group of ``world_size`` members (default: the constructor's) named ``group_id``."""
        group = _Group(self._store, self.host, world_size or self.world_size, 0, self.timeout_s, group_id)
        group.connect()
        self.groups[group_id] = group

    def retain(self, group_ids: Iterable[str]) -> None:
        """Forget the groups whose membership is gone."""
        keep = set(group_ids)
        for gid in [g for g in self.groups if g not in keep]:
            self.groups.pop(gid).close()

    def _all(self, what: str, post: Any) -> dict[str, Any]:
        """Post ``post(group)`` on every live group; a group that fails is dropped, not fatal."""
        works = {}
        for gid, group in list(self.groups.items()):
            try:
                works[gid] = post(group)
            except (RuntimeError, TransferTimeoutError) as e:
                self._drop(gid, f"{what}: {e}")
        return works

    def _wait(self, works: dict[str, Any], what: str) -> None:
        for gid, work in works.items():
            group = self.groups.get(gid)
            if group is None:
                continue
            try:
                group.wait(work, what)
            except TransferTimeoutError as e:
                self._drop(gid, str(e))
        if not self.groups:
            raise TransferTimeoutError(f"cpu channel: every group failed ({'; '.join(self.failed.values())})")

    def _drop(self, gid: str, why: str) -> None:
        self.failed[gid] = why
        group = self.groups.pop(gid, None)
        if group is not None:
            group.close()

    def _buffer(self, i: int, size: int) -> torch.Tensor:
        while len(self._buffers) <= i:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[i].numel() < size:
            self._buffers[i] = torch.empty(size, dtype=torch.uint8)
        return self._buffers[i][:size]

    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> dict[str, str]:
        if not self.groups:
            raise PermanentError("cpu channel: no group is connected; call connect() first")
        self.failed = {}
        bucket_bytes = int(ticket.params.get("bucket_bytes", self.bucket_bytes))
        self._send_header(ticket)
        found: dict[str, str] = {}
        source = iter(groups)
        in_flight: list[tuple[dict[str, Any], str]] = []
        for i, bucket in enumerate(plan_buckets(ticket.table, bucket_bytes)):
            base, end = _span(bucket)
            buf = self._buffer(i % 2, end - base)
            # the buffer we are about to overwrite was sent two buckets ago: make sure it left
            while len(in_flight) > 1:
                self._wait(*in_flight.pop(0))
            bucket_digests: list[str] = []
            for specs in bucket:
                tensors = next(source)
                if len(tensors) != len(specs):
                    raise PermanentError(
                        f"group starting at {specs[0].name!r}: {len(tensors)} tensors, expected {len(specs)}"
                    )
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
        if next(source, None) is not None:
            raise PermanentError("the trainer yielded more groups than the table lists")
        return found

    def _send_header(self, ticket: UpdateTicket) -> None:
        """The version number and the whole table go first, so receivers need only a version to start."""
        header = json.dumps({"version": ticket.version, "table": ticket.table.to_dict()}).encode()
        size = torch.tensor([len(header)], dtype=torch.int64)
        raw = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self._wait(self._all("header size", lambda g: g.broadcast(size)), "header size")
        self._wait(self._all("header", lambda g: g.broadcast(raw)), "header")

    def close(self) -> None:
        self.retain(())


class CpuReceiver(Receiver):
    """One replica worker's member of the group (rank >= 1)."""

    channel: ClassVar[Channel] = Channel.CPU

    def __init__(
        self,
        address: str,
        world_size: int,
        rank: int,
        timeout_s: float = 120.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        group_id: str = "",
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.verified = {}
        host, _, port = address.rpartition(":")
        store = tcp_store(host, int(port), False, timeout_s)
        self._group = _Group(store, host, world_size, rank, timeout_s, group_id)
        self._group.connect()

    @classmethod
    def from_init(cls, init: Mapping[str, Any], ctx: WorkerContext) -> CpuReceiver:
        """``init_info``: address (the sender's host:port), world_size, rank_offset (this
        replica's first rank in the group), group_id, timeout_s, bucket_bytes."""
        return cls(
            address=str(init_field(init, "address", Channel.CPU)),
            world_size=int(init_field(init, "world_size", Channel.CPU)),
            rank=int(init_field(init, "rank_offset", Channel.CPU)) + ctx.rank,
            timeout_s=float(init.get("timeout_s", 120.0)),
            bucket_bytes=int(init.get("bucket_bytes", DEFAULT_BUCKET_BYTES)),
            group_id=str(init.get("group_id", "")),
        )

    def _receive_header(self, ticket: UpdateTicket) -> TensorTable:
        size = torch.zeros(1, dtype=torch.int64)
        self._group.wait(self._group.broadcast(size), "header size")
        if not 0 < int(size) <= MAX_HEADER_BYTES:
            raise IntegrityError(f"cpu channel: header of {int(size)} bytes is outside (0, {MAX_HEADER_BYTES}]")
        raw = torch.empty(int(size), dtype=torch.uint8)
        self._group.wait(self._group.broadcast(raw), "header")
        header = json.loads(raw.numpy().tobytes())
        if int(header["version"]) != ticket.version:
            got = header["version"]
            raise IntegrityError(f"cpu channel: the sender streams version {got}, expected {ticket.version}")
        table = TensorTable.from_dict(header["table"])
        if len(ticket.table):
            table.check_matches(ticket.table)
            if table != ticket.table:
                raise IntegrityError("cpu channel: the sender's tensor offsets differ from the ticket's table")
        return table

    def receive(self, ticket: UpdateTicket, destinations: Mapping[str, torch.Tensor] | None = None) -> Iterator[Group]:
        self.verified = {}
        bucket_bytes = int(ticket.params.get("bucket_bytes", self.bucket_bytes))
        self.table = self._receive_header(ticket)
        buckets = plan_buckets(self.table, bucket_bytes)
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
                    self.verified.update(verify_group(group, expected))
                yield group

    def close(self) -> None:
        self._group.close()


SENDER = CpuSender
RECEIVER = CpuReceiver
