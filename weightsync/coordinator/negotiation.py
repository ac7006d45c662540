"""Negotiation: the best channel each replica shares with the trainer, and the groups it forms.

Pure functions over registered capabilities, so every rule is unit-tested without
a server. The default preference (``models.DEFAULT_PREFERENCE``) is:

1. ``ipc``    - same host and every GPU of the replica is one of the trainer's (colocated);
2. ``nccl``   - both GPU, same non-empty NCCL domain, and the trainer offered a rendezvous this round;
3. ``nixl``   - both ends have NIXL;
4. ``cpu``    - the replica runs a CPU engine and the trainer offered a rendezvous;
5. ``volume`` - both mount the same volume (also the fallback after a channel failed).

A job may reorder or narrow the list (``JobPolicy.channel_preference``). A channel
that failed for a replica is skipped for that replica from then on, which is how
"on failure -> volume" happens. Group channels (``nccl``, ``cpu``) get one group per
membership: the same members at the same rendezvous keep their group id, any
change mints a new id, and the publisher rebuilds its sender when the id changes.
Ranks follow replica id order, the trainer is rank 0, each replica takes
``capabilities.devices`` consecutive ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.coordinator.models import (
    GROUP_CHANNELS,
    Capabilities,
    ChannelPlan,
    EngineKind,
    Rendezvous,
    SenderOffer,
)
from weightsync.vocabulary import Channel


@dataclass(frozen=True)
class Candidate:
    """A live replica as negotiation sees it."""

    replica_id: str
    incarnation: str
    capabilities: Capabilities
    failed_channels: frozenset[Channel] = frozenset()


PAIRWISE_CHANNELS = frozenset({Channel.CPU})
"""Group channels whose groups hold one replica each. A gloo collective fails for every
member when one member dies, so the CPU stream gives each replica its own group (the
trainer broadcasts to all of them; a dead replica breaks only its own). NCCL keeps one
group per membership: a broadcast to many GPUs costs what one costs on NVLink."""


@dataclass(frozen=True)
class GroupState:
    """The groups of the previous round, by group key (the channel, or channel/replica for pairwise
    channels): members, rendezvous, and their ids."""

    members: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    endpoints: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    ids: Mapping[str, str] = field(default_factory=dict)
    minted: int = 0


def group_key(channel: Channel, replica_id: str) -> str:
    return f"{channel.value}/{replica_id}" if channel in PAIRWISE_CHANNELS else channel.value


def why_not(channel: Channel, trainer: Capabilities, offer: SenderOffer | None, replica: Candidate) -> str:
    """Empty when ``channel`` works between the two ends; otherwise the reason it does not."""
    caps = replica.capabilities
    if channel in replica.failed_channels:
        return "failed before for this replica"
    if channel not in trainer.channels:
        return "trainer cannot send it"
    if channel not in caps.channels:
        return "replica cannot receive it"
    if channel is Channel.IPC:
        if not caps.host or caps.host != trainer.host:
            return f"different hosts ({trainer.host!r} vs {caps.host!r})"
        if not caps.gpu_uuids or not set(caps.gpu_uuids) <= set(trainer.gpu_uuids):
            return "replica GPUs are not the trainer's"
        missing = [g for g in caps.gpu_uuids if offer is None or g not in offer.ipc_handles]
        if missing:
            return f"no IPC handle offered for GPU {missing[0]}"
    elif channel is Channel.NCCL:
        if caps.engine is not EngineKind.GPU or trainer.engine is not EngineKind.GPU:
            return "needs GPU engines on both ends"
        if not caps.nccl_domain or caps.nccl_domain != trainer.nccl_domain:
            return f"different NCCL domains ({trainer.nccl_domain!r} vs {caps.nccl_domain!r})"
        if offer is None or not offer.port:
            return "trainer offered no NCCL rendezvous this round"
    elif channel is Channel.NIXL:
        if not (caps.nixl and trainer.nixl):
            return "NIXL missing on one end"
    elif channel is Channel.CPU:
        if caps.engine is not EngineKind.CPU:
            return "replica engine is not a CPU engine"
        if offer is None or not offer.port:
            return "trainer offered no cpu rendezvous this round"
    elif channel is Channel.VOLUME and (not caps.volume_id or caps.volume_id != trainer.volume_id):
        return f"no shared volume ({trainer.volume_id!r} vs {caps.volume_id!r})"
    return ""


def choose(
    trainer: Capabilities, offers: Mapping[Channel, SenderOffer], replica: Candidate, preference: Sequence[Channel]
) -> tuple[Channel | None, str]:
    """The first channel of ``preference`` that works, and a reason naming what was skipped."""
    skipped: list[str] = []
    for channel in preference:
        reason = why_not(channel, trainer, offers.get(channel), replica)
        if not reason:
            note = f"; skipped {', '.join(skipped)}" if skipped else ""
            return channel, f"{channel.value}{note}"
        skipped.append(f"{channel.value}: {reason}")
    return None, "no shared channel: " + "; ".join(skipped)


def negotiate(
    trainer: Capabilities,
    offers: Mapping[Channel, SenderOffer],
    replicas: Sequence[Candidate],
    preference: Sequence[Channel],
    previous: GroupState,
) -> tuple[list[ChannelPlan], list[tuple[str, str]], GroupState]:
    """Plans for every replica that shares a channel, the (replica, reason) left out, and the new groups."""
    chosen: dict[str, tuple[Candidate, Channel, str]] = {}
    unplanned: list[tuple[str, str]] = []
    for replica in sorted(replicas, key=lambda r: r.replica_id):
        channel, reason = choose(trainer, offers, replica, preference)
        if channel is None:
            unplanned.append((replica.replica_id, reason))
        else:
            chosen[replica.replica_id] = (replica, channel, reason)

    members: dict[str, tuple[tuple[str, str], ...]] = {}
    endpoints: dict[str, tuple[str, int]] = {}
    ids: dict[str, str] = {}
    devices: dict[str, int] = {}
    minted = previous.minted
    for replica, channel, _ in sorted(chosen.values(), key=lambda x: x[0].replica_id):
        if channel in GROUP_CHANNELS:
            key = group_key(channel, replica.replica_id)
            members[key] = (*members.get(key, ()), (replica.replica_id, replica.incarnation))
            endpoints[key] = (offers[channel].host, offers[channel].port)
            devices[key] = devices.get(key, 0) + replica.capabilities.devices
    for key in sorted(members):
        same = previous.members.get(key) == members[key] and previous.endpoints.get(key) == endpoints[key]
        if same and key in previous.ids:
            ids[key] = previous.ids[key]
        else:
            minted += 1
            ids[key] = f"{key.split('/')[0]}-{minted}"

    plans: list[ChannelPlan] = []
    next_rank: dict[str, int] = dict.fromkeys(members, 1)
    for replica, channel, reason in chosen.values():
        caps, offer = replica.capabilities, offers.get(channel)
        if channel in GROUP_CHANNELS:
            assert offer is not None
            key = group_key(channel, replica.replica_id)
            rdv = Rendezvous(
                host=offer.host,
                port=offer.port,
                rank_offset=next_rank[key],
                world_size=1 + devices[key],
                group_id=ids[key],
            )
            next_rank[key] += caps.devices
        elif channel is Channel.IPC:
            assert offer is not None
            rdv = Rendezvous(host=trainer.host, ipc_handles={g: offer.ipc_handles[g] for g in caps.gpu_uuids})
        elif channel is Channel.NIXL:
            rdv = Rendezvous(
                host=offer.host if offer else trainer.host,
                port=offer.port if offer else 0,
                nixl_metadata=offer.nixl_metadata if offer else b"",
            )
        else:
            rdv = Rendezvous(volume_path=caps.volume_mount)
        plans.append(ChannelPlan(replica.replica_id, channel, rdv, reason))
    return plans, unplanned, GroupState(members, endpoints, ids, minted)
