"""Typed domain objects of the control plane: what the rest of the code talks about.

The generated protobuf classes stay behind ``serde``; everything else (the core, the
client's callers, the negotiation functions) sees these frozen dataclasses. They
validate what can be checked locally on construction, so a bad value fails where
it enters, naming the field.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from weightsync.errors import PermanentError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel, SyncPhase, VersionState

DEFAULT_PREFERENCE: tuple[Channel, ...] = (Channel.IPC, Channel.NCCL, Channel.NIXL, Channel.CPU, Channel.VOLUME)
"""Colocated same GPU -> ipc; same NCCL domain -> nccl; both NIXL -> nixl; CPU engine -> cpu; else volume."""

GROUP_CHANNELS = frozenset({Channel.NCCL, Channel.CPU})
"""Channels that form one collective group per membership (the sender is rank 0)."""


class Role(enum.StrEnum):
    TRAINER = "trainer"
    REPLICA = "replica"


class EngineKind(enum.StrEnum):
    CPU = "cpu"
    GPU = "gpu"


class EventKind(enum.StrEnum):
    ASSIGN = "assign"
    """Load this version over ``plan.channel`` now."""
    CATCH_UP = "catch_up"
    """Load this durable READY version from the volume (late joiner or recovery)."""
    ABORT = "abort"
    """The version failed: stop; if bytes already landed, reload the newest durable READY version."""


class Progress(enum.StrEnum):
    READY_TO_RECEIVE = "ready_to_receive"
    RECEIVING = "receiving"
    LOADING = "loading"


class WaitFor(enum.StrEnum):
    RECEIVERS_READY = "receivers_ready"
    SETTLED = "settled"


SETTLED_STATES = frozenset({VersionState.READY, VersionState.FAILED, VersionState.SUPERSEDED})


@dataclass(frozen=True)
class Capabilities:
    """What one end can do: a trainer lists channels it sends, a replica channels it receives."""

    host: str = ""
    gpu_uuids: tuple[str, ...] = ()
    devices: int = 1
    channels: tuple[Channel, ...] = ()
    nccl_domain: str = ""
    nixl: bool = False
    volume_id: str = ""
    volume_mount: str = ""
    engine: EngineKind = EngineKind.CPU

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise PermanentError(f"capabilities.devices must be >= 1, got {self.devices}")


@dataclass(frozen=True)
class SenderOffer:
    """Sender-side rendezvous for one channel: where the group's store listens, IPC handles, NIXL metadata."""

    channel: Channel
    host: str = ""
    port: int = 0
    ipc_handles: Mapping[str, bytes] = field(default_factory=dict)
    nixl_metadata: bytes = b""


@dataclass(frozen=True)
class JobPolicy:
    """Per-job knobs; ``ack_quorum`` 0 means every live planned replica must ack."""

    channel_preference: tuple[Channel, ...] = DEFAULT_PREFERENCE
    ack_quorum: int = 0
    version_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.channel_preference:
            raise PermanentError("policy.channel_preference is empty; list at least one channel, e.g. volume")
        if len(set(self.channel_preference)) != len(self.channel_preference):
            names = [c.value for c in self.channel_preference]
            raise PermanentError(f"policy.channel_preference {names} repeats a channel; list each at most once")
        if self.ack_quorum < 0:
            raise PermanentError(f"policy.ack_quorum must be >= 0, got {self.ack_quorum}")
        if self.version_timeout_s <= 0:
            raise PermanentError(f"policy.version_timeout_s must be > 0, got {self.version_timeout_s}")


@dataclass(frozen=True)
class Lease:
    lease_id: str
    ttl_s: float


@dataclass(frozen=True)
class TableSummary:
    """What the coordinator knows of a version's tensors: no names, no bytes."""

    tensor_count: int
    total_bytes: int
    table_digest: str

    def __post_init__(self) -> None:
        if self.tensor_count < 1:
            raise PermanentError(f"table.tensor_count must be >= 1, got {self.tensor_count}")
        if not self.table_digest:
            raise PermanentError("table.table_digest is empty; send the digest of the tensor table")


@dataclass(frozen=True)
class Rendezvous:
    host: str = ""
    port: int = 0
    rank_offset: int = 0
    world_size: int = 0
    group_id: str = ""
    ipc_handles: Mapping[str, bytes] = field(default_factory=dict)
    nixl_metadata: bytes = b""
    volume_path: str = ""

    @property
    def address(self) -> str:
        """``host:port``, the form ``weightsync.channels.cpu`` takes."""
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class ChannelPlan:
    replica_id: str
    channel: Channel
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    reason: str = ""


@dataclass(frozen=True)
class OpenedVersion:
    version: int
    plans: tuple[ChannelPlan, ...]
    reused: bool = False

    def groups(self) -> dict[str, tuple[Channel, int]]:
        """Each group of this version: id -> (channel, world size). Form the ones the sender lacks."""
        groups = (p for p in self.plans if p.channel in GROUP_CHANNELS)
        return {p.rendezvous.group_id: (p.channel, p.rendezvous.world_size) for p in groups}


@dataclass(frozen=True)
class Assignment:
    """One event on a replica's watch stream."""

    kind: EventKind
    job: str
    version: int
    step: int = 0
    plan: ChannelPlan | None = None
    table: TableSummary | None = None
    reason: str = ""


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    channel: Channel | None
    status: str  # planned, ready, acked, failed, dropped
    error: str = ""
    content_digest: str = ""


@dataclass(frozen=True)
class VersionInfo:
    job: str
    version: int
    step: int
    incarnation: str
    state: VersionState
    durable: bool = False
    manifest_path: str = ""
    manifest_sha256: str = ""
    table: TableSummary | None = None
    reason: str = ""
    opened_at: float = 0.0
    settled_at: float = 0.0
    replicas: tuple[ReplicaStatus, ...] = ()


@dataclass(frozen=True)
class MemberInfo:
    member_id: str
    role: Role
    incarnation: str
    current_version: int
    lease_expires_in_s: float
    capabilities: Capabilities


@dataclass(frozen=True)
class JobInfo:
    job: str
    policy: JobPolicy
    newest_ready: int
    newest_durable_ready: int
    members: tuple[MemberInfo, ...]


@dataclass(frozen=True)
class AckReport:
    """A replica's verdict on one version."""

    version: int
    table_digest: str
    ok: bool = True
    phases: Mapping[SyncPhase, float] = field(default_factory=dict)
    error: str = ""
    channel_failed: bool = False
    content_digest: str = ""


def summarize(table: TensorTable) -> TableSummary:
    """The summary a publisher sends and an agent repeats in its ack.

    The digest covers the layout (name, dtype, shape, offset of every tensor, in
    order), which both ends know before any byte moves; content is checked by the
    channels and compared across replicas through ``AckReport.content_digest``.
    """
    h = hashlib.sha256()
    for s in table:
        h.update(f"{s.name}\0{s.dtype}\0{','.join(map(str, s.shape))}\0{s.offset}\n".encode())
    return TableSummary(tensor_count=len(table), total_bytes=table.total_bytes, table_digest="sha256:" + h.hexdigest())


def content_digest(digests: Mapping[str, str]) -> str:
    """One digest over per-tensor digests (name order), for ``AckReport.content_digest``."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return "sha256:" + h.hexdigest()
