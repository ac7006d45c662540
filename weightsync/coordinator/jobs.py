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
from weightsync.coordinator.models import Assignment, Capabilities, JobPolicy, Role
from weightsync.vocabulary import Channel, VersionState


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
    failed_channels: set[Channel] = field(default_factory=set)
    last_failed: bool = False
    streams: int = 0
    stream_seen: float = field(default_factory=time.monotonic)
    """When the member registered or its last watch stream ended (monotonic)."""
    events: queue.SimpleQueue[Assignment | None] = field(default_factory=queue.SimpleQueue)


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

    def trainer(self) -> Member | None:
        return next((m for m in self.members.values() if m.role is Role.TRAINER), None)

    def newest(self, durable: bool = False) -> VersionRecord | None:
        for v in sorted(self.versions, reverse=True):
            rec = self.versions[v]
            settled_ok = rec.state in (VersionState.READY, VersionState.SUPERSEDED)
            if settled_ok and (rec.durable if durable else rec.state is VersionState.READY):
                return rec
        return None
