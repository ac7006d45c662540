"""Replica watch streams: each member's event queue, what a new stream replays, who counts as watching.

A replica's agent reads its plans from one server stream (``WatchVersions``).
The core never talks to a stream directly: it puts ``Assignment`` events on the
member's ``events`` queue, and the servicer's stream handler drains it. ``None``
on a queue ends the stream that reads it (the lease was dropped or replaced, or a
newer stream took over).

One queue per stream: ``subscribe`` gives each new stream a fresh queue and ends
the previous one, so a stale stream still draining cannot steal the new one's
events. The new queue is primed, in order, with a catch-up to the newest durable
READY version (when the replica serves an older one and mounts the volume), the
old queue's unread events (an ABORT sent while no stream was open, say), and the
assignment of every STAGING version the replica is still planned for (volume
plans only once the version is durable: that is when they are sent). An agent
may therefore see a version twice; it dedupes by version number.

Watching: a replica is planned for a new version only while it has a stream
open, or had one within one lease TTL (a re-open, a fresh registration). An agent
that renews its lease but stopped reading its stream would otherwise be planned
and hold every version STAGING until the version timeout.
"""

from __future__ import annotations

import queue

from weightsync.channels.base import Rendezvous
from weightsync.coordinator import lifecycle
from weightsync.coordinator.jobs import Job, Member
from weightsync.coordinator.lifecycle import VersionRecord
from weightsync.coordinator.models import Assignment, ChannelPlan, EventKind, Role
from weightsync.coordinator.state import CoreState
from weightsync.vocabulary import Channel, ReplicaState, VersionState

Events = queue.SimpleQueue[Assignment | None]


def assign(member: Member, job: Job, rec: VersionRecord, plan: ChannelPlan) -> None:
    """Send ``member`` its plan for ``rec`` (ASSIGN)."""
    member.events.put(
        Assignment(
            EventKind.ASSIGN,
            job.name,
            rec.version,
            rec.step,
            plan,
            rec.table,
            plan.reason,
            await_commit=rec.all_or_nothing,
        )
    )


def commit(member: Member, job: Job, rec: VersionRecord) -> None:
    """Tell staged ``member`` to switch ``rec`` in (COMMIT): the replicas the ack policy needs staged it."""
    plan = rec.plans[member.member_id]
    reason = "the replicas the ack policy needs staged it"
    member.events.put(Assignment(EventKind.COMMIT, job.name, rec.version, rec.step, plan, rec.table, reason))


def abort(member: Member, job: Job, rec: VersionRecord, reason: str) -> None:
    """Tell ``member`` to stop loading ``rec`` (ABORT): the version failed."""
    plan = rec.plans[member.member_id]
    member.events.put(Assignment(EventKind.ABORT, job.name, rec.version, rec.step, plan, rec.table, reason))


def close(member: Member) -> None:
    """End the stream reading ``member``'s current queue (its lease is gone)."""
    member.events.put(None)


def subscribe(state: CoreState, lease_id: str) -> Events:
    member = state.member(lease_id, Role.REPLICA)
    job = state.job(member.job)
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
            Assignment(EventKind.CATCH_UP, job.name, newest.version, newest.step, plan, newest.table, plan.reason)
        )
        member.catching_up = newest.version  # retention keeps it until the replica answered
    for event in carried:
        member.events.put(event)
    for rec in job.versions.values():
        if rec.state is VersionState.STAGING and rec.status.get(member.member_id) in lifecycle.WAITING:
            p = rec.plans[member.member_id]
            if p.channel is Channel.VOLUME and not rec.durable:
                continue  # sent when the version becomes durable
            if rec.committed and rec.status[member.member_id] is ReplicaState.STAGED:
                commit(member, job, rec)
            else:  # an agent that still holds the stage reports it staged again; one that lost it stages again
                assign(member, job, rec, p)
    return member.events


def stream_ended(state: CoreState, lease_id: str) -> None:
    member = state.leases.get(lease_id)
    if member is not None:
        member.streams = max(0, member.streams - 1)
        member.stream_seen = state.clock.monotonic()


def listening(state: CoreState, member: Member, now: float) -> bool:
    """Watching now, or within one lease TTL of its registration or its last stream's end."""
    return member.streams > 0 or now - member.stream_seen < state.lease_ttl_s


def _drain(events: Events) -> list[Assignment]:
    """Everything queued and not yet consumed (end-of-stream markers dropped)."""
    out: list[Assignment] = []
    while True:
        try:
            item = events.get_nowait()
        except queue.Empty:
            return out
        if item is not None:
            out.append(item)
