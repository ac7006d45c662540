"""The channel contract: what a sender offers, what a receiver needs to start, one sequence for every channel.

The publisher and the agent drive channels only through this module, so a new
channel is one module (its sender and receiver) plus its registration in
``weightsync.channels``. Nothing here imports torch: the coordinator speaks the
contract (offers in, rendezvous out) without moving a tensor.

A sender, on the trainer's sending rank::

    sender = channels.sender_class(channel).create(SenderConfig(host=pod_ip, device="cuda:0"))
    sender.on_lost = report_at_once          # (replica, why): a receiver lost mid-version, told as it happens
    coordinator.register(offers=[sender.offer()])      # where its rendezvous listens, devices, NIXL metadata
    for each version:
        sender.take_plan(receivers)      # this version's receivers on this channel (replica -> Rendezvous):
                                         # forms or rebuilds groups when membership or generation changes,
                                         # each join bounded by the rendezvous' join deadline
        left_out = sender.ready(join_deadline_left, members)   # the receivers that did not join in time
        report = sender.send(ticket, groups)   # one gather, group by group; names receivers it lost
        sender.release(ticket.version, timeout_s)   # one-sided channels: until every receiver consumed it
    sender.close()

A receiver, in each engine worker, starts from the plan's typed ``Rendezvous``::

    receiver = channels.receiver_class(channel).start(rendezvous, WorkerContext(rank, world_size, device))
    for group in receiver.receive(ticket, place):   # verified groups; ``receiver.table`` is the full table
        load(group)

Every receiver knows the version's full tensor table before it posts a receive: from
the ticket or carried by the channel itself (the stream's header, the volume's
manifest, a store key of the GPU channels), and always checked against the layout
digest the coordinator recorded, so it never receives against an empty or a
different table.

Plain data crosses every process boundary: ``Rendezvous.to_dict`` is what vLLM's
``init_info`` carries, ``UpdateTicket.to_update_info`` its ``update_info``; both are
JSON and validate themselves when parsed back.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

from weightsync.errors import IntegrityError, PermanentError, TransferTimeoutError
from weightsync.jobconfig import DEFAULT_JOIN_TIMEOUT_S
from weightsync.tensors import TensorSpec, TensorTable
from weightsync.vocabulary import Channel

if TYPE_CHECKING:
    import torch

    from weightsync.channels.wire import Group

Placement = Callable[[TensorTable], Mapping[str, "torch.Tensor"]]
"""Given a version's table, views of the engine's own parameters to receive tensors into (by trainer name)."""


@dataclass(frozen=True)
class Endpoint:
    """Where a rendezvous listens: one address of the sender's host (the pod's IP), never a wildcard."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host or any(c.isspace() for c in self.host) or self.host in ("0.0.0.0", "::"):
            raise PermanentError(
                f"endpoint host {self.host!r} is not one address of this host; offer the pod's IP or 127.0.0.1"
            )
        if not 0 < self.port < 65536:
            raise PermanentError(f"endpoint port {self.port} is outside 1-65535")

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            raise PermanentError(f"endpoint {text!r} is not HOST:PORT")
        return cls(host.strip("[]"), int(port))


@dataclass(frozen=True)
class Offer:
    """What a sender offers for its channel, sent to the coordinator when the publisher registers.

    The coordinator negotiates only channels the publisher offered, and copies into each
    receiver's ``Rendezvous`` what that receiver needs from it.
    """

    channel: Channel
    endpoint: Endpoint | None = None
    """Where the sender's rendezvous store listens (every channel but the volume)."""
    devices: tuple[str, ...] = ()
    """GPU UUIDs the sender's buffers live on (a colocated IPC replica's GPUs must be among them)."""
    agent: str = ""
    """NIXL: the sender's agent name."""
    metadata: bytes = b""
    """NIXL: the sender's agent metadata (NIXL's own bytes)."""
    epoch: int = 0
    """NIXL: the metadata's epoch (bumped when the sender's registrations change)."""


@dataclass(frozen=True)
class Rendezvous:
    """What one replica's receiver needs to start on its planned channel: the plan's typed payload.

    Which fields a channel needs is its receiver's ``needs``; ``require`` checks them where
    the rendezvous enters a process. ``group``/``secret``/``generation`` name one membership
    of a group channel: the group's keys live under a store prefix that includes
    ``secret``, which only the planned members learn (from the coordinator, over its
    authenticated connection), so a process that reaches the store but was not planned
    cannot join the group or set its keys.
    """

    channel: Channel
    endpoint: Endpoint | None = None
    group: str = ""
    """The group's public name (logs, errors): changes whenever its membership does."""
    secret: str = ""
    """Hex; part of the group's store prefix. Never logged."""
    generation: int = 0
    """The membership's generation (monotonic per job): a new one means rebuild."""
    rank: int = 0
    """This replica's first rank among the channel's participants (the sender is rank 0)."""
    world_size: int = 0
    """Participants of the group: the sender plus every receiving worker."""
    agent: str = ""
    metadata: bytes = b""
    epoch: int = 0
    root: str = ""
    """Volume: the volume's root as this replica mounts it."""
    timeout_s: float = 120.0
    """How long a started transfer may stall (set by the receiving side: its update timeout)."""
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    """How long joining may take (the store, the group's formation): the sender goes on without a receiver that has
    not joined by then. The job's join deadline (``JobConfig.join_timeout_s``), from the plan."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.world_size < 0 or self.generation < 0 or self.epoch < 0:
            raise PermanentError(f"{self.channel.value} rendezvous: rank, world_size, generation, epoch must be >= 0")
        if self.world_size and not 0 < self.rank < self.world_size:
            raise PermanentError(
                f"{self.channel.value} rendezvous: rank {self.rank} is outside 1..{self.world_size - 1} "
                "(rank 0 is the sender)"
            )
        if self.timeout_s <= 0 or self.join_timeout_s <= 0:
            raise PermanentError(
                f"{self.channel.value} rendezvous: timeout_s and join_timeout_s must be positive, got "
                f"{self.timeout_s} and {self.join_timeout_s}"
            )

    def require(self, needs: Iterable[str]) -> None:
        """Raise naming every field ``needs`` lists that this rendezvous leaves empty."""
        missing = [n for n in needs if not getattr(self, n)]
        if missing:
            raise PermanentError(
                f"{self.channel.value} rendezvous lacks {', '.join(missing)}; the plan did not carry what this "
                "channel's receiver needs (is the coordinator older than this replica?)"
            )

    def same_membership(self, other: Rendezvous | None) -> bool:
        """Whether ``other`` names the same group membership (so a sender keeps what it built for it)."""
        return other is not None and (self.group, self.secret, self.generation) == (
            other.group,
            other.secret,
            other.generation,
        )

    @property
    def prefix(self) -> str:
        """The store prefix of this membership's keys."""
        return f"weightsync/{self.channel.value}/{self.group}/{self.secret}/"

    def with_timeout(self, timeout_s: float) -> Rendezvous:
        return dataclasses.replace(self, timeout_s=timeout_s)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (vLLM's ``init_info``): the endpoint as ``host:port``, metadata as base64."""
        d: dict[str, Any] = {
            "channel": self.channel.value,
            "timeout_s": self.timeout_s,
            "join_timeout_s": self.join_timeout_s,
        }
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in d or not value:
                continue
            if f.name == "endpoint":
                value = str(value)
            elif f.name == "metadata":
                value = base64.b64encode(value).decode("ascii")
            d[f.name] = value
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Rendezvous:
        """The inverse of ``to_dict``; raises naming the field that is malformed."""
        try:
            channel = Channel.parse(str(d["channel"]))
        except (KeyError, ValueError) as e:
            raise PermanentError(f"rendezvous: channel missing or unknown ({e})") from None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PermanentError(f"{channel.value} rendezvous: unknown fields {unknown}; known: {sorted(known)}")
        try:
            return cls(
                channel=channel,
                endpoint=Endpoint.parse(str(d["endpoint"])) if d.get("endpoint") else None,
                group=str(d.get("group", "")),
                secret=str(d.get("secret", "")),
                generation=int(d.get("generation", 0)),
                rank=int(d.get("rank", 0)),
                world_size=int(d.get("world_size", 0)),
                agent=str(d.get("agent", "")),
                metadata=base64.b64decode(str(d.get("metadata", "")).encode("ascii"), validate=True),
                epoch=int(d.get("epoch", 0)),
                root=str(d.get("root", "")),
                timeout_s=float(d.get("timeout_s", 120.0)),
                join_timeout_s=float(d.get("join_timeout_s", DEFAULT_JOIN_TIMEOUT_S)),
            )
        except (TypeError, ValueError, binascii.Error) as e:
            raise PermanentError(f"{channel.value} rendezvous: malformed field ({e}) in {sorted(d)}") from None


def direct_rendezvous(
    offer: Offer, devices: int = 1, group: str = "direct", join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
) -> Rendezvous:
    """The rendezvous of one replica (of ``devices`` workers) planned on ``offer`` without a coordinator.

    For the sandbox, the tests and the benchmarks; a fleet gets its rendezvous from the coordinator's plan.
    ``join_timeout_s`` bounds the join from ``take_plan`` on: a tool that starts its receiver after planning it
    gives it the receiver's start-up time.
    """
    if offer.channel.value == "volume":
        raise PermanentError("the volume has no rendezvous to plan: give the receiver its root")
    return Rendezvous(
        offer.channel,
        endpoint=offer.endpoint,
        group=group,
        secret=secrets.token_hex(16),
        generation=1,
        rank=1,
        world_size=1 + devices,
        agent=offer.agent,
        metadata=offer.metadata,
        epoch=offer.epoch,
        join_timeout_s=join_timeout_s,
    )


@dataclass(frozen=True)
class SenderConfig:
    """How the publisher builds every sender the same way."""

    host: str = "127.0.0.1"
    """The address receivers reach this process at (the pod's IP); rendezvous stores listen there only."""
    device: str = "cpu"
    """Where the trainer's tensors live (``cuda:N`` for the GPU channels)."""
    timeout_s: float = 120.0
    root: str = ""
    """Volume: where versions are written."""


@dataclass(frozen=True)
class UpdateTicket:
    """What a receiver needs for one version.

    ``table`` may be left out: the channel then carries it (and the receiver checks it
    against ``layout_digest``). ``manifest_checksum`` is what the coordinator recorded for
    a volume version; the volume receiver refuses a manifest that does not match it. The
    channel-specific fields below are typed and checked here like the rest: a field the
    ticket's channel cannot use is refused where the ticket is built, not ignored where
    it is read.
    """

    version: int
    channel: Channel
    table: TensorTable | None = None
    layout_digest: str = ""
    manifest_checksum: str = ""
    step: int = 0
    verify: bool = True
    timeout_s: float = 300.0
    """How long the transfer may stall once the sender started."""
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    """The version's join deadline (the plan's ``Rendezvous.join_timeout_s``): the sender starts at the latest
    then, so a receiver's first wait lasts it plus ``timeout_s`` (the transfer timeout counts from the sender's
    start, not from this receiver's join), and so must whatever waits for the receiver."""
    root: str = ""
    """Volume: the volume's root as this replica mounts it (empty: the receiver's own)."""
    bucket_bytes: int = 0
    """CPU stream: the sender's bucket size (0: its default). The stream's header carries the size the sender
    used, so the receiver never needs it."""
    shard_name: str = ""
    """Volume sender: write the version as this one file (a PEFT adapter folder) instead of numbered shards."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Volume sender: side files written beside the shards (plain file name -> text, e.g. ``adapter_config.json``)."""
    staged: bool = False
    """Switch in the version staged for this ticket (staged mode) instead of receiving it over the channel."""

    def __post_init__(self) -> None:
        where = f"version {self.version}'s {self.channel.value} ticket"
        if self.version < 1:
            raise PermanentError(f"version must be >= 1, got {self.version}")
        if self.timeout_s <= 0 or self.join_timeout_s <= 0:
            raise PermanentError(
                f"{where}: timeout_s and join_timeout_s must be positive, got {self.timeout_s} and "
                f"{self.join_timeout_s}"
            )
        if self.table is not None and not len(self.table):
            raise PermanentError(f"{where}: the table is empty; leave it out instead")
        if self.bucket_bytes < 0:
            raise PermanentError(f"{where}: bucket_bytes must be >= 0 (0: the sender default), got {self.bucket_bytes}")
        if self.bucket_bytes and self.channel is not Channel.CPU:
            raise PermanentError(f"{where}: bucket_bytes is for the cpu stream only; leave it 0")
        volume_only = {"root": self.root, "shard_name": self.shard_name, "files": self.files}
        misplaced = [name for name, value in volume_only.items() if value and self.channel is not Channel.VOLUME]
        if misplaced:
            raise PermanentError(f"{where}: {', '.join(misplaced)} are for the volume only; leave them empty")
        for name in ([self.shard_name] if self.shard_name else []) + list(self.files):
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise PermanentError(f"{where}: volume file name {name!r} must be a plain file name")
        object.__setattr__(self, "files", dict(self.files))  # a copy: the ticket is frozen, so is what it holds

    def to_update_info(self) -> dict[str, Any]:
        """JSON-safe (vLLM's ``update_info``); ``from_update_info`` is its inverse."""
        info: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "channel":
                value = value.value
            elif f.name == "table":
                value = value.to_dict() if value is not None else None
            elif f.name == "files":
                value = dict(value)
            info[f.name] = value
        return info

    @classmethod
    def from_update_info(cls, info: Mapping[str, Any]) -> UpdateTicket:
        """The inverse of ``to_update_info``; raises naming a missing, unknown or malformed field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(info) - known)
        if unknown:
            raise PermanentError(f"update_info: unknown fields {unknown}; known: {sorted(known)}")
        try:
            table = info.get("table")
            files = info.get("files") or {}
            if not isinstance(files, Mapping):
                raise TypeError(f"files must be an object of name -> text, got {type(files).__name__}")
            return cls(
                version=int(info["version"]),
                channel=Channel.parse(str(info["channel"])),
                table=TensorTable.from_dict(table) if table else None,
                layout_digest=str(info.get("layout_digest", "")),
                manifest_checksum=str(info.get("manifest_checksum", "")),
                step=int(info.get("step", 0)),
                verify=bool(info.get("verify", True)),
                timeout_s=float(info.get("timeout_s", 300.0)),
                join_timeout_s=float(info.get("join_timeout_s", DEFAULT_JOIN_TIMEOUT_S)),
                root=str(info.get("root", "")),
                bucket_bytes=int(info.get("bucket_bytes", 0)),
                shard_name=str(info.get("shard_name", "")),
                files={str(k): str(v) for k, v in files.items()},
                staged=bool(info.get("staged", False)),
            )
        except KeyError as e:
            raise PermanentError(f"update_info lacks field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise PermanentError(f"update_info: malformed field ({e})") from None

    def resolve_table(self, carried: TensorTable, where: str) -> TensorTable:
        """The version's table: ``carried`` by the channel, checked against this ticket's table or layout digest."""
        if not len(carried):
            raise IntegrityError(f"{where}: version {self.version} carried an empty tensor table")
        if self.table is not None:
            carried.check_matches(self.table)
            if carried != self.table:
                raise IntegrityError(f"{where}: the tensor offsets differ from the ticket's table")
        if self.layout_digest and carried.layout_digest() != self.layout_digest:
            raise IntegrityError(
                f"{where}: version {self.version}'s table has layout digest {carried.layout_digest()}, the "
                f"coordinator recorded {self.layout_digest}; the sender and the coordinator disagree on the version"
            )
        return carried


class NoReceiver(TransferTimeoutError):
    """No receiver of a sender's groups joined in time: ``left_out`` names each planned one and why."""

    def __init__(self, message: str, left_out: Mapping[str, str]) -> None:
        super().__init__(message)
        self.left_out = dict(left_out)


@dataclass
class SendReport:
    """What one sender did with one version."""

    digests: dict[str, str] = field(default_factory=dict)
    """Per-tensor digests of what was sent (verification on), computed where the bytes lay."""
    failed: dict[str, str] = field(default_factory=dict)
    """Replica id -> why its receiver was lost mid-version (the others got the version)."""


class Sender(ABC):
    """Trainer side of a channel; see the module docstring for the sequence. Used on the sending rank only."""

    channel: ClassVar[Channel]

    @classmethod
    @abstractmethod
    def create(cls, config: SenderConfig) -> Self:
        """Build from the publisher's common configuration."""

    @abstractmethod
    def offer(self) -> Offer:
        """Where this sender's rendezvous listens and what else a receiver needs from it."""

    def take_plan(self, receivers: Mapping[str, Rendezvous]) -> None:  # noqa: B027 - optional hook
        """This version's receivers on this channel (replica id -> its rendezvous).

        Group channels form or rebuild their groups here (in the background: the receivers
        join while the publisher waits for them; ``send`` waits for the formation). The
        default keeps nothing: channels without groups need no plan.
        """

    def narrow(self, members: Collection[str]) -> None:  # noqa: B027 - optional hook
        """While its groups form: the receivers still planned on this channel (the coordinator moved the others to
        their fallback). A group that waits for all its members (NCCL) stops waiting for the others at once; the
        default waits for nobody."""

    def ready(self, timeout_s: float, members: Collection[str] | None = None) -> dict[str, str]:
        """Wait up to ``timeout_s`` (what is left of the join deadline) for the groups of ``members`` to form:
        the receivers still planned on this channel (default: all of ``take_plan``'s; the coordinator moves one
        whose own side failed to its fallback). Leave out every other receiver and those whose group did not form,
        and return them (replica id -> why); raise ``NoReceiver`` (naming each) when none is left. The publisher calls
        it before the first byte, so a receiver that did not join in time costs the others nothing; the default
        has no groups to wait for."""
        return {}

    @abstractmethod
    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> SendReport:
        """Send every group of ``ticket.table`` (``groups`` yields the tensors of each group, in order)."""

    on_lost: Callable[[str, str], None] | None = None
    """Set by the publisher: told (replica id, why) the moment ``send`` loses a receiver, so the coordinator moves
    that replica to its fallback at once instead of at its own receive timeout. Called on the sending thread:
    it must not block."""

    def lose(self, replica_id: str, why: str) -> None:
        """A receiver was lost mid-version (it died, froze, or fell too far behind): tell ``on_lost`` now."""
        if self.on_lost is not None:
            self.on_lost(replica_id, why)

    def release(self, version: int, timeout_s: float) -> None:  # noqa: B027 - optional hook
        """Return once every planned receiver consumed ``version`` (one-sided channels read the trainer's
        memory, so it must not change before); the default has nothing to wait for."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default holds none."""


@dataclass(frozen=True)
class WorkerContext:
    """Where a receiver runs: one worker of one replica (tensor-parallel rank ``rank`` of ``world_size``)."""

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"


class Receiver(ABC):
    """Engine side of a channel: started in a vLLM worker from the plan's ``Rendezvous``, fed one ticket per version.

    After (or while) ``receive`` runs: ``table`` is the version's full table, ``verified``
    the digests this receiver computed and checked (name -> digest), ``verify_seconds``
    the time checking took, and ``in_place`` the tensors written straight into the
    engine's parameters (never yielded).
    """

    channel: ClassVar[Channel]
    needs: ClassVar[tuple[str, ...]] = ()
    """The ``Rendezvous`` fields this channel's receiver cannot start without."""

    table: TensorTable | None = None
    verified: dict[str, str]
    verify_seconds: float
    in_place: set[str]

    @classmethod
    def start(cls, rendezvous: Rendezvous, ctx: WorkerContext) -> Receiver:
        """Check the rendezvous carries what this channel needs, then build (and join) the receiver."""
        if rendezvous.channel is not cls.channel:
            raise PermanentError(f"a {rendezvous.channel.value} rendezvous cannot start a {cls.channel.value} receiver")
        rendezvous.require(cls.needs)
        import torch

        from weightsync.channels import batched

        batched.warm(torch.device(ctx.device))  # its digests' kernels compile here, not in the first update's pause
        receiver = cls.from_rendezvous(rendezvous, ctx)
        receiver.begin()
        return receiver

    @classmethod
    @abstractmethod
    def from_rendezvous(cls, rendezvous: Rendezvous, ctx: WorkerContext) -> Receiver:
        """Build (and join the group) from a checked rendezvous."""

    @abstractmethod
    def receive(self, ticket: UpdateTicket, place: Placement | None = None) -> Iterator[Group]:
        """Yield each group of the version in table order, verified when ``ticket.verify`` is set.

        ``place`` gives, once the table is known, views of the engine's parameters by trainer
        name (fused q/k/v and gate/up row blocks included). A channel that can write in place
        receives those tensors straight into their views, records them in ``in_place`` and
        does not yield them; the others ignore it. Views yielded may be reused for the next
        group: consume them before advancing.
        """

    def begin(self) -> None:
        """Forget the last version's record (each ``receive`` calls it first)."""
        self.table, self.verified, self.verify_seconds, self.in_place = None, {}, 0.0, set()
        self._deferred: list[tuple[Sequence[TensorSpec], torch.Tensor, torch.Tensor]] = []

    def check(self, group: Group, expected: Mapping[str, str]) -> None:
        """Digest every tensor of ``group`` where it lies and compare with the trainer's now (timed as ``verify``).

        For groups about to be yielded to the engine's loader: nothing unverified may reach it.
        """
        from weightsync.channels import wire

        t0 = time.perf_counter()
        self.verified.update(wire.verify_group(group, expected))
        self.verify_seconds += time.perf_counter() - t0

    def check_later(self, group: Group, expected: torch.Tensor) -> None:
        """Digest ``group`` where it lies (device kernels, no host sync) against the trainer's digest words;
        the comparison happens once per version, in ``checks_done``. For tensors written in place (the
        update is torn anyway if they are wrong), so verification costs no host round trip per group."""
        from weightsync.channels import digests

        t0 = time.perf_counter()
        self._deferred.append(([s for s, _ in group], digests.words([t for _, t in group]), expected))
        self.verify_seconds += time.perf_counter() - t0

    def checks_done(self) -> None:
        """Compare every deferred group at once (one host sync); raise naming the first tensor that differs."""
        if not self._deferred:
            return
        import torch

        from weightsync.channels import digests

        t0 = time.perf_counter()
        specs = [s for group, _, _ in self._deferred for s in group]
        got = torch.cat([g for _, g, _ in self._deferred]).cpu()
        want = torch.cat([w.to(g.device) for _, g, w in self._deferred]).cpu()
        self._deferred = []
        mine, theirs = digests.from_words(specs, got), digests.from_words(specs, want)
        for spec in specs:
            if mine[spec.name] != theirs[spec.name]:
                raise IntegrityError(
                    f"tensor {spec.name!r}: received digest {mine[spec.name]}, the trainer sent "
                    f"{theirs[spec.name]}; the bytes were altered in transit, the update is refused"
                )
        self.verified.update(mine)
        self.verify_seconds += time.perf_counter() - t0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default holds none."""
