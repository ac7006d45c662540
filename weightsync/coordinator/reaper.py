"""What time passing does: leases that were not renewed, versions that stayed STAGING too long.

The server's reaper thread calls ``Coordinator.tick()`` a few times per lease
TTL; tests call it after advancing a ``clock.ManualClock``. One tick reads the
clock once and applies both rules at that instant:

- a lease is dead from the instant its TTL ran out (``leases.expired``): the
  member is removed as if it left (``leases.remove``): a replica is dropped from
  every STAGING plan, a trainer's STAGING versions fail, its stream ends;
- a STAGING version fails from the instant ``policy.version_timeout_s`` has
  passed since it was opened, naming who it still waited for. Versions
  recovered from the store have no monotonic opening time (``opened_mono``
  0.0) and never time out here.

Both deadlines are kept as "start + duration <= now" (a lease's ``expires_at``,
a version's ``opened_mono + timeout``): the instant a test's clock reaches them
is the instant they pass. Both mark the gauges stale; the facade recomputes them
at the end of the tick.
"""

from __future__ import annotations

import logging

from weightsync.coordinator import leases, verdicts
from weightsync.coordinator.state import CoreState
from weightsync.vocabulary import VersionState

log = logging.getLogger(__name__)


def tick(state: CoreState, now: float) -> None:
    expire_leases(state, now)
    time_out_versions(state, now)


def expire_leases(state: CoreState, now: float) -> None:
    for member in [m for m in state.leases.values() if leases.expired(m, now)]:
        job = state.jobs[member.job]
        log.warning(
            "job %s: %s %s stopped renewing its lease; dropping it", member.job, member.role.value, member.member_id
        )
        if state.metrics:
            state.metrics.leases_expired_total.labels(member.role.value).inc()
        leases.remove(state, job, member, reason=f"{member.role.value} {member.member_id} lease expired")
        state.dirty = True


def time_out_versions(state: CoreState, now: float) -> None:
    for job in state.jobs.values():
        timeout = job.policy.version_timeout_s
        for rec in list(job.versions.values()):
            if rec.state is VersionState.STAGING and rec.opened_mono and now >= rec.opened_mono + timeout:
                publisher = [] if rec.sent else ["the publisher's report of what it sent"]
                waiting = ", ".join(rec.waiting() + publisher) or "nobody"
                verdicts.finish(
                    state, job, rec, VersionState.FAILED, f"timed out after {timeout:g}s waiting for {waiting}"
                )
                state.dirty = True
