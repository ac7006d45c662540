"""Members and their leases: who may register, what a re-registration keeps, what losing a member costs.

A member (a trainer or a replica) holds a lease from ``register`` until it stops
renewing: a lease lives ``lease_ttl_s`` on the core's monotonic clock from its
grant or last ``renew`` and is dead from that instant on (the reaper drops it on
its next tick; ``reaper.expire_leases``). Each registration mints a new lease id;
the old one of the same member is forgotten at once.

Registration rules:

- a job name is a DNS label-ish name (it becomes Kubernetes object names); the
  job is created, or recovered from the store, on its first registration;
- the same process reconnecting (same member id, incarnation and role) keeps its
  place in STAGING plans, the channels it failed on, its stream bookkeeping and
  the newest version it reported; a restart (new incarnation) is a new member,
  and its old self is removed as if its lease expired;
- one trainer per job: a new trainer replaces the old one (whose STAGING
  versions fail), and its policy, if it sends one, becomes the job's.

``remove`` is the one way a member leaves: its stream is ended, and unless it is
the same process reconnecting, a replica is dropped from every STAGING plan (its
slot no longer counts toward the ack policy, which may settle the version) and a
trainer's incarnation fails the versions it left STAGING.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence

from weightsync.channels.base import Offer
from weightsync.coordinator import faults, lifecycle, streams, verdicts
from weightsync.coordinator.jobs import Job, Member
from weightsync.coordinator.models import Capabilities, JobPolicy, Layout, Lease, Role
from weightsync.coordinator.state import MAX_MEMBERS_PER_JOB, CoreState
from weightsync.vocabulary import ReplicaState, VersionState

JOB_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")
MEMBER_ID = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.:]{0,251}[A-Za-z0-9])?$")
"""Pod names, host names and the like: they reach logs, metrics and Kubernetes status."""


def _require(value: str, name: str, fix: str) -> str:
    if not value:
        raise faults.InvalidArgument(f"{name} is empty; {fix}")
    return value


def check_registration(job_name: str, member_id: str, incarnation: str) -> None:
    """What ``register`` refuses before touching any state."""
    if not JOB_NAME.match(job_name):
        raise faults.InvalidArgument(
            f"job {job_name!r} is not a valid name; use lowercase letters, digits, '-' and '.', at most 63 chars"
        )
    _require(member_id, "member_id", "give each replica a unique id (e.g. its pod name)")
    if not MEMBER_ID.match(member_id):
        raise faults.InvalidArgument(
            f"member_id {member_id[:80]!r} is not a valid id; use letters, digits, '-', '_', '.' and ':' "
            "(starting and ending with a letter or digit), at most 253 chars, e.g. the pod name"
        )
    _require(incarnation, "incarnation", "send a fresh random id per process start")


def register(
    state: CoreState,
    job_name: str,
    role: Role,
    member_id: str,
    incarnation: str,
    capabilities: Capabilities,
    *,
    policy: JobPolicy | None,
    offers: Sequence[Offer],
    current_version: int,
    layout: Layout | None = None,
) -> Lease:
    check_registration(job_name, member_id, incarnation)
    job = state.job(job_name, create=True)
    old = job.members.get(member_id)
    if old is None and len(job.members) >= MAX_MEMBERS_PER_JOB:
        raise faults.ResourceExhausted(
            f"job {job_name!r} has {len(job.members)} registered members, the most one job may have; "
            "a member whose process ended leaves when its lease expires"
        )
    now = state.clock.monotonic()
    member = Member(
        job_name,
        member_id,
        role,
        incarnation,
        capabilities,
        secrets.token_hex(16),
        now + state.lease_ttl_s,
        current_version=current_version,
        offers={o.channel: o for o in offers},
        stream_seen=now,
        layout=layout,
    )
    if old is not None:
        # the same process reconnecting keeps its place in staging plans; a restart loses it
        same = old.incarnation == incarnation and old.role is role
        remove(
            state, job, old, reason=f"{member_id} registered again (incarnation {incarnation})", forget_work=not same
        )
        if same:
            # its old stream was closed with the old lease (and its end is not counted against this member):
            # the new member counts as watching from its registration until its own stream opens
            member.failed_channels = old.failed_channels
            member.current_version = max(current_version, old.current_version)
    if role is Role.TRAINER:
        other = job.trainer()
        if other is not None:
            remove(state, job, other, reason=f"trainer {member_id} replaced trainer {other.member_id}")
        if policy is not None:
            job.policy = policy
    job.members[member_id] = member
    state.leases[member.lease_id] = member
    state.dirty = True
    return Lease(member.lease_id, state.lease_ttl_s)


def renew(state: CoreState, lease_id: str) -> Lease:
    member = state.member(lease_id)
    member.expires_at = state.clock.monotonic() + state.lease_ttl_s
    return Lease(lease_id, state.lease_ttl_s)


def expired(member: Member, now: float) -> bool:
    """A lease is dead from the instant its TTL ran out."""
    return member.expires_at <= now


def remove(state: CoreState, job: Job, member: Member, reason: str, forget_work: bool = True) -> None:
    """Forget ``member``: close its stream, drop it from staging plans, fail its trainer's staging versions."""
    state.leases.pop(member.lease_id, None)
    if job.members.get(member.member_id) is member:
        del job.members[member.member_id]
    streams.close(member)
    if not forget_work:
        return
    for rec in list(job.versions.values()):
        if rec.state is not VersionState.STAGING:
            continue
        if member.role is Role.REPLICA and rec.status.get(member.member_id) in lifecycle.WAITING:
            rec.set(member.member_id, ReplicaState.DROPPED)
            rec.errors[member.member_id] = reason
            verdicts.settle(state, job, rec)
            state.wake()
        elif member.role is Role.TRAINER and rec.incarnation == member.incarnation:
            verdicts.finish(state, job, rec, VersionState.FAILED, f"trainer lost mid-publish: {reason}")
