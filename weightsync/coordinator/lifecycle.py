"""One version's lifecycle: STAGING -> READY | FAILED, READY -> SUPERSEDED.

A ``VersionRecord`` holds the plan of a version and what each planned replica has
reported; ``settle`` decides, from those facts alone, whether the job's ack policy
is met (READY), can no longer be met (FAILED), or not yet. It holds no lock and
does no I/O: the coordinator core calls it under its own lock.

The ack policy counts only replicas that are still alive: a replica whose lease
expired is *dropped* and neither helps nor blocks the version, so one replica
dying mid-transfer does not fail the version for the others. With every planned
replica dropped and none acked, the version FAILED (nobody holds it). A version
planned for no replica at all is READY at once: nothing is waiting for it, and
late joiners take it from the volume once it is durable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from weightsync.coordinator.models import ChannelPlan, ReplicaStatus, TableSummary, VersionInfo
from weightsync.vocabulary import VersionState

PLANNED, READY, ACKED, FAILED, DROPPED = "planned", "ready", "acked", "failed", "dropped"
WAITING = frozenset({PLANNED, READY})


@dataclass
class VersionRecord:
    job: str
    version: int
    step: int
    incarnation: str
    table: TableSummary
    plans: dict[str, ChannelPlan]
    quorum: int = 0
    state: VersionState = VersionState.STAGING
    reason: str = ""
    durable: bool = False
    manifest_path: str = ""
    manifest_sha256: str = ""
    opened_at: float = field(default_factory=time.time)
    opened_mono: float = field(default_factory=time.monotonic)
    settled_at: float = 0.0
    status: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    content: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rid in self.plans:
            self.status.setdefault(rid, PLANNED)
        for s in self.status.values():
            self.counts[s] = self.counts.get(s, 0) + 1

    def set(self, replica_id: str, status: str) -> None:
        """Change one replica's status, keeping the per-status counts (acks are O(1), not O(fleet))."""
        old = self.status[replica_id]
        self.counts[old] -= 1
        self.counts[status] = self.counts.get(status, 0) + 1
        self.status[replica_id] = status

    @classmethod
    def from_info(cls, info: VersionInfo) -> VersionRecord:
        table = info.table or TableSummary(1, 0, "unknown")
        return cls(
            info.job,
            info.version,
            info.step,
            info.incarnation,
            table,
            {},
            state=info.state,
            reason=info.reason,
            durable=info.durable,
            manifest_path=info.manifest_path,
            manifest_sha256=info.manifest_sha256,
            opened_at=info.opened_at,
            opened_mono=0.0,
            settled_at=info.settled_at,
        )

    def count(self, status: str) -> int:
        return self.counts.get(status, 0)

    def waiting(self) -> list[str]:
        return sorted(r for r, s in self.status.items() if s in WAITING)

    def receivers_ready(self) -> bool:
        """Every planned receiver that is still alive reported ready (or already finished)."""
        return self.count(PLANNED) == 0

    def settle(self) -> tuple[VersionState, str] | None:
        """The state the ack policy now dictates, with its reason; None while it is undecided."""
        if self.state is not VersionState.STAGING:
            return None
        if not self.plans:
            return VersionState.READY, "no live replica was planned"
        acked, failed, dropped = self.count(ACKED), self.count(FAILED), self.count(DROPPED)
        waiting = self.count(PLANNED) + self.count(READY)
        if self.quorum:
            if acked >= self.quorum:
                return VersionState.READY, f"quorum met: {acked} of {self.quorum} acks"
            if acked + waiting < self.quorum:
                return VersionState.FAILED, (
                    f"quorum {self.quorum} unreachable: {acked} acked, {failed} failed, "
                    f"{dropped} dropped, {waiting} waiting{self._first_error()}"
                )
            return None
        if failed:
            return VersionState.FAILED, f"{failed} replica(s) failed to load it{self._first_error()}"
        if waiting:
            return None
        if acked == 0:
            return VersionState.FAILED, f"no planned replica acknowledged it ({dropped} dropped)"
        return VersionState.READY, f"all {acked} live replicas acked" + (f", {dropped} dropped" if dropped else "")

    def _first_error(self) -> str:
        for rid in sorted(self.errors):
            if self.status.get(rid) == FAILED:
                return f"; {rid}: {self.errors[rid]}"
        return ""

    def info(self, with_replicas: bool = True) -> VersionInfo:
        replicas = (
            tuple(
                ReplicaStatus(
                    rid,
                    self.plans[rid].channel if rid in self.plans else None,
                    self.status[rid],
                    self.errors.get(rid, ""),
                    self.content.get(rid, ""),
                )
                for rid in sorted(self.status)
            )
            if with_replicas
            else ()
        )
        return VersionInfo(
            job=self.job,
            version=self.version,
            step=self.step,
            incarnation=self.incarnation,
            state=self.state,
            durable=self.durable,
            manifest_path=self.manifest_path,
            manifest_sha256=self.manifest_sha256,
            table=self.table,
            reason=self.reason,
            opened_at=self.opened_at,
            settled_at=self.settled_at,
            replicas=replicas,
        )
