"""The coordinator's gauges, recomputed from its state: versions and replicas by state, fleet lag.

O(versions + members), so the core runs it on reaper ticks and on each /metrics
scrape rather than on every ack: at 64 replicas a per-ack refresh was a visible
share of a sync's control-plane time. Lag is counted in version numbers: the
newest READY version's number minus the one a live replica serves.
"""

from __future__ import annotations

from collections.abc import Iterable

from weightsync import metrics as metrics_mod
from weightsync.coordinator.jobs import Job
from weightsync.coordinator.models import Role
from weightsync.vocabulary import ReplicaHealth, VersionState


def refresh(m: metrics_mod.CoordinatorMetrics, jobs: Iterable[Job]) -> None:
    counts = dict.fromkeys(VersionState, 0)
    states = dict.fromkeys(ReplicaHealth, 0)
    lag_max, lagging = 0, 0
    for j in jobs:
        for rec in j.versions.values():
            counts[rec.state] += 1
        ready = j.newest()
        syncing = {r for rec in j.versions.values() if rec.state is VersionState.STAGING for r in rec.waiting()}
        for member in j.members.values():
            if member.role is not Role.REPLICA:
                continue
            lag = ready.version - member.current_version if ready and member.current_version < ready.version else 0
            lag_max, lagging = max(lag_max, lag), lagging + (lag > 0)
            if member.last_failed:
                states[ReplicaHealth.FAILED] += 1
            elif member.member_id in syncing:
                states[ReplicaHealth.SYNCING] += 1
            elif ready is None and member.current_version == 0:
                states[ReplicaHealth.REGISTERED] += 1
            else:
                states[ReplicaHealth.LAGGING if lag else ReplicaHealth.CURRENT] += 1
    for state, n in counts.items():
        m.versions.labels(state.value).set(n)
    for name, n in states.items():
        m.replicas.labels(name.value).set(n)
    m.fleet_version_lag_max.set(lag_max)
    m.fleet_replicas_lagging.set(lagging)
