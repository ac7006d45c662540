"""Typed domain objects of the control plane: what the rest of the code talks about.

The generated protobuf classes stay behind ``serde``; everything else (the core, the
client's callers, the negotiation functions) sees these frozen dataclasses. They
validate what can be checked locally on construction, so a bad value fails where
it enters, naming the field.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from weightsync.channels.base import Rendezvous
from weightsync.channels.rules import LIVE_CHANNELS as LIVE_CHANNELS  # the channel rules' types are the
from weightsync.channels.rules import Capabilities as Capabilities  # control plane's vocabulary too
from weightsync.channels.rules import EngineKind as EngineKind
from weightsync.errors import PermanentError
from weightsync.jobconfig import DEFAULT_JOIN_TIMEOUT_S, JobConfig
from weightsync.sharding import fills, shards
from weightsync.sharding import plans as transfer_plans  # "plans" are the channel plans here
from weightsync.tensors import TensorTable, is_digest
from weightsync.vocabulary import Channel, ReplicaState, SyncPhase, VersionState

DEFAULT_PREFERENCE: tuple[Channel, ...] = (Channel.IPC, Channel.NCCL, Channel.NIXL, Channel.CPU, Channel.VOLUME)
"""Colocated same GPU -> ipc; same NCCL domain -> nccl; both NIXL -> nixl; CPU engine -> cpu; else volume."""


class Role(enum.StrEnum):
    TRAINER = "trainer"
    REPLICA = "replica"


class EventKind(enum.StrEnum):
    ASSIGN = "assign"
    """Load this version over ``plan.channel`` now."""
    CATCH_UP = "catch_up"
    """Load this durable READY version from the volume (late joiner or recovery)."""
    ABORT = "abort"
    """The version failed: stop; if bytes already landed, reload the newest durable READY version."""
    COMMIT = "commit"
    """All-or-nothing: the replicas the ack policy needs staged this version; switch it in now."""


class Progress(enum.StrEnum):
    JOINED = "joined"
    """The replica's receiver is set up (its group joined) and waits for bytes."""
    RECEIVING = "receiving"
    LOADING = "loading"
    STAGED = "staged"
    """All-or-nothing: staged and verified beside the serving weights; the replica switches on COMMIT."""


class WaitFor(enum.StrEnum):
    RECEIVERS_JOINED = "receivers_joined"
    """Every replica planned on a live channel joined, or was dropped."""
    SETTLED = "settled"
    """READY, FAILED or SUPERSEDED."""
    SETTLED_OR_DURABLE_NEEDED = "settled_or_durable_needed"
    """Settled, or a planned replica waits for the volume copy that has not landed (the publisher writes it)."""


SETTLED_STATES = frozenset({VersionState.READY, VersionState.FAILED, VersionState.SUPERSEDED})


@dataclass(frozen=True)
class JobPolicy:
    """Per-job knobs; ``ack_quorum`` 0 means every live planned replica must ack."""

    channel_preference: tuple[Channel, ...] = DEFAULT_PREFERENCE
    ack_quorum: int = 0
    version_timeout_s: float = 600.0
    retention: int = 3
    """Durable versions kept on the volume (never fewer than the newest durable READY one)."""
    ready_without_acks: bool = False
    """A version planned for no replica is READY. Off by default: READY means replicas acked it, so such a
    version is FAILED ("planned for no replica"); a job that publishes before its replicas exist may opt in."""
    all_or_nothing: bool = False
    """Every planned replica stages a version and switches it in only once the replicas the ack policy needs
    have staged it (COMMIT); a version whose policy cannot be met that way fails with no replica switched."""
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    """Every live plan's ``Rendezvous.join_timeout_s``: receivers join within it or the sender goes on without
    them (``JobConfig.join_timeout_s``)."""

    @classmethod
    def of(cls, config: JobConfig) -> JobPolicy:
        """The policy a job config (``job.json``, from the RLJob's ``spec.sync``) sets."""
        return cls(
            config.channels,
            config.ack_quorum,
            config.timeout_s,
            config.retention,
            config.ready_without_acks,
            config.all_or_nothing,
            config.join_timeout_s,
        )

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
        if self.retention < 1:
            raise PermanentError(f"policy.retention must be >= 1, got {self.retention}")
        if self.join_timeout_s <= 0:
            raise PermanentError(f"policy.join_timeout_s must be > 0, got {self.join_timeout_s}")


@dataclass(frozen=True)
class Lease:
    lease_id: str
    ttl_s: float


@dataclass(frozen=True)
class TableSummary:
    """What the coordinator knows of a version's tensors: no names, no bytes."""

    tensor_count: int
    total_bytes: int
    layout_digest: str
    verified: bool = True
    """The trainer sends per-tensor digests and every receiver checks them; both ends of a channel must agree (a
    receiver waiting for digests the sender never sends would stall or misread the stream)."""

    def __post_init__(self) -> None:
        if self.tensor_count < 1:
            raise PermanentError(f"table.tensor_count must be >= 1, got {self.tensor_count}")
        if not is_digest(self.layout_digest):
            raise PermanentError(
                f"table.layout_digest {self.layout_digest[:80]!r} is not sha256:<64 hex>; send table.layout_digest()"
            )


@dataclass(frozen=True)
class ChannelPlan:
    replica_id: str
    channel: Channel
    rendezvous: Rendezvous
    reason: str = ""
    manifest_checksum: str = ""
    """Volume plans, once the version is durable: the manifest checksum the replica must find."""
    transfer: transfer_plans.TransferPlan | None = None
    """The replica's part of the transfer plan (its regions, or why it takes the gathered path); None: the trainer
    registered no layout, so every replica takes the gathered path."""

    def regions_part(self) -> transfer_plans.ReplicaPlan | None:
        """The replica's regions when this plan sends it regions (over a live channel), else None: the gathered
        path. What the publisher sends, the agent receives and the coordinator checks the ack against."""
        if self.transfer is None or self.channel not in LIVE_CHANNELS:
            return None
        return next((rp for rp in self.transfer.replicas if rp.replica_id == self.replica_id and rp.sharded), None)


@dataclass(frozen=True)
class OpenedVersion:
    version: int
    plans: tuple[ChannelPlan, ...]
    reused: bool = False

    def receivers(self, channel: Channel) -> dict[str, Rendezvous]:
        """The replicas planned on ``channel`` and their rendezvous: what that channel's sender takes as its plan."""
        return {p.replica_id: p.rendezvous for p in self.plans if p.channel is channel}


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
    await_commit: bool = False
    """An ASSIGN in an all-or-nothing job: stage the version, report it staged, switch it in on COMMIT."""


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    channel: Channel | None
    state: ReplicaState
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
    manifest_checksum: str = ""
    table: TableSummary | None = None
    reason: str = ""
    opened_at: float = 0.0
    settled_at: float = 0.0
    replicas: tuple[ReplicaStatus, ...] = ()
    content_digest: str = ""
    """What the trainer sent (reported by its publisher; empty with verification off)."""
    durable_needed: bool = False
    """A planned replica waits for the volume copy, which has not landed yet."""


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
class SentReport:
    """The publisher's account of one version, once its bytes went out (``ReportSent``)."""

    content_digest: str
    """Over the per-tensor digests of what was sent (empty: verification off); every ack must match it."""
    failed: Mapping[str, str] = field(default_factory=dict)
    """Receivers a live channel lost (replica id -> error); they fall back to the volume themselves."""
    volume_error: str = ""
    """Why the volume copy failed: replicas waiting to load the version from there fail with it."""
    region_digests: Mapping[str, str] = field(default_factory=dict)
    """Replica id -> the senders' combined digest of the regions sent to it (plan order), for each replica the
    plan sent regions: its ack must match this, not ``content_digest`` (its workers hold slices, not tensors)."""


@dataclass(frozen=True)
class AckReport:
    """A replica's verdict on one version: what its engine loaded and computed, never what it was handed."""

    version: int
    layout_digest: str
    ok: bool = True
    phases: Mapping[SyncPhase, float] = field(default_factory=dict)
    error: str = ""
    channel_failed: bool = False
    content_digest: str = ""
    torn: bool = False
    regions_read: bool = False
    """The replica read the version by region from a sharded volume copy: ``content_digest`` is over what its
    workers read of their engine layout's fills (``volume_reads.combine``), which only replicas of the same
    engine layout can match; never compared with whole loads' digests or with what the trainer sent."""


def summarize(table: TensorTable, verified: bool = True) -> TableSummary:
    """What the coordinator knows of a version's tensors: count, bytes, the layout digest, whether digests follow."""
    return TableSummary(len(table), table.total_bytes, table.layout_digest(), verified)


Layout = shards.TrainerLayout | fills.EngineLayout
"""What a member registers for the sharded path: a trainer where its tensors lie, a replica what its workers keep."""
