"""Settling a version: applying the ack policy's verdict, and what a verdict does to the rest of the job.

``lifecycle.VersionRecord.settle`` decides, from the record alone, whether a
STAGING version is now READY, FAILED or undecided. This module acts on it:

- every verdict is stamped (``settled_at``, wall time from the clock), logged,
  counted (``version_transitions_total``), saved to the store, and wakes the
  ``wait_version`` callers;
- READY supersedes every older READY or still-STAGING version of the job (saved
  too): a job has one newest READY version, and versions never go backwards; a
  superseded READY version keeps the time it became READY (``settled_at``), one
  superseded while STAGING settles now;
- FAILED sends an ABORT to every replica the version was planned for that is
  still alive: one still waiting on it stops at once instead of at its own
  timeout (and a staged replica of an all-or-nothing job drops its stage); one
  whose engine loaded it (its ack counted or refused) goes back to the newest
  durable READY version, for a FAILED version is served by no replica (the
  agent's ``roll_back``; the agent knows what its engine holds).

Before a verdict, an all-or-nothing version whose policy is met by staged
replicas is committed: each staged replica gets a COMMIT (``streams.commit``);
one that stages it later gets its COMMIT as it reports staged.

``finish`` is also how the rest of the core fails a version outright, without a
verdict: the trainer that opened it was lost (``leases``), or it stayed STAGING
past the job's ``version_timeout_s`` (``reaper``).
"""

from __future__ import annotations

import logging

from weightsync.coordinator import streams
from weightsync.coordinator.jobs import Job
from weightsync.coordinator.lifecycle import VersionRecord
from weightsync.coordinator.state import CoreState
from weightsync.vocabulary import VersionState

log = logging.getLogger(__name__)


def settle(state: CoreState, job: Job, rec: VersionRecord) -> None:
    """Commit ``rec`` or finish it if its ack policy is now decided."""
    if rec.commit_due():
        rec.committed = True
        log.info("job %s v%d committed: replicas %s switch it in", job.name, rec.version, ", ".join(rec.staged()))
        for rid in rec.staged():
            member = job.members.get(rid)
            if member is not None:
                streams.commit(member, job, rec)
    verdict = rec.settle()
    if verdict is not None:
        finish(state, job, rec, *verdict)


def finish(state: CoreState, job: Job, rec: VersionRecord, outcome: VersionState, reason: str) -> None:
    rec.state, rec.reason, rec.settled_at = outcome, reason, state.clock.time()
    log.info("job %s v%d %s: %s", job.name, rec.version, outcome.value, reason)
    metrics = state.metrics
    if metrics:
        metrics.version_transitions_total.labels(outcome.value).inc()
        if outcome is VersionState.READY:
            metrics.version_ready_seconds.observe(state.clock.monotonic() - rec.opened_mono)
    if outcome is VersionState.READY:
        for older in job.versions.values():
            if older.version < rec.version and older.state in (VersionState.READY, VersionState.STAGING):
                if older.state is VersionState.STAGING:
                    older.settled_at = state.clock.time()
                older.state = VersionState.SUPERSEDED
                older.reason = f"version {rec.version} is READY"
                if metrics:
                    metrics.version_transitions_total.labels(VersionState.SUPERSEDED.value).inc()
                state.store.save(older.info(with_replicas=False))
    elif outcome is VersionState.FAILED:
        for rid in sorted(rec.status):
            member = job.members.get(rid)
            if member is not None:
                streams.abort(member, job, rec, reason)
    state.store.save(rec.info(with_replicas=False))
    state.wake()
