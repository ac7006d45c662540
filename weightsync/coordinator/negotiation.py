"""Negotiation: the best channel each replica shares with the trainer, and the memberships it forms.

Pure functions over registered capabilities and the trainer's offers, so every rule
is unit-tested without a server; the rules themselves are ``channels.rules.between``
(one place, shared with what each end checks of itself). Only channels the trainer
offered are negotiated.
The default preference (``models.DEFAULT_PREFERENCE``) is:

1. ``ipc``    - same host and every GPU of the replica is one the trainer's buffers live on (colocated);
2. ``nccl``   - the same non-empty NCCL domain on both ends (their GPUs reach each other over NCCL);
3. ``nixl``   - both ends have NIXL;
4. ``cpu``    - the replica runs a CPU engine;
5. ``volume`` - both mount the same volume (also the fallback after a channel failed).

A job may reorder or narrow the list (``JobPolicy.channel_preference``). A channel
that failed for a replica is skipped for that replica for a while (``jobs.Member.fail_channel``),
which is how "on failure -> volume" happens. Each live channel gets one membership per round (the
CPU stream one per replica: a gloo collective fails for every member when one dies):
the same members at the same endpoint keep their membership; any change mints a new
one, with the next generation (above the version's floor, so it survives a coordinator restart)
and a fresh secret, and the sender rebuilds. Ranks
follow replica id order, the trainer is rank 0, each replica takes
``capabilities.devices`` consecutive ranks.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.channels import rules
from weightsync.channels.base import Offer, Rendezvous
from weightsync.coordinator.models import LIVE_CHANNELS, Capabilities, ChannelPlan
from weightsync.jobconfig import DEFAULT_JOIN_TIMEOUT_S
from weightsync.vocabulary import Channel


@dataclass(frozen=True)
class Candidate:
    """A live replica as negotiation sees it."""

    replica_id: str
    incarnation: str
    capabilities: Capabilities
    failed_channels: frozenset[Channel] = frozenset()


PAIRWISE_CHANNELS = frozenset({Channel.CPU})
"""Live channels whose memberships hold one replica each. A gloo collective fails for every
member when one member dies, so the CPU stream gives each replica its own group (the
trainer broadcasts to all of them; a dead replica breaks only its own). NCCL keeps one
group per membership: a broadcast to many GPUs costs what one costs on NVLink."""

GENERATIONS_PER_VERSION = 1024
"""More than the memberships one round can mint (one per replica at most, ``state.MAX_MEMBERS_PER_JOB``):
version ``v`` mints generations above ``v * GENERATIONS_PER_VERSION``, so generations grow with the version
number, which a restarted coordinator recovers, and never repeat or go back across a restart."""

Members = tuple[tuple[str, str, int], ...]
"""(replica id, incarnation, devices) of each member, in rank order."""


@dataclass(frozen=True)
class Membership:
    members: Members
    endpoint: str
    group: str
    secret: str
    generation: int


@dataclass(frozen=True)
class GroupState:
    """The memberships of the previous round by key (the channel, or channel/replica for pairwise channels)."""

    memberships: Mapping[str, Membership] = field(default_factory=dict)
    minted: int = 0
    """The newest generation minted for the job."""

    def without(self, key: str) -> GroupState:
        """These memberships but ``key``'s: the next round mints a new generation for it even with the same members
        (a member was lost from its group, which its sender formed again without it: the survivors and the lost one
        must all join a new one, not the one they think they are in)."""
        return GroupState({k: m for k, m in self.memberships.items() if k != key}, self.minted)


def group_key(channel: Channel, replica_id: str, regions: bool = False) -> str:
    """The key of a replica's membership: its own for a pairwise channel, and its own for a replica the transfer
    plan sends regions (its region group holds the trainer's ranks and its workers, never another replica's; kept
    apart from the channel's gathered membership, which its sender forms without it)."""
    if regions:
        return f"{channel.value}-regions/{replica_id}"
    return f"{channel.value}/{replica_id}" if channel in PAIRWISE_CHANNELS else channel.value


def choose(
    trainer: Capabilities,
    offers: Mapping[Channel, Offer],
    replica: Candidate,
    preference: Sequence[Channel],
    in_nccl: frozenset[str] = frozenset(),
    own_group: bool = False,
) -> tuple[Channel | None, str]:
    """The first channel of ``preference`` that works, and a reason naming what was skipped. ``own_group``: the
    replica may take regions, in groups of its own (``rules.between``)."""
    skipped: list[str] = []
    for channel in preference:
        caps, failed = replica.capabilities, replica.failed_channels
        reason = rules.between(channel, trainer, offers.get(channel), caps, failed, in_nccl, own_group)
        if not reason:
            note = f"; skipped {', '.join(skipped)}" if skipped else ""
            return channel, f"{channel.value}{note}"
        skipped.append(f"{channel.value}: {reason}")
    return None, "no shared channel: " + "; ".join(skipped)


def negotiate(
    trainer: Capabilities,
    offers: Mapping[Channel, Offer],
    replicas: Sequence[Candidate],
    preference: Sequence[Channel],
    previous: GroupState,
    version: int = 0,
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
    regions: frozenset[str] = frozenset(),
) -> tuple[list[ChannelPlan], list[tuple[str, str]], GroupState]:
    """Plans for every replica that shares a channel, the (replica, reason) left out, and the new memberships
    (generations minted for ``version`` are above ``version * GENERATIONS_PER_VERSION``). Every live rendezvous
    carries the job's join deadline (``join_timeout_s``). ``regions``: the replicas the transfer plan may send
    regions, each in a membership of its own (``group_key``), which NCCL's one rank per GPU of the gathered group
    does not hold back (``rules.regions`` checks their GPUs against the trainer's ranks instead)."""
    chosen: list[tuple[Candidate, Channel, str]] = []
    unplanned: list[tuple[str, str]] = []
    in_nccl: frozenset[str] = frozenset()
    for replica in sorted(replicas, key=lambda r: r.replica_id):
        apart = replica.replica_id in regions
        channel, reason = choose(trainer, offers, replica, preference, in_nccl, apart)
        if channel is None:
            unplanned.append((replica.replica_id, reason))
        else:
            chosen.append((replica, channel, reason))
            if channel is Channel.NCCL and not apart:
                in_nccl |= set(replica.capabilities.gpu_uuids)

    members: dict[str, Members] = {}
    channel_of: dict[str, Channel] = {}
    for replica, channel, _ in chosen:
        if channel in LIVE_CHANNELS:
            key = group_key(channel, replica.replica_id, replica.replica_id in regions)
            entry = (replica.replica_id, replica.incarnation, replica.capabilities.devices)
            members[key], channel_of[key] = (*members.get(key, ()), entry), channel
    memberships: dict[str, Membership] = {}
    minted = max(previous.minted, version * GENERATIONS_PER_VERSION)
    for key in sorted(members):
        endpoint = str(offers[channel_of[key]].endpoint)
        old = previous.memberships.get(key)
        if old is not None and old.members == members[key] and old.endpoint == endpoint:
            memberships[key] = old
        else:
            minted += 1
            memberships[key] = Membership(
                members[key], endpoint, f"{key.replace('/', '-')}-{minted}", secrets.token_hex(16), minted
            )

    plans: list[ChannelPlan] = []
    next_rank: dict[str, int] = dict.fromkeys(members, 1)
    for replica, channel, reason in chosen:
        caps, offer = replica.capabilities, offers[channel]
        if channel in LIVE_CHANNELS:
            key = group_key(channel, replica.replica_id, replica.replica_id in regions)
            m = memberships[key]
            rdv = Rendezvous(
                channel,
                endpoint=offer.endpoint,
                group=m.group,
                secret=m.secret,
                generation=m.generation,
                rank=next_rank[key],
                world_size=1 + sum(devices for _, _, devices in m.members),
                agent=offer.agent,
                metadata=offer.metadata,
                epoch=offer.epoch,
                join_timeout_s=join_timeout_s,
            )
            next_rank[key] += caps.devices
        else:
            rdv = Rendezvous(channel, root=caps.volume_mount)
        plans.append(ChannelPlan(replica.replica_id, channel, rdv, reason))
    return plans, unplanned, GroupState(memberships, minted)
