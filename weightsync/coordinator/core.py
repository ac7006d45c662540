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

import dataclasses
import logging
import queue
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from weightsync import metrics as metrics_mod
from weightsync.channels import manifests
from weightsync.channels.base import Offer, Rendezvous
from weightsync.coordinator import faults, gauges, lifecycle, negotiation
from weightsync.coordinator.jobs import Job, Member
from weightsync.coordinator.lifecycle import VersionRecord
from weightsync.coordinator.models import (
    LIVE_CHANNELS,
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
    Role,
    TableSummary,
    VersionInfo,
    WaitFor,
)
from weightsync.coordinator.store import MemoryStore, VersionStore
from weightsync.tensors import is_digest, manifest_checksum
from weightsync.vocabulary import Channel, ReplicaState, SyncPhase, VersionState

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
        volumes: Mapping[str, Path] | None = None,
    ) -> None:
        """``volumes``: each job's checkpoint volume as this process mounts it (job -> root). With one, the
        coordinator hashes the manifests itself when versions become durable and prunes the volume."""
        if lease_ttl_s <= 0:
            raise faults.InvalidArgument(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.lease_ttl_s = lease_ttl_s
        self.default_policy = default_policy or JobPolicy()
        self.volumes = {job: Path(root) for job, root in (volumes or {}).items()}
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
        offers: Sequence[Offer] = (),
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
                rec.set(member.member_id, ReplicaState.DROPPED)
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
        offers: Sequence[Offer] = (),
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
                if p.channel in LIVE_CHANNELS:  # volume plans are sent once the version is durable
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
            if progress is Progress.JOINED and rec.status.get(member.member_id) is ReplicaState.PLANNED:
                rec.set(member.member_id, ReplicaState.JOINED)
                if rec.receivers_joined():
                    self._cond.notify_all()

    def ack(self, lease_id: str, report: AckReport) -> VersionState:
        with self._cond:
            member = self._member(lease_id, Role.REPLICA)
            job = self._job(member.job)
            rec = self._record(job, report.version)
            rid = member.member_id
            ok, error = report.ok, report.error
            if ok and report.layout_digest != rec.table.layout_digest:
                ok, error = (
                    False,
                    f"layout_digest {report.layout_digest!r} does not match version {rec.version}'s "
                    f"{rec.table.layout_digest!r}: the replica loaded a different table",
                )
            if ok:
                error = self._content_mismatch(rec, rid, report.content_digest)
                ok = not error
            planned = rec.plans.get(rid)
            waiting = planned is not None and rec.status.get(rid) in lifecycle.WAITING
            fell_back = (
                planned is not None
                and waiting
                and not ok
                and report.channel_failed
                and self._fall_back(job, rec, member, planned, error)
            )
            if fell_back:
                self._dirty = True
                return rec.state
            member.last_failed = not ok
            if ok:
                member.current_version = max(member.current_version, rec.version)
                rec.content[rid] = report.content_digest
            if planned is not None and waiting:
                was_planned = rec.status[rid] is ReplicaState.PLANNED
                rec.set(rid, ReplicaState.LOADED if ok else ReplicaState.FAILED)
                if was_planned and rec.receivers_joined():
                    self._cond.notify_all()
                if error:
                    rec.errors[rid] = error
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

    def _content_mismatch(self, rec: VersionRecord, rid: str, digest: str) -> str:
        """Why a replica's content digest is wrong: not what the trainer sent, or (before the trainer's report
        arrived) not what other replicas loaded; empty when it agrees or there is nothing to compare."""
        if not digest:
            return ""
        if rec.content_digest:
            if digest != rec.content_digest:
                return (
                    f"content_digest {digest} is not the {rec.content_digest} the trainer sent: the bytes this "
                    "replica's engine loaded differ from the trainer's"
                )
            return ""
        others = {d for r, d in rec.content.items() if d and r != rid}
        if others and digest not in others:
            return f"content_digest {digest} differs from other replicas' {min(others)}: the bytes it loaded differ"
        return ""

    def _fall_back(self, job: Job, rec: VersionRecord, member: Member, planned: ChannelPlan, error: str) -> bool:
        """A live channel failed for this replica: plan it on the volume for this version (and skip the channel
        from now on). False when it cannot take the volume (no shared volume, or it was the volume)."""
        trainer = job.trainer()
        if planned.channel is Channel.VOLUME:
            return False
        member.failed_channels.add(planned.channel)
        reason = negotiation.why_not(
            Channel.VOLUME,
            trainer.capabilities if trainer else Capabilities(),
            trainer.offers.get(Channel.VOLUME) if trainer else None,
            negotiation.Candidate(member.member_id, member.incarnation, member.capabilities),
        )
        if reason:
            return False
        plan = ChannelPlan(
            member.member_id,
            Channel.VOLUME,
            Rendezvous(Channel.VOLUME, root=member.capabilities.volume_mount),
            f"volume: {planned.channel.value} failed ({error[:200]})",
            rec.manifest_checksum,
        )
        rec.replan(plan)
        rec.errors[member.member_id] = f"{planned.channel.value} failed, loading from the volume: {error}"
        log.warning("job %s v%d: %s", job.name, rec.version, rec.errors[member.member_id])
        if rec.durable:
            member.events.put(
                Assignment(EventKind.ASSIGN, job.name, rec.version, rec.step, plan, rec.table, plan.reason)
            )
        self._cond.notify_all()
        return True

    def report_sent(self, lease_id: str, version: int, content_digest: str, failed: Mapping[str, str]) -> VersionInfo:
        """The publisher sent ``version``: record what it sent, and fail replicas that loaded something else."""
        with self._cond:
            trainer = self._member(lease_id, Role.TRAINER)
            job = self._job(trainer.job)
            rec = self._record(job, version)
            if rec.incarnation != trainer.incarnation:
                raise faults.PermissionDenied(f"version {version} was opened by another trainer incarnation")
            rec.content_digest, rec.sent = content_digest, True
            for rid, why in failed.items():
                if rec.status.get(rid) in lifecycle.WAITING:
                    rec.errors.setdefault(rid, f"the trainer's sender lost it: {why}")
            for rid, digest in list(rec.content.items()):
                mismatch = self._content_mismatch(rec, rid, digest)
                if mismatch and rec.status.get(rid) is ReplicaState.LOADED and rec.state is VersionState.STAGING:
                    rec.set(rid, ReplicaState.FAILED)
                    rec.errors[rid] = mismatch
            self._settle(job, rec)
            self._dirty = True
            return rec.info()

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
                if rec.state in SETTLED_STATES:
                    return True
                if until is WaitFor.RECEIVERS_JOINED:
                    return rec.receivers_joined()
                return until is WaitFor.SETTLED_OR_DURABLE_NEEDED and rec.durable_needed

            while not met():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return rec.info(), met()

    def mark_durable(self, job_name: str, version: int, manifest_path: str, checksum: str) -> VersionInfo:
        """The version's volume copy landed. A coordinator that mounts the job's volume reads the manifest itself
        (from its own mount, never from the client's path) and records its checksum; otherwise it records the
        publisher's. Replicas planned on the volume for this version are sent it now."""
        if not is_digest(checksum):
            raise faults.InvalidArgument(
                f"manifest_checksum {checksum[:80]!r} is not sha256:<64 hex>; send tensors.manifest_checksum(bytes)"
            )
        with self._cond:
            self._record(self._job(job_name), version)  # NotFound before any file is read
        root = self.volumes.get(job_name)
        if root is not None:
            path = manifests.manifest_path(root, version)
            try:
                actual = manifest_checksum(path.read_bytes())
            except OSError as e:
                raise faults.FailedPrecondition(
                    f"version {version} of job {job_name!r} has no manifest on the coordinator's volume ({e}); "
                    "mark it durable once its copy landed"
                ) from None
            if actual != checksum:
                raise faults.InvalidArgument(
                    f"manifest_checksum {checksum} does not match version {version}'s manifest on the volume "
                    f"({actual}); hash the manifest after its final write"
                )
            manifest_path = str(path)
        with self._cond:
            job = self._job(job_name)
            rec = self._record(job, version)
            rec.durable, rec.manifest_path, rec.manifest_checksum = True, manifest_path, checksum
            for rid in rec.volume_waiting():
                member = job.members.get(rid)
                if member is not None:
                    plan = rec.plans[rid] = dataclasses.replace(rec.plans[rid], manifest_checksum=checksum)
                    member.events.put(
                        Assignment(EventKind.ASSIGN, job.name, rec.version, rec.step, plan, rec.table, plan.reason)
                    )
            self.store.save(rec.info(with_replicas=False))
            doomed = self._retire(job)
            self._cond.notify_all()
            info = rec.info()
        if root is not None and doomed:
            manifests.delete(root, doomed)
        return info

    def _retire(self, job: Job) -> list[int]:
        """Durable versions beyond the job's retention, forgotten as durable; the caller deletes them off the lock.

        Kept: the newest ``retention`` durable READY/SUPERSEDED versions (so always the newest durable READY one),
        and anything still STAGING. FAILED versions do not count toward what is kept.
        """
        if job.name not in self.volumes:
            return []
        good = [
            v
            for v in sorted(job.versions, reverse=True)
            if job.versions[v].durable and job.versions[v].state in (VersionState.READY, VersionState.SUPERSEDED)
        ]
        keep = set(good[: job.policy.retention])  # the newest durable READY version is good[0]
        doomed = []
        for v, rec in job.versions.items():
            if rec.durable and v not in keep and rec.state is not VersionState.STAGING:
                rec.durable, rec.manifest_path, rec.manifest_checksum = False, "", ""
                self.store.save(rec.info(with_replicas=False))
                doomed.append(v)
        return sorted(doomed)

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
                    Rendezvous(Channel.VOLUME, root=member.capabilities.volume_mount),
                    "catch up from the newest durable READY version",
                    newest.manifest_checksum,
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
                    if p.channel is Channel.VOLUME and not rec.durable:
                        continue  # sent when the version becomes durable
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
