"""The coordinator's state machine: jobs, members and their leases, versions, watchers.

No gRPC here: the servicer translates wire messages into calls on ``Coordinator``
and its exceptions (``faults``) into status codes, so every rule is testable in one
process. One lock guards everything; calls are short (no I/O but a few store
writes per version), so contention stays far below the RPC cost. Blocking waits
(``wait_version``) release it on a condition; replica streams read per-member
queues, so an ack wakes only whoever waits on that version.

Time: leases and version timeouts use ``time.monotonic``; the reaper thread
(``tick``) expires them. A replica that stops renewing is dropped from every
STAGING version's plan (its slot no longer counts for the ack policy); a trainer
that stops renewing fails the versions its incarnation left STAGING.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import re
import secrets
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from weightsync import metrics as metrics_mod
from weightsync.coordinator import faults, gauges, lifecycle, negotiation
from weightsync.coordinator.jobs import Job, Member
from weightsync.coordinator.lifecycle import VersionRecord
from weightsync.coordinator.models import (
    SETTLED_STATES,
    AckReport,
    Assignment,
    Capabilities,
    ChannelPlan,
    EventKind,
    JobInfo,
    JobPolicy,
    Lease,
    MemberInfo,
    OpenedVersion,
    Progress,
    Rendezvous,
    Role,
    SenderOffer,
    TableSummary,
    VersionInfo,
    WaitFor,
)
from weightsync.coordinator.store import MemoryStore, VersionStore
from weightsync.vocabulary import Channel, SyncPhase, VersionState

log = logging.getLogger(__name__)
JOB_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")
RETAIN_IN_MEMORY = 256


def _require(value: str, name: str, fix: str) -> str:
    if not value:
        raise faults.InvalidArgument(f"{name} is empty; {fix}")
    return value


class Coordinator:
    """Thread-safe control-plane state. Call ``tick()`` periodically (the server's reaper does)."""

    def __init__(
        self,
        *,
        lease_ttl_s: float = 10.0,
        default_policy: JobPolicy | None = None,
        store: VersionStore | None = None,
        metrics: metrics_mod.CoordinatorMetrics | None = None,
    ) -> None:
        if lease_ttl_s <= 0:
            raise faults.InvalidArgument(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.lease_ttl_s = lease_ttl_s
        self.default_policy = default_policy or JobPolicy()
        self.store: VersionStore = store if store is not None else MemoryStore()
        self.metrics = metrics
        self._cond = threading.Condition()
        self._jobs: dict[str, Job] = {}
        self._leases: dict[str, Member] = {}
        self._dirty = True
        with self._cond:
            for job in self.store.jobs():
                self._job(job, create=True)

    # ---- jobs and members -------------------------------------------------------------------------------------

    def _job(self, name: str, create: bool = False) -> Job:
        job = self._jobs.get(name)
        if job is not None:
            return job
        if not create:
            known = ", ".join(sorted(self._jobs)) or "none yet"
            raise faults.NotFound(f"job {name!r} is unknown (known jobs: {known}); register a trainer or replica first")
        job = Job(name, self.default_policy)
        for info in self.store.load(name):
            job.versions[info.version] = VersionRecord.from_info(info)
            job.keys[(info.incarnation, info.step)] = info.version
            job.next_version = max(job.next_version, info.version + 1)
        if job.versions:
            ready = job.newest()
            log.info(
                "job %s: recovered %d versions (newest READY: %s)",
                name,
                len(job.versions),
                ready.version if ready else None,
            )
        self._jobs[name] = job
        self._dirty = True
        return job

    def register(
        self,
        job_name: str,
        role: Role,
        member_id: str,
        incarnation: str,
        capabilities: Capabilities,
        *,
        policy: JobPolicy | None = None,
        offers: Sequence[SenderOffer] = (),
        current_version: int = 0,
    ) -> Lease:
        if not JOB_NAME.match(job_name):
            raise faults.InvalidArgument(
                f"job {job_name!r} is not a valid name; use lowercase letters, digits, '-' and '.', at most 63 chars"
            )
        _require(member_id, "member_id", "give each replica a unique id (e.g. its pod name)")
        _require(incarnation, "incarnation", "send a fresh random id per process start")
        with self._cond:
            job = self._job(job_name, create=True)
            old = job.members.get(member_id)
            member = Member(
                job_name,
                member_id,
                role,
                incarnation,
                capabilities,
                secrets.token_hex(16),
                time.monotonic() + self.lease_ttl_s,
                current_version=current_version,
                offers={o.channel: o for o in offers},
            )
            if old is not None:
                # the same process reconnecting keeps its place in staging plans; a restart loses it
                same = old.incarnation == incarnation and old.role is role
                self._remove(
                    job, old, reason=f"{member_id} registered again (incarnation {incarnation})", forget_work=not same
                )
                if same:
                    member.failed_channels = old.failed_channels
                    member.streams, member.stream_seen = old.streams, old.stream_seen
                    member.current_version = max(current_version, old.current_version)
            if role is Role.TRAINER:
                other = job.trainer()
                if other is not None:
                    self._remove(job, other, reason=f"trainer {member_id} replaced trainer {other.member_id}")
                if policy is not None:
                    job.policy = policy
            job.members[member_id] = member
            self._leases[member.lease_id] = member
            self._dirty = True
            return Lease(member.lease_id, self.lease_ttl_s)

    def _member(self, lease_id: str, role: Role | None = None) -> Member:
        member = self._leases.get(lease_id)
        if member is None:
            raise faults.NotFound(f"lease {lease_id[:8]!r}... is unknown or expired; register again")
        if role is not None and member.role is not role:
            raise faults.PermissionDenied(
                f"lease of {member.member_id!r} is a {member.role.value} lease; this call needs a {role.value} lease"
            )
        return member

    def renew(self, lease_id: str) -> Lease:
        with self._cond:
            member = self._member(lease_id)
            member.expires_at = time.monotonic() + self.lease_ttl_s
            return Lease(lease_id, self.lease_ttl_s)

    def _remove(self, job: Job, member: Member, reason: str, forget_work: bool = True) -> None:
        """Forget ``member``: close its stream, drop it from staging plans, fail its trainer's staging versions."""
        self._leases.pop(member.lease_id, None)
        if job.members.get(member.member_id) is member:
            del job.members[member.member_id]
        member.events.put(None)
        if not forget_work:
            return
        for rec in list(job.versions.values()):
            if rec.state is not VersionState.STAGING:
                continue
            if member.role is Role.REPLICA and rec.status.get(member.member_id) in lifecycle.WAITING:
                rec.set(member.member_id, lifecycle.DROPPED)
                rec.errors[member.member_id] = reason
                self._settle(job, rec)
                self._cond.notify_all()
            elif member.role is Role.TRAINER and rec.incarnation == member.incarnation:
                self._finish(job, rec, VersionState.FAILED, f"trainer lost mid-publish: {reason}")

    # ---- versions ---------------------------------------------------------------------------------------------

    def open_version(
        self,
        lease_id: str,
        job_name: str,
        incarnation: str,
        step: int,
        table: TableSummary,
        offers: Sequence[SenderOffer] = (),
    ) -> OpenedVersion:
        with self._cond:
            job = self._job(job_name)
            trainer = self._member(lease_id, Role.TRAINER)
            if trainer.job != job_name:
                raise faults.PermissionDenied(f"lease belongs to job {trainer.job!r}, not {job_name!r}")
            if incarnation != trainer.incarnation:
                raise faults.InvalidArgument(
                    f"incarnation {incarnation!r} differs from the registered {trainer.incarnation!r}; "
                    "register again after a restart"
                )
            key = (incarnation, step)
            if key in job.keys and job.keys[key] in job.versions:
                rec = job.versions[job.keys[key]]
                return OpenedVersion(rec.version, tuple(rec.plans[r] for r in sorted(rec.plans)), reused=True)
            last = job.last_step.get(incarnation)
            if last is not None and step < last:
                raise faults.FailedPrecondition(
                    f"step {step} goes backwards: incarnation {incarnation!r} already published step {last}; "
                    "versions never go backwards (register a new incarnation to publish from an older step)"
                )
            all_offers = {**trainer.offers, **{o.channel: o for o in offers}}
            now = time.monotonic()
            candidates = [
                negotiation.Candidate(m.member_id, m.incarnation, m.capabilities, frozenset(m.failed_channels))
                for m in job.members.values()
                if m.role is Role.REPLICA and self._listening(m, now)
            ]
            plans, unplanned, job.groups = negotiation.negotiate(
                trainer.capabilities, all_offers, candidates, job.policy.channel_preference, job.groups
            )
            rec = VersionRecord(
                job_name,
                job.next_version,
                step,
                incarnation,
                table,
                {p.replica_id: p for p in plans},
                quorum=job.policy.ack_quorum,
            )
            job.next_version += 1
            job.versions[rec.version] = rec
            job.keys[key] = rec.version
            job.last_step[incarnation] = step
            for rid, reason in unplanned:
                log.warning("job %s v%d: replica %s left out: %s", job_name, rec.version, rid, reason)
            if self.metrics:
                for p in plans:
                    self.metrics.negotiations_total.labels(p.channel.value).inc()
                for _ in unplanned:
                    self.metrics.negotiations_total.labels(metrics_mod.NEGOTIATION_NONE).inc()
            for p in plans:
                job.members[p.replica_id].events.put(
                    Assignment(EventKind.ASSIGN, job_name, rec.version, step, p, table, p.reason)
                )
            self.store.save(rec.info(with_replicas=False))
            self._settle(job, rec)
            self._trim(job)
            self._dirty = True
            return OpenedVersion(rec.version, tuple(plans))

    def _record(self, job: Job, version: int) -> VersionRecord:
        rec = job.versions.get(version)
        if rec is None:
            newest = max(job.versions, default=0)
            raise faults.NotFound(f"job {job.name!r} has no version {version} (newest is {newest})")
        return rec

    def report_progress(self, lease_id: str, version: int, progress: Progress) -> None:
        with self._cond:
            member = self._member(lease_id, Role.REPLICA)
            rec = self._record(self._job(member.job), version)
            if progress is Progress.READY_TO_RECEIVE and rec.status.get(member.member_id) == lifecycle.PLANNED:
                rec.set(member.member_id, lifecycle.READY)
                if rec.receivers_ready():
                    self._cond.notify_all()

    def ack(self, lease_id: str, report: AckReport) -> VersionState:
        with self._cond:
            member = self._member(lease_id, Role.REPLICA)
            job = self._job(member.job)
            rec = self._record(job, report.version)
            rid = member.member_id
            ok, error = report.ok, report.error
            if ok and report.table_digest != rec.table.table_digest:
                ok, error = (
                    False,
                    (
                        f"table_digest {report.table_digest!r} does not match version {rec.version}'s "
                        f"{rec.table.table_digest!r}: the replica loaded a different table"
                    ),
                )
            if ok and report.content_digest:
                others = {d for r, d in rec.content.items() if d and r != rid}
                if others and report.content_digest not in others:
                    ok, error = (
                        False,
                        (
                            f"content_digest {report.content_digest} differs from other replicas' "
                            f"{min(others)}: the bytes this replica loaded differ"
                        ),
                    )
            member.last_failed = not ok
            if ok:
                member.current_version = max(member.current_version, rec.version)
                rec.content[rid] = report.content_digest
            planned = rec.plans.get(rid)
            if planned is not None and rec.status.get(rid) in lifecycle.WAITING:
                was_planned = rec.status[rid] == lifecycle.PLANNED
                rec.set(rid, lifecycle.ACKED if ok else lifecycle.FAILED)
                if was_planned and rec.receivers_ready():
                    self._cond.notify_all()
                if error:
                    rec.errors[rid] = error
                if report.channel_failed and planned.channel is not Channel.VOLUME:
                    member.failed_channels.add(planned.channel)
                if self.metrics:
                    for phase, seconds in report.phases.items():
                        self.metrics.sync_seconds.labels(phase.value, planned.channel.value).observe(seconds)
                    if ok:
                        self.metrics.bytes_total.labels(planned.channel.value).inc(rec.table.total_bytes)
                self._settle(job, rec)
            elif self.metrics and ok and SyncPhase.TOTAL in report.phases:  # a catch-up from the volume
                self.metrics.sync_seconds.labels(SyncPhase.TOTAL.value, Channel.VOLUME.value).observe(
                    report.phases[SyncPhase.TOTAL]
                )
            self._dirty = True
            return rec.state

    def _settle(self, job: Job, rec: VersionRecord) -> None:
        verdict = rec.settle()
        if verdict is not None:
            self._finish(job, rec, *verdict)

    def _finish(self, job: Job, rec: VersionRecord, state: VersionState, reason: str) -> None:
        rec.state, rec.reason, rec.settled_at = state, reason, time.time()
        log.info("job %s v%d %s: %s", job.name, rec.version, state.value, reason)
        if self.metrics:
            self.metrics.version_transitions_total.labels(state.value).inc()
            if state is VersionState.READY:
                self.metrics.version_ready_seconds.observe(time.monotonic() - rec.opened_mono)
        if state is VersionState.READY:
            for older in job.versions.values():
                if older.version < rec.version and older.state in (VersionState.READY, VersionState.STAGING):
                    older.state, older.settled_at = VersionState.SUPERSEDED, time.time()
                    older.reason = f"version {rec.version} is READY"
                    if self.metrics:
                        self.metrics.version_transitions_total.labels(VersionState.SUPERSEDED.value).inc()
                    self.store.save(older.info(with_replicas=False))
        elif state is VersionState.FAILED:
            for rid in rec.waiting():
                member = job.members.get(rid)
                if member is not None:
                    member.events.put(
                        Assignment(EventKind.ABORT, job.name, rec.version, rec.step, rec.plans[rid], rec.table, reason)
                    )
        self.store.save(rec.info(with_replicas=False))
        self._cond.notify_all()

    def wait_version(self, job_name: str, version: int, until: WaitFor, timeout_s: float) -> tuple[VersionInfo, bool]:
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            job = self._job(job_name)
            rec = self._record(job, version)

            def met() -> bool:
                if until is WaitFor.RECEIVERS_READY:
                    return rec.receivers_ready() or rec.state in SETTLED_STATES
                return rec.state in SETTLED_STATES

            while not met():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return rec.info(), met()

    def mark_durable(self, job_name: str, version: int, manifest_path: str, manifest_sha256: str) -> VersionInfo:
        _require(manifest_path, "manifest_path", "send the path of the version's manifest.json on the volume")
        if not re.fullmatch(r"[0-9a-f]{64}", manifest_sha256):
            raise faults.InvalidArgument(
                f"manifest_sha256 {manifest_sha256[:80]!r} is not 64 lowercase hex digits; "
                "send hashlib.sha256(manifest_bytes).hexdigest()"
            )
        local = Path(manifest_path)
        if local.is_file():  # the coordinator mounts the volume at the same path: check the claim
            actual = hashlib.sha256(local.read_bytes()).hexdigest()
            if actual != manifest_sha256:
                raise faults.InvalidArgument(
                    f"manifest_sha256 {manifest_sha256} does not match {manifest_path} (sha256 {actual}); "
                    "hash the manifest after its final write"
                )
        with self._cond:
            job = self._job(job_name)
            rec = self._record(job, version)
            rec.durable, rec.manifest_path, rec.manifest_sha256 = True, manifest_path, manifest_sha256
            self.store.save(rec.info(with_replicas=False))
            self._cond.notify_all()
            return rec.info()

    def subscribe(self, lease_id: str) -> queue.SimpleQueue[Assignment | None]:
        """A fresh event queue for the member's new stream (ending any previous one), primed with a catch-up
        and any staging assignment it missed, then the old queue's unread events (an ABORT sent while no
        stream was open, say). The agent may see a version twice: it dedupes by version number."""
        with self._cond:
            member = self._member(lease_id, Role.REPLICA)
            job = self._job(member.job)
            # one queue per stream: a stale stream still draining must not steal the new stream's events
            old, member.events = member.events, queue.SimpleQueue()
            member.streams += 1
            carried = _drain(old)  # events queued between the old stream's end and now (an ABORT, say)
            old.put(None)
            newest = job.newest(durable=True)
            if newest is not None and newest.version > member.current_version and member.capabilities.volume_mount:
                plan = ChannelPlan(
                    member.member_id,
                    Channel.VOLUME,
                    Rendezvous(volume_path=member.capabilities.volume_mount),
                    "catch up from the newest durable READY version",
                )
                member.events.put(
                    Assignment(
                        EventKind.CATCH_UP, job.name, newest.version, newest.step, plan, newest.table, plan.reason
                    )
                )
            for event in carried:
                member.events.put(event)
            for rec in job.versions.values():
                if rec.state is VersionState.STAGING and rec.status.get(member.member_id) in lifecycle.WAITING:
                    p = rec.plans[member.member_id]
                    member.events.put(
                        Assignment(EventKind.ASSIGN, job.name, rec.version, rec.step, p, rec.table, p.reason)
                    )
            return member.events

    def stream_ended(self, lease_id: str) -> None:
        """The servicer calls this when a watch stream of ``lease_id`` ends, however it ends."""
        with self._cond:
            member = self._leases.get(lease_id)
            if member is not None:
                member.streams = max(0, member.streams - 1)
                member.stream_seen = time.monotonic()

    def _listening(self, member: Member, now: float) -> bool:
        """Planned only if it watches (or did within one lease TTL: a re-open, a fresh registration).

        A replica whose agent renews its lease but no longer reads its stream would otherwise be
        planned and hold every version STAGING until the version timeout.
        """
        return member.streams > 0 or now - member.stream_seen < self.lease_ttl_s

    # ---- reads ------------------------------------------------------------------------------------------------

    def get_job(self, job_name: str) -> JobInfo:
        with self._cond:
            job = self._job(job_name)
            now = time.monotonic()
            ready, durable = job.newest(), job.newest(durable=True)
            members = tuple(
                MemberInfo(
                    m.member_id, m.role, m.incarnation, m.current_version, max(0.0, m.expires_at - now), m.capabilities
                )
                for m in sorted(job.members.values(), key=lambda m: (m.role.value, m.member_id))
            )
            return JobInfo(
                job.name, job.policy, ready.version if ready else 0, durable.version if durable else 0, members
            )

    def list_versions(self, job_name: str, limit: int = 0) -> list[VersionInfo]:
        with self._cond:
            job = self._job(job_name)
            numbers = sorted(job.versions, reverse=True)
            return [job.versions[v].info() for v in (numbers[:limit] if limit else numbers)]

    def jobs(self) -> list[str]:
        with self._cond:
            return sorted(self._jobs)

    # ---- time ---------------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Expire leases that were not renewed and versions that stayed STAGING too long; refresh the gauges."""
        now = time.monotonic()
        with self._cond:
            self._tick(now)
            if self._dirty:
                self._refresh()

    def refresh_metrics(self) -> None:
        """Recompute the gauges now (a /metrics scrape calls it; so does every tick when something changed)."""
        with self._cond:
            self._refresh()

    def _tick(self, now: float) -> None:
        for member in [m for m in self._leases.values() if m.expires_at < now]:
            job = self._jobs[member.job]
            log.warning(
                "job %s: %s %s stopped renewing its lease; dropping it", member.job, member.role.value, member.member_id
            )
            if self.metrics:
                self.metrics.leases_expired_total.labels(member.role.value).inc()
            self._remove(job, member, reason=f"{member.role.value} {member.member_id} lease expired")
            self._dirty = True
        for job in self._jobs.values():
            for rec in list(job.versions.values()):
                if (
                    rec.state is VersionState.STAGING
                    and rec.opened_mono
                    and now - rec.opened_mono > job.policy.version_timeout_s
                ):
                    waiting = ", ".join(rec.waiting()) or "nobody"
                    self._finish(
                        job,
                        rec,
                        VersionState.FAILED,
                        f"timed out after {job.policy.version_timeout_s:g}s waiting for {waiting}",
                    )
                    self._dirty = True

    def _trim(self, job: Job) -> None:
        keep = RETAIN_IN_MEMORY
        if len(job.versions) <= keep:
            return
        durable = job.newest(durable=True)
        for v in sorted(job.versions)[:-keep]:
            if job.versions[v].state is not VersionState.STAGING and (durable is None or v != durable.version):
                rec = job.versions.pop(v)
                job.keys.pop((rec.incarnation, rec.step), None)

    def _refresh(self) -> None:
        self._dirty = False
        if self.metrics is not None:
            gauges.refresh(self.metrics, self._jobs.values())


def _drain(events: queue.SimpleQueue[Assignment | None]) -> list[Assignment]:
    """Everything queued and not yet consumed (end-of-stream markers dropped)."""
    out: list[Assignment] = []
    while True:
        try:
            item = events.get_nowait()
        except queue.Empty:
            return out
        if item is not None:
            out.append(item)
