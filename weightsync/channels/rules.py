"""Which channels each end can use: the one place the rules live, filled from what each end discovers.

Three questions, one module, no torch (the coordinator asks the third):

- ``own``: can this end use a channel at all? The publisher asks it as a sender about its
  trainer's device (GPU or not), NIXL, the job's NCCL domain and its checkpoint directory;
  the agent as a receiver about its engine's workers. Each fills a ``Capabilities`` from
  what it discovered and offers or declares only the channels ``usable`` returns.
- ``between``: can the trainer and one replica share a channel? Negotiation asks it per
  replica and channel, in the job's preference order, and the fallback asks it for the
  volume. Each rule names what differs, so a plan's reason says why a faster channel
  was skipped.
- ``LIVE_CHANNELS``: the channels a sender streams while the publisher waits (the volume
  is not live: a replica planned on it loads a version once it is durable).

A live channel's endpoint is an address of the trainer's host. A loopback (or link-local)
one reaches only processes on that host: a replica on another host planned against it
would try a connection that can never succeed (with TCP's retries, for as long as its
timeout), so ``between`` refuses it, naming the variable that sets the address (``POD_IP``).
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from weightsync.channels.base import Endpoint, Offer
from weightsync.errors import PermanentError
from weightsync.vocabulary import Channel

LIVE_CHANNELS = frozenset({Channel.IPC, Channel.NCCL, Channel.NIXL, Channel.CPU})
"""Channels a sender streams while the publisher waits: each has memberships (the sender is rank 0, each
replica takes ``devices`` consecutive ranks) under a store prefix only planned members learn. The volume is
not live: a replica planned on it loads a version once it is durable."""


REGION_CHANNELS = frozenset({Channel.CPU, Channel.NCCL, Channel.NIXL})
"""Channels that carry a transfer plan's regions (the sharded path: every trainer rank sends its own, every worker
receives only its own): point to point over one group per replica of the trainer's ranks and its workers
(``channels.regions``), the CPU stream over gloo, NCCL over NCCL; or read by each worker out of each rank's
registered shards, NIXL (``channels.nixl_regions``). A replica planned on another channel (IPC: whole tensors
between one trainer process and its GPUs) takes the gathered path in the same version, the plan saying why
(``regions``)."""


def regions(channel: Channel, trainer: Capabilities | None = None, replica: Capabilities | None = None) -> str:
    """Why ``channel`` cannot carry a transfer plan's regions to ``replica`` (empty when it can): what
    ``plans.Member.refused`` says for a replica planned on it. An NCCL communicator takes one rank per GPU, so a
    replica with a worker on a trainer rank's GPU takes regions only where that pair can copy them by CUDA IPC
    instead (``sharding.links.copied``: one host, the replica receives IPC, a GPU UUID for every worker);
    its other links then go over a group per trainer rank (``region_groups.rank_groups``). NIXL reads every link,
    a worker on a rank's GPU too, so it holds no such rule."""
    if channel not in REGION_CHANNELS:
        over = ", ".join(sorted(c.value for c in REGION_CHANNELS))
        return f"its channel {channel.value!r} carries whole tensors only (regions go over: {over})"
    if channel is Channel.NCCL and trainer is not None and replica is not None:
        mine = set(replica.gpu_uuids)
        shared = [(rank, uuid) for rank, uuid in enumerate(trainer.rank_gpu_uuids) if uuid in mine]
        if shared and (why := no_copies(trainer, replica)):
            rank, uuid = shared[0]  # the lowest rank on one of its GPUs
            return (
                f"its GPU {uuid} holds trainer rank {rank}: an NCCL region group takes one rank per GPU, and the "
                f"pair cannot copy by CUDA IPC instead ({why})"
            )
    return ""


def no_copies(trainer: Capabilities, replica: Capabilities) -> str:
    """Why a replica's workers cannot copy regions from the trainer's ranks by CUDA IPC, on their GPUs or their
    peers' (empty: they can)."""
    if not replica.host or replica.host != trainer.host:
        return f"different hosts ({trainer.host!r} vs {replica.host!r})"
    if Channel.IPC not in replica.channels:
        return "the replica does not receive ipc"
    if len(replica.gpu_uuids) != replica.devices:
        return f"the replica reported {len(replica.gpu_uuids)} GPU UUIDs for {replica.devices} workers"
    return ""


class EngineKind(enum.StrEnum):
    CPU = "cpu"
    GPU = "gpu"


@dataclass(frozen=True)
class Capabilities:
    """What one end can do: a trainer lists channels it sends, a replica channels it receives."""

    host: str = ""
    """The node it runs on (IPC needs both ends on the same one; loopback endpoints reach only the same one)."""
    gpu_uuids: tuple[str, ...] = ()
    devices: int = 1
    channels: tuple[Channel, ...] = ()
    nccl_domain: str = ""
    nixl: bool = False
    volume_id: str = ""
    volume_mount: str = ""
    engine: EngineKind = EngineKind.CPU
    """Where the weights live: the trainer's device, or the engine's workers (GPU only when every one is)."""
    rank_gpu_uuids: tuple[str, ...] = ()
    """A trainer that sends regions: each rank's GPU, in rank order (``gpu_uuids`` is the process's own, rank 0's)."""
    peer_gpu_uuids: tuple[str, ...] = ()
    """A replica on GPUs: the GPUs every worker's process reads directly (its own, or visible to it with NVLink or
    PCIe P2P between them), from which its workers copy a trainer rank's regions themselves
    (``sharding.links.copied``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.devices <= 64:
            raise PermanentError(f"capabilities.devices must be 1..64 (a replica's workers), got {self.devices}")


def own(
    channel: Channel, caps: Capabilities, *, sends: bool, nccl_transport: str = "nccl", nixl_memory: str = "device"
) -> str:
    """Why this end cannot use ``channel`` (empty when it can). ``sends``: the trainer's side, else a replica's.
    ``nccl_transport`` is the NCCL channel's (``gloo`` runs it on CPU tensors: tests and CPU-only machines);
    ``nixl_memory`` what NIXL may move (``host``: weights in host memory too, ``nixl.MEMORY_ENV``)."""
    gpu = caps.engine is EngineKind.GPU
    off_gpu = "the trainer's weights are not on a GPU" if sends else "the engine runs on the CPU"
    if channel is Channel.VOLUME and not caps.volume_mount:
        return "no checkpoint directory" if sends else "no checkpoint volume mounted"
    if channel is Channel.IPC and not gpu:
        return off_gpu
    if channel is Channel.NIXL:
        if not caps.nixl:
            return "NIXL is not importable" + ("" if sends else " in every worker")
        if not gpu and nixl_memory != "host":
            return off_gpu + " (WEIGHTSYNC_NIXL_MEMORY=host lets NIXL move host memory)"
    if channel is Channel.NCCL:
        if not caps.nccl_domain:
            return "the job has no NCCL domain"
        if not gpu and nccl_transport == "nccl":
            return off_gpu
    if channel is Channel.CPU and gpu and not sends:
        return "the engine runs on GPUs"
    return ""


def usable(
    wanted: Iterable[Channel],
    caps: Capabilities,
    *,
    sends: bool,
    nccl_transport: str = "nccl",
    nixl_memory: str = "device",
) -> tuple[tuple[Channel, ...], dict[Channel, str]]:
    """The channels of ``wanted`` this end can use (in ``wanted``'s order), and why it cannot use the others."""
    why = {
        ch: r
        for ch in wanted
        if (r := own(ch, caps, sends=sends, nccl_transport=nccl_transport, nixl_memory=nixl_memory))
    }
    return tuple(ch for ch in wanted if ch not in why), why


def host_only(endpoint: Endpoint) -> str:
    """Why ``endpoint`` reaches no other host (loopback: 127.0.0.0/8, ::1, ``localhost``; link-local; multicast),
    empty when it may. A name other than localhost may: it is resolved where it is used."""
    host = endpoint.host.lower()
    if host == "localhost" or host.endswith(".localhost"):
        return "loopback"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ""
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    if address.is_multicast or address.is_unspecified:
        return "not a host's address"
    return ""


def between(
    channel: Channel,
    trainer: Capabilities,
    offer: Offer | None,
    replica: Capabilities,
    failed: frozenset[Channel] = frozenset(),
    in_nccl: frozenset[str] = frozenset(),
    own_group: bool = False,
) -> str:
    """Empty when ``channel`` works between the trainer and ``replica``; otherwise the reason it does not.
    ``failed``: channels that failed for this replica lately (kept off them for a while). ``in_nccl``: the GPUs
    already in the NCCL group (the trainer's and earlier replicas'): NCCL takes one rank per GPU. ``own_group``:
    the replica may take regions, in groups of its own, whose GPUs ``regions`` checks instead."""
    if channel in failed:
        return "failed before for this replica"
    if offer is None:
        return "trainer did not offer it"
    if channel not in replica.channels:
        return "replica cannot receive it"
    if channel is Channel.IPC:
        if not replica.host or replica.host != trainer.host:
            return f"different hosts ({trainer.host!r} vs {replica.host!r})"
        if not replica.gpu_uuids or not set(replica.gpu_uuids) <= set(offer.devices):
            return "replica GPUs are not the trainer's"
    elif channel is Channel.NCCL:
        if not replica.nccl_domain or replica.nccl_domain != trainer.nccl_domain:
            return f"different NCCL domains ({trainer.nccl_domain!r} vs {replica.nccl_domain!r})"
        shared = sorted(set(replica.gpu_uuids) & (in_nccl | set(trainer.gpu_uuids)))
        if shared and not own_group:
            return f"GPU {shared[0]} already has a rank in the NCCL group (one rank per GPU)"
    elif channel is Channel.NIXL:
        if not replica.nixl:
            return "replica has no NIXL"
    elif channel is Channel.CPU:
        if replica.engine is not EngineKind.CPU:
            return "replica engine is not a CPU engine"
    elif channel is Channel.VOLUME and (not replica.volume_id or replica.volume_id != trainer.volume_id):
        return f"no shared volume ({trainer.volume_id!r} vs {replica.volume_id!r})"
    if channel in LIVE_CHANNELS:
        if offer.endpoint is None:
            return "trainer offered no rendezvous for it"
        kind = host_only(offer.endpoint)
        if kind and (not replica.host or replica.host != trainer.host):
            return (
                f"the trainer offered the {kind} endpoint {offer.endpoint}, which a replica on another host "
                f"({replica.host!r}, the trainer is on {trainer.host!r}) cannot reach; start the trainer with "
                "POD_IP set to its pod's address"
            )
    return ""
