"""What the coordinator remembers per job: its members (with their leases and event queues) and its versions.

Plain records, mutated only by ``core.Coordinator`` under its lock. A member is
one registered process (a trainer or a replica); its ``events`` queue feeds the
replica's watch stream, and ``None`` on it ends the stream (lease dropped or
replaced). A job keeps its versions, the idempotency keys ``(incarnation, step)``
that make a retried open return the same version, the last step of each trainer
incarnation (versions never go backwards), and the groups of the last round.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from weightsync.channels.base import Offer
from weightsync.coordinator import negotiation
from weightsync.coordinator.lifecycle import VersionRecord
from weightsync.coordinator.models import Assignment, Capabilities, JobPolicy, Layout, Role
from weightsync.sharding.plans import PlanCache
from weightsync.vocabulary import Channel, VersionState

FAILED_CHANNEL_RETRY_S = 30.0
"""How long a replica whose live channel failed is kept off it (planned on the volume) before it is tried
again; the wait doubles with each failure in a row, up to ``FAILED_CHANNEL_MAX_S``, and a load over the
channel clears it. A partition that heals costs a few versions over the volume, not the channel for good."""
FAILED_CHANNEL_MAX_S = 1800.0


@dataclass
class ChannelBackoff:
    until: float
    """Monotonic time from which the channel is negotiated again."""
    delay: float
    """The last wait, doubled at the next failure."""


@dataclass
class Member:
    job: str
    member_id: str
    role: Role
    incarnation: str
    capabilities: Capabilities
    lease_id: str
    expires_at: float
    current_version: int = 0
    offers: dict[Channel, Offer] = field(default_factory=dict)
    failed_channels: dict[Channel, ChannelBackoff] = field(default_factory=dict)
    last_failed: bool = False
    catching_up: int = 0
    """The version a CATCH_UP event sent this replica to load, until it acks that version (kept on the volume)."""
    streams: int = 0
    stream_seen: float = field(default_factory=time.monotonic)
    """When the member registered or its last watch stream ended (monotonic)."""
    events: queue.SimpleQueue[Assignment | None] = field(default_factory=queue.SimpleQueue)
    layout: Layout | None = None
    """For the sharded path: a trainer's layout (where each tensor lies across its ranks) or a replica's engine
    layout (what each worker keeps); None: it takes the gathered path."""

    def fail_channel(self, channel: Channel, now: float) -> None:
        """``channel`` failed for this member: keep it off it for a while (longer each time in a row)."""
        before = self.failed_channels.get(channel)
        delay = min(before.delay * 2, FAILED_CHANNEL_MAX_S) if before else FAILED_CHANNEL_RETRY_S
        self.failed_channels[channel] = ChannelBackoff(now + delay, delay)

    def channels_off(self, now: float) -> frozenset[Channel]:
        return frozenset(ch for ch, b in self.failed_channels.items() if now < b.until)


@dataclass
class Job:
    name: str
    policy: JobPolicy
    versions: dict[int, VersionRecord] = field(default_factory=dict)
    next_version: int = 1
    keys: dict[tuple[str, int], int] = field(default_factory=dict)
    last_step: dict[str, int] = field(default_factory=dict)
    groups: negotiation.GroupState = field(default_factory=negotiation.GroupState)
    members: dict[str, Member] = field(default_factory=dict)
    recovered: bool = False
    """The job had versions before this coordinator started (its replicas are registering again)."""
    transfer_plans: PlanCache = field(default_factory=PlanCache)
    """Transfer plans by (trainer layout, engine layouts, membership): a version reuses the last one's."""

    def trainer(self) -> Member | None:
        return next((m for m in self.members.values() if m.role is Role.TRAINER), None)

    def newest(self, durable: bool = False) -> VersionRecord | None:
        for v in sorted(self.versions, reverse=True):
            rec = self.versions[v]
            settled_ok = rec.state in (VersionState.READY, VersionState.SUPERSEDED)
            if settled_ok and (rec.durable if durable else rec.state is VersionState.READY):
                return rec
        return None
