"""What every torch-based channel shares: dtypes on the wire, byte views, rendezvous stores, group checks.

The contract (``base``) imports no torch, so the coordinator can speak it; the code
that moves tensors lives here and in the channel modules.

A channel's rendezvous store listens on exactly one address: the one its sender
offered (the pod's IP, or 127.0.0.1 for a local run), never every interface. torch's
``TCPStore`` binds all interfaces by itself, so the sender binds the socket and hands
the store its descriptor. A process joining a peer's group binds its own side of the
group to the local address that reaches that peer (``local_address_for``), not to a
name that resolves to the peer's address.

Every blocking rendezvous operation is bounded by a deadline of our own (``bounded``; a
member's polls of a peer's store through ``BoundedStore``): torch's store client honours its
timeout only while the peer answers; on a partitioned network, after a wait times out it
blocks on the socket until TCP gives up (minutes), and inside a vLLM worker that would hang
every later call, the volume load that should replace the failed version included.
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed

from weightsync.channels.base import Endpoint, UpdateTicket
from weightsync.errors import IntegrityError, PermanentError, TransferTimeoutError
from weightsync.tensors import TensorSpec, TensorTable
from weightsync.vocabulary import Channel

# The process-group and store classes the channels use (TCPStore, PrefixStore, the gloo and
# NCCL backends) are public in practice but missing from torch's type stubs; one Any-typed
# handle keeps every channel module strictly checked otherwise.
dist: Any = torch.distributed

TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES: Mapping[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

Group = list[tuple[TensorSpec, torch.Tensor]]
T = TypeVar("T")
GRACE_S = 5.0
"""How much longer than its own timeout a store operation may take before it is abandoned."""
_POLL_S = 0.02


def bounded(fn: Callable[[], T], timeout_s: float, what: str, channel: Channel) -> T:
    """``fn()``, or ``TransferTimeoutError`` once ``timeout_s`` (plus a grace) passed.

    ``fn`` runs on a daemon thread; when it does not return in time the thread is abandoned
    (it is stuck on a dead peer's socket and ends when TCP gives up), and the caller's
    connection must be rebuilt: the channel's receiver is started again for the next version.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name=f"weightsync-{channel.value}-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s + GRACE_S)
    if thread.is_alive():
        raise TransferTimeoutError(
            f"{channel.value} channel: {what} did not complete within {timeout_s:.1f}s "
            "(the peer is unreachable); the connection is abandoned and must be rebuilt"
        )
    if error:
        raise error[0]
    return result[0]


class BoundedStore:
    """A peer's store whose every operation ends within ``timeout_s`` (``bounded``), for the keys a member polls
    while it waits (a group's roster, the sender's verdicts).

    torch's client does not end an operation its peer never answers (a route refused or dropped after the
    connection was made: the request sits in the socket, the reply never comes, until TCP gives up minutes later),
    so a member polling the store would stay inside that call, and inside its vLLM worker's update, long after the
    sender left it out. One operation that overran leaves its thread holding the client; every later one fails at
    once with the same error, and the member rebuilds its connection with its next receiver.
    """

    def __init__(self, store: Any, timeout_s: float, what: str, channel: Channel) -> None:
        self.store, self.timeout_s, self.what, self.channel = store, timeout_s, what, channel
        self._broken: TransferTimeoutError | None = None

    def _call(self, fn: Callable[[], T], op: str) -> T:
        if self._broken is not None:
            raise self._broken
        try:
            return bounded(fn, self.timeout_s, f"{self.what}: {op} on the sender's store", self.channel)
        except TransferTimeoutError as e:
            self._broken = e
            raise

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(lambda: self.store.check(keys), f"checking {keys}"))

    def get(self, key: str) -> bytes:
        return bytes(self._call(lambda: self.store.get(key), f"reading {key!r}"))

    def set(self, key: str, value: str) -> None:
        self._call(lambda: self.store.set(key, value), f"setting {key!r}")

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        """torch's ``Store.wait`` (``RuntimeError`` when ``keys`` are not all set within ``timeout``), polled: a key
        that comes late is waited for as long as ``timeout``, a sender that does not answer only ``timeout_s``."""
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Wait timeout: {keys} not set within {timeout.total_seconds():g}s")
            time.sleep(_POLL_S)


def serve_store(host: str, port: int, timeout_s: float) -> Any:
    """A channel's own rendezvous store, listening on ``host`` only (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            None,
            True,
            datetime.timedelta(seconds=timeout_s),
            False,
            False,
            sock.detach(),
        )
    except OSError as e:
        sock.close()
        raise PermanentError(
            f"cannot listen on {host}:{port} for the channel's rendezvous ({e}); "
            "offer an address of this host (the pod's IP, or 127.0.0.1 for a local run)"
        ) from e
    return store


def own_connection(store: Any) -> Any:
    """Another client of a store this process serves, for one group to form on.

    A TCPStore client holds its one socket (and lock) for the whole of a blocking wait, so
    groups forming concurrently on one client would queue behind the one whose member never
    comes, for its full timeout; each forming group gets its own connection instead.
    """
    return dist.TCPStore(store.host, store.port, None, False, store.timeout, False)


def join_store(endpoint: Endpoint, join_timeout_s: float, timeout_s: float, channel: Channel) -> Any:
    """A client of a peer's rendezvous store, connected within ``join_timeout_s`` (the plan's join deadline) or
    ``TransferTimeoutError``; its later waits default to ``timeout_s``.

    Bounded by our own deadline too (``bounded``): torch's client retries a connection with growing delays that
    can overrun its timeout by tens of seconds (seen: a retry delay of 37 s on a 90 s timeout), and inside a vLLM
    worker that holds ``init_weight_transfer_engine`` and every call after it."""

    def connect() -> Any:
        try:
            store = dist.TCPStore(
                endpoint.host, endpoint.port, None, False, datetime.timedelta(seconds=join_timeout_s), False
            )
        except (RuntimeError, OSError) as e:
            raise TransferTimeoutError(
                f"{channel.value} channel: rendezvous store at {endpoint} unreachable within the join deadline of "
                f"{join_timeout_s:g}s: {e}"
            ) from e
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        return store

    return bounded(connect, join_timeout_s, f"connecting to the rendezvous store at {endpoint}", channel)


def local_address_for(peer: Endpoint) -> str:
    """The address of this host on the route to ``peer`` (no packet is sent)."""
    infos = socket.getaddrinfo(peer.host, peer.port, type=socket.SOCK_DGRAM)
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def wait_key(store: Any, key: str, timeout_s: float, what: str, channel: Channel) -> bytes:
    """A store key's value, or ``TransferTimeoutError`` naming what did not arrive (bounded even when partitioned)."""

    def get() -> bytes:
        try:
            store.wait([key], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise TransferTimeoutError(
                f"{channel.value} channel: {what} did not arrive within {timeout_s:.1f}s: {e}"
            ) from e
        return bytes(store.get(key))

    return bounded(get, timeout_s, what, channel)


def set_key(store: Any, key: str, value: str, timeout_s: float, what: str, channel: Channel) -> None:
    """Set a key on a peer's store, bounded like ``wait_key``."""
    bounded(lambda: store.set(key, value), timeout_s, what, channel)


def await_consumed(store: Any, version: int, world_size: int, timeout_s: float, channel: Channel) -> None:
    """Wait until every receiving rank (1..world_size-1) acked ``version`` on a one-sided channel's store, then
    drop that version's keys (the store keeps one version's keys, not every version's)."""
    ranks = range(1, world_size)
    for r in ranks:
        wait_key(store, f"v{version}/done/{r}", timeout_s, f"receiver {r}'s ack of v{version}", channel)
    for key in [f"v{version}/meta", *(f"v{version}/done/{r}" for r in ranks)]:
        store.delete_key(key)


class Tables:
    """Version tables on a channel's store, published once per layout and fetched once per layout.

    Tables change rarely (another model, another layout) while versions come every step, so a
    table lives under its layout digest (``table/<digest>``): the sender writes it the first
    time it sends that layout to a membership, and a receiver whose ticket names a layout it
    already fetched (and checked against that digest) waits for nothing before it posts its
    receives. Serialising 300 tensor specs per version cost about a millisecond on each end.
    """

    def __init__(self) -> None:
        self._published: set[str] = set()
        self._known: dict[str, TensorTable] = {}

    def publish(self, store: Any, table: TensorTable) -> str:
        digest = table.layout_digest()
        if digest not in self._published:
            store.set(f"table/{digest}", json.dumps(table.to_dict()))
            self._published.add(digest)
        return digest

    def fetch(
        self, store: Any, ticket: UpdateTicket, timeout_s: float, channel: Channel, digest: str = ""
    ) -> TensorTable:
        """The table of layout ``digest`` (default: the ticket's), checked against the ticket; fetched once a layout."""
        where = f"{channel.value} channel"
        digest = digest or ticket.layout_digest
        if not digest:
            if ticket.table is None:
                raise PermanentError(f"{where}: v{ticket.version}'s ticket names neither a table nor a layout digest")
            return ticket.table
        if ticket.layout_digest and digest != ticket.layout_digest:
            raise IntegrityError(
                f"{where}: v{ticket.version} is sent with layout {digest}, the coordinator recorded "
                f"{ticket.layout_digest}; the sender and the coordinator disagree on the version"
            )
        table = self._known.get(digest)
        if table is None:
            raw = wait_key(store, f"table/{digest}", timeout_s, f"the table of layout {digest[:19]}...", channel)
            table = TensorTable.from_dict(json.loads(raw))
            if table.layout_digest() != digest:
                raise IntegrityError(f"{where}: the table stored under {digest} has layout {table.layout_digest()}")
            self._known[digest] = table
        return ticket.resolve_table(table, where) if ticket.table is not None else table


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise PermanentError(f"dtype {dtype} cannot travel; supported: {', '.join(TORCH_DTYPES)}") from None


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def view_from_bytes(buffer: torch.Tensor, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    """The tensor ``spec`` viewed in place inside ``buffer`` (which starts at stream offset ``base``)."""
    start = spec.offset - base
    raw = buffer[start : start + spec.nbytes]
    return raw.view(TORCH_DTYPES[spec.dtype]).reshape(spec.shape)


def fits_in_place(spec: TensorSpec, device: torch.device, view: torch.Tensor | None) -> bool:
    """True when ``spec``'s bytes can be received straight into ``view`` (a destination parameter)."""
    return (
        view is not None
        and view.device == device
        and view.dtype == TORCH_DTYPES[spec.dtype]
        and tuple(view.shape) == spec.shape
        and view.is_contiguous()
    )


def table_groups(
    table: TensorTable, groups: Iterable[Sequence[torch.Tensor]]
) -> Iterator[tuple[int, tuple[TensorSpec, ...], Sequence[torch.Tensor]]]:
    """(index, specs, the trainer's tensors) of each of ``table``'s groups, as the trainer yields them (a sender
    streams a group while the next is gathered); refuses a group that does not match the table's, and more
    groups than it lists."""
    source = iter(groups)
    for i, specs in enumerate(table.groups()):
        tensors = next(source, None)
        if tensors is None or len(tensors) != len(specs):
            got = "nothing" if tensors is None else f"{len(tensors)} tensors"
            raise PermanentError(f"group {i} (starting at {specs[0].name!r}): got {got}, expected {len(specs)}")
        yield i, specs, tensors
    if next(source, None) is not None:
        raise PermanentError("the trainer yielded more groups than the table lists")


def check_tensor(spec: TensorSpec, tensor: torch.Tensor) -> None:
    """Raise naming the tensor when the sender's tensor does not match its spec."""
    if tuple(tensor.shape) != spec.shape or tensor.dtype != TORCH_DTYPES[spec.dtype]:
        raise PermanentError(
            f"tensor {spec.name!r}: got dtype {dtype_name(tensor.dtype)} shape {list(tensor.shape)}, "
            f"the table says dtype {spec.dtype} shape {list(spec.shape)}"
        )


def verify_group(group: Group, expected: Mapping[str, str]) -> dict[str, str]:
    """Digest each received tensor and compare with the trainer's; raise naming the first mismatch."""
    from weightsync.channels import digests

    got: dict[str, str] = {}
    for spec, tensor in group:
        digest = digests.digest(tensor)
        want = expected.get(spec.name) or spec.digest
        if want and digest != want:
            raise IntegrityError(
                f"tensor {spec.name!r}: received digest {digest}, the trainer sent {want}; "
                "the bytes were altered in transit, the update is refused"
            )
        got[spec.name] = digest
    return got


def let_go(pg: Any, posted: list[Any], name: str) -> None:
    """Drop a gloo process group without waiting for it: gloo's destructor blocks (holding the GIL, so every thread
    of the process stops) until each send still queued to a peer ended, a frozen peer's only at the operation's
    timeout. The group is kept on a thread of its own until the ``posted`` works it still has completed."""
    pending = [w for w in posted if not w.is_completed()]

    def release() -> None:
        nonlocal pg
        while not all(w.is_completed() for w in pending):
            time.sleep(0.05)
        pg = None  # the last reference: nothing is queued, so gloo's destructor returns at once

    threading.Thread(target=release, name=name, daemon=True).start()


def end_when_done(forming: threading.Thread, end: Callable[[], None]) -> None:
    """Call ``end`` (abort a group) once a formation thread the sender gave up on returns: a member that joins
    late must not leave a formed group behind, and the thread cannot be interrupted while it waits."""

    def reap() -> None:
        forming.join()
        end()

    threading.Thread(target=reap, name=f"{forming.name}-reaper", daemon=True).start()
