"""What every part of the core shares: the jobs, the lease index, the clock, the store, the wake-up call.

``CoreState`` is the one object the core's modules (``leases``, ``versions``,
``verdicts``, ``durability``, ``streams``, ``reads``, ``reaper``) read and
mutate. It holds no lock of its own: the ``Coordinator`` facade holds the one
condition and calls into those modules only while holding it, so everything
here assumes the caller holds ``cond``.

Lookups raise the ``faults`` a client can act on (an unknown job names the known
ones; an unknown lease says to register again; a wrong role names the lease's
role). What clients can make it hold is bounded (``MAX_JOBS``, ``MAX_MEMBERS_PER_JOB``).
A job seen for the first time is recovered from the store: its versions,
their idempotency keys and the next version number, so numbers never repeat
across a restart.

``wake`` notifies the condition's waiters (``wait_version``). Callers use it
only when a waiter's condition can have changed (a version settled, receivers
joined, a version became durable or needs to be): an ack that changes nothing a
waiter looks at wakes nobody. ``dirty`` marks the gauges stale; the reaper's
tick and each /metrics scrape recompute them (``gauges.refresh``), not each ack.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

from weightsync import metrics as metrics_mod
from weightsync.coordinator import faults, gauges
from weightsync.coordinator.clock import Clock
from weightsync.coordinator.jobs import Job, Member
from weightsync.coordinator.lifecycle import VersionRecord
from weightsync.coordinator.models import JobPolicy, Role
from weightsync.coordinator.store import VersionStore
from weightsync.vocabulary import VersionState

log = logging.getLogger(__name__)
MAX_MEMBERS_PER_JOB = 512
"""Registered members (trainer and replicas) of one job: ``GetJob`` lists them all in one message."""
MAX_JOBS = 256


class CoreState:
    def __init__(
        self,
        *,
        cond: threading.Condition,
        clock: Clock,
        lease_ttl_s: float,
        default_policy: JobPolicy,
        store: VersionStore,
        metrics: metrics_mod.CoordinatorMetrics | None,
        volumes: dict[str, Path],
    ) -> None:
        self.cond = cond
        self.clock = clock
        self.lease_ttl_s = lease_ttl_s
        self.default_policy = default_policy
        self.store = store
        self.metrics = metrics
        self.volumes = volumes
        """Each job's checkpoint volume as this process mounts it (job -> root)."""
        self.jobs: dict[str, Job] = {}
        self.leases: dict[str, Member] = {}
        """Every live lease (lease id -> member): the members of all jobs."""
        self.dirty = True
        """The gauges no longer match the state."""
        self.started = clock.monotonic()
        """When this coordinator started: a job recovered from the store opens no version for one lease TTL."""

    def job(self, name: str, create: bool = False) -> Job:
        job = self.jobs.get(name)
        if job is not None:
            return job
        if not create:
            known = ", ".join(sorted(self.jobs)) or "none yet"
            raise faults.NotFound(f"job {name!r} is unknown (known jobs: {known}); register a trainer or replica first")
        if len(self.jobs) >= MAX_JOBS:
            raise faults.ResourceExhausted(
                f"this coordinator holds {len(self.jobs)} jobs, the most it may; run one coordinator per job"
            )
        job = Job(name, self.default_policy)
        for info in self.store.load(name):
            if info.state is VersionState.STAGING:  # its plans and watchers died with the process that had them
                info = dataclasses.replace(
                    info, state=VersionState.FAILED, reason="the coordinator restarted while this version was staging"
                )
            job.versions[info.version] = VersionRecord.from_info(info)
            job.keys[(info.incarnation, info.step)] = info.version
            job.next_version = max(job.next_version, info.version + 1)
        if job.versions:
            job.recovered = True
            ready = job.newest()
            log.info(
                "job %s: recovered %d versions (newest READY: %s)",
                name,
                len(job.versions),
                ready.version if ready else None,
            )
        self.jobs[name] = job
        self.dirty = True
        return job

    def member(self, lease_id: str, role: Role | None = None) -> Member:
        member = self.leases.get(lease_id)
        if member is None:
            raise faults.NotFound(f"lease {lease_id[:8]!r}... is unknown or expired; register again")
        if role is not None and member.role is not role:
            raise faults.PermissionDenied(
                f"lease of {member.member_id!r} is a {member.role.value} lease; this call needs a {role.value} lease"
            )
        return member

    def record(self, job: Job, version: int) -> VersionRecord:
        rec = job.versions.get(version)
        if rec is None:
            newest = max(job.versions, default=0)
            raise faults.NotFound(f"job {job.name!r} has no version {version} (newest is {newest})")
        return rec

    def wake(self) -> None:
        """Wake every ``wait_version`` caller to re-check its condition."""
        self.cond.notify_all()

    def refresh_gauges(self) -> None:
        self.dirty = False
        if self.metrics is not None:
            gauges.refresh(self.metrics, self.jobs.values())
