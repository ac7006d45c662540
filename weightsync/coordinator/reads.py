"""What the core answers without changing anything: a job's summary, its versions, the jobs it knows.

These serve ``GetJob`` and ``ListVersions`` (CLIs, the operator, the Kubernetes
store's replica details) and never block on anything but the core's lock. A
member's remaining lease is reported from the core's clock, floored at zero: a
lease at zero is dead and gone at the reaper's next tick. Versions are listed
newest first; ``limit`` 0 lists every version the job keeps in memory.
"""

from __future__ import annotations

from weightsync.coordinator.models import JobInfo, MemberInfo, VersionInfo
from weightsync.coordinator.state import CoreState


def get_job(state: CoreState, job_name: str) -> JobInfo:
    job = state.job(job_name)
    now = state.clock.monotonic()
    ready, durable = job.newest(), job.newest(durable=True)
    members = tuple(
        MemberInfo(m.member_id, m.role, m.incarnation, m.current_version, max(0.0, m.expires_at - now), m.capabilities)
        for m in sorted(job.members.values(), key=lambda m: (m.role.value, m.member_id))
    )
    return JobInfo(job.name, job.policy, ready.version if ready else 0, durable.version if durable else 0, members)


def list_versions(state: CoreState, job_name: str, limit: int = 0) -> list[VersionInfo]:
    job = state.job(job_name)
    numbers = sorted(job.versions, reverse=True)
    return [job.versions[v].info() for v in (numbers[:limit] if limit else numbers)]


def job_names(state: CoreState) -> list[str]:
    return sorted(state.jobs)
