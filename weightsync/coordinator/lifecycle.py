"""One version's lifecycle: STAGING -> READY | FAILED, READY -> SUPERSEDED.

A ``VersionRecord`` holds the plan of a version and what each planned replica has
reported; ``settle`` decides, from those facts alone, whether the job's ack policy
is met (READY), can no longer be met (FAILED), or not yet. It holds no lock and
does no I/O: the coordinator core calls it under its own lock.

A version is READY only after its publisher reported what it sent (``sent``, with the
content digest every replica's ack is checked against): a replica that loaded fast
cannot make a version READY before the trainer's digest is there to check it by.

The ack policy counts only replicas that are still alive: a replica whose lease
expired is *dropped* and neither helps nor blocks the version, so one replica
dying mid-transfer does not fail the version for the others. With every planned
replica dropped and none acked, the version FAILED (nobody holds it). A version
planned for no replica at all is READY once its publisher reported it sent: nothing
else is waiting for it, and late joiners take it from the volume once it is durable.

All-or-nothing (``JobPolicy.all_or_nothing``): replicas report ``staged`` instead of
loading, and the version is *committed* (``commit_due``; every staged replica gets a
COMMIT and switches) once the ack policy, counting staged replicas as acked, is met;
its READY verdict then comes from the switches' acks as usual. Before the commit the
policy can only fail (a replica failed to stage it, all dropped, the timeout): then
no replica switched, and every staged one is told to drop its stage (ABORT).

A replica planned on the volume (no live channel, or its live channel failed for
this version) can load the version only once it is durable: until then the record
says ``durable_needed`` and the publisher, which waits for that, writes the copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from weightsync.coordinator.models import LIVE_CHANNELS, ChannelPlan, ReplicaStatus, TableSummary, VersionInfo
from weightsync.tensors import DIGEST_PREFIX
from weightsync.vocabulary import Channel, ReplicaState, VersionState

WAITING = frozenset({ReplicaState.PLANNED, ReplicaState.JOINED, ReplicaState.STAGED})


@dataclass
class VersionRecord:
    job: str
    version: int
    step: int
    incarnation: str
    table: TableSummary
    plans: dict[str, ChannelPlan]
    quorum: int = 0
    ready_without_acks: bool = False
    all_or_nothing: bool = False
    committed: bool = False
    """All-or-nothing: the policy's replicas staged it and were told to switch it in."""
    state: VersionState = VersionState.STAGING
    reason: str = ""
    durable: bool = False
    manifest_path: str = ""
    manifest_checksum: str = ""
    content_digest: str = ""
    """What the trainer sent (its publisher's report)."""
    region_digests: dict[str, str] = field(default_factory=dict)
    """Replica id -> the senders' combined digest of the regions sent to it (the sharded path)."""
    sent: bool = False
    """The publisher reported the version sent (``ReportSent``)."""
    opened_at: float = field(default_factory=time.time)
    opened_mono: float = field(default_factory=time.monotonic)
    settled_at: float = 0.0
    status: dict[str, ReplicaState] = field(default_factory=dict)
    outside: dict[str, Channel] = field(default_factory=dict)
    """Replicas that loaded it outside any plan (catch-up, recovery), with the channel they loaded it over: shown
    over what their plan said, where they had one (a replica dropped from the version, restarted, caught up)."""
    errors: dict[str, str] = field(default_factory=dict)
    content: dict[str, str] = field(default_factory=dict)
    read_regions: dict[str, str] = field(default_factory=dict)
    """Replicas whose digest in ``content`` is over the regions they read from a sharded volume copy, with the
    digest of the engine layout they read with: comparable only among themselves (``AckReport.regions_read``)."""
    counts: dict[ReplicaState, int] = field(default_factory=dict)
    live_planned: int = 0
    """Replicas planned on a live channel that have not joined yet (the publisher waits for none left)."""
    fell_back: set[str] = field(default_factory=set)
    """Replicas re-planned on the volume after their live channel failed (``replan``)."""

    def __post_init__(self) -> None:
        for rid in self.plans:
            self.status.setdefault(rid, ReplicaState.PLANNED)
        for rid, s in self.status.items():
            self.counts[s] = self.counts.get(s, 0) + 1
            if s is ReplicaState.PLANNED and self._live(rid):
                self.live_planned += 1

    def _live(self, replica_id: str) -> bool:
        plan = self.plans.get(replica_id)
        return plan is not None and plan.channel in LIVE_CHANNELS

    def replan(self, plan: ChannelPlan) -> None:
        """Plan a waiting replica anew for this version (its live channel failed: the volume now)."""
        self.set(plan.replica_id, ReplicaState.DROPPED)  # leaves the live count consistently
        self.plans[plan.replica_id] = plan
        self.set(plan.replica_id, ReplicaState.PLANNED)
        self.fell_back.add(plan.replica_id)

    def set(self, replica_id: str, status: ReplicaState) -> None:
        """Change one replica's status, keeping the per-status counts (acks are O(1), not O(fleet))."""
        old = self.status[replica_id]
        self.counts[old] -= 1
        self.counts[status] = self.counts.get(status, 0) + 1
        self.status[replica_id] = status
        if self._live(replica_id):
            self.live_planned += (status is ReplicaState.PLANNED) - (old is ReplicaState.PLANNED)

    @classmethod
    def from_info(cls, info: VersionInfo) -> VersionRecord:
        table = info.table or TableSummary(1, 0, DIGEST_PREFIX + "0" * 64)
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
            manifest_checksum=info.manifest_checksum,
            content_digest=info.content_digest,
            opened_at=info.opened_at,
            opened_mono=0.0,
            settled_at=info.settled_at,
        )

    def record_load(self, replica_id: str, ok: bool, error: str) -> bool:
        """A replica loaded (or failed to load) this settled version outside any plan: a catch-up or a recovery,
        which only the volume serves. Shown with the version's replicas and that channel, never counted toward its
        verdict. True when its status changed."""
        status = ReplicaState.LOADED if ok else ReplicaState.FAILED
        old = self.status.get(replica_id)
        changed = old is not status or self.errors.get(replica_id, "") != error
        self.outside[replica_id] = Channel.VOLUME
        if old is not None:
            self.counts[old] -= 1
        self.status[replica_id] = status
        self.counts[status] = self.counts.get(status, 0) + 1
        if error:
            self.errors[replica_id] = error
        else:
            self.errors.pop(replica_id, None)
        return changed

    def count(self, status: ReplicaState) -> int:
        return self.counts.get(status, 0)

    def waiting(self) -> list[str]:
        return sorted(r for r, s in self.status.items() if s in WAITING)

    def receivers_joined(self) -> bool:
        """Every replica planned on a live channel that is still alive joined (or already finished)."""
        return self.live_planned == 0

    def volume_waiting(self) -> list[str]:
        """Replicas that wait to load this version from the volume."""
        return [r for r in self.waiting() if self.plans[r].channel is Channel.VOLUME]

    @property
    def durable_needed(self) -> bool:
        return not self.durable and self.state is VersionState.STAGING and bool(self.volume_waiting())

    def staged(self) -> list[str]:
        return sorted(r for r, s in self.status.items() if s is ReplicaState.STAGED)

    def commit_due(self) -> bool:
        """All-or-nothing: the policy is met counting staged replicas as acked (and the publisher reported what it
        sent): time to tell every staged replica to switch."""
        if not self.all_or_nothing or self.committed or self.state is not VersionState.STAGING or not self.sent:
            return False
        verdict = self._verdict(staged_acks=True)
        return verdict is not None and verdict[0] is VersionState.READY

    def settle(self) -> tuple[VersionState, str] | None:
        """The state the ack policy now dictates, with its reason; None while it is undecided."""
        if self.state is not VersionState.STAGING:
            return None
        if self.all_or_nothing and not self.committed:
            verdict = self._verdict(staged_acks=True)
            if verdict is None or verdict[0] is VersionState.READY:
                return None  # undecided, or due for its commit (``commit_due``)
            return verdict[0], f"not committed, no replica switched it (all-or-nothing): {verdict[1]}"
        verdict = self._verdict()
        if verdict is not None and verdict[0] is VersionState.READY and not self.sent:
            return None  # READY waits for the publisher's report of what it sent
        return verdict

    def _verdict(self, staged_acks: bool = False) -> tuple[VersionState, str] | None:
        """The ack policy's verdict; ``staged_acks`` counts staged replicas as acked (the commit's test)."""
        if not self.plans:
            if self.ready_without_acks:
                return VersionState.READY, "planned for no replica (the job's policy allows READY without acks)"
            return VersionState.FAILED, (
                "planned for no replica, so none acked it (no replica was registered and watching, or none shares "
                "a channel with the trainer; a job may allow this with policy ready_without_acks)"
            )
        staged = self.count(ReplicaState.STAGED)
        acked = self.count(ReplicaState.LOADED) + (staged if staged_acks else 0)
        failed = self.count(ReplicaState.FAILED)
        dropped = self.count(ReplicaState.DROPPED)
        waiting = self.count(ReplicaState.PLANNED) + self.count(ReplicaState.JOINED) + (0 if staged_acks else staged)
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
            if self.status.get(rid) is ReplicaState.FAILED:
                return f"; {rid}: {self.errors[rid]}"
        return ""

    def info(self, with_replicas: bool = True) -> VersionInfo:
        replicas = (
            tuple(
                ReplicaStatus(
                    rid,
                    self.outside[rid] if rid in self.outside else self.plans[rid].channel,
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
            manifest_checksum=self.manifest_checksum,
            table=self.table,
            reason=self.reason,
            opened_at=self.opened_at,
            settled_at=self.settled_at,
            replicas=replicas,
            content_digest=self.content_digest,
            durable_needed=self.durable_needed,
        )
