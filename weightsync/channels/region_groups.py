"""A replica's region group, on the channel its plan chose: the trainer's ranks and the replica's workers.

The sharded path moves a version over one group per replica (``regions``), whose ranks are the trainer's ranks
(group ranks ``0..R-1``) and then the replica's workers, formed on trainer rank 0's store for that channel (the
rendezvous the coordinator put in the replica's plan, ``versions.region_group``) and kept across versions while
the plan names the same group (``Kept``):

- the CPU stream, and the NCCL channel's gloo transport (CPU tensors: tests and CPU-only machines): the CPU
  stream's gloo group (``cpu.member``), whose point-to-point calls take the group's timeout;
- NCCL: a communicator of its own on the member's GPU. Its calls return at once and the host blocks later, on a
  sync that never ends if a peer died, so the walk bounds each of its waits (``wait``): past the group's timeout
  the communicator is aborted, which makes its kernels return, and the wait fails naming what it waited for.
  Each pair that talks is connected when the group forms (NCCL connects a pair inside the first call posted to
  it, a call that never returns when the peer is gone).
  A communicator takes one rank per GPU. Where a replica's worker shares a GPU with a trainer rank (a colocated
  job), the plan lists that link as copied (``ReplicaPlan.copied``: the worker copies its regions out of the
  rank's memory by CUDA IPC, ``ipc_regions``, on the same store), and the replica's other links go over one group
  per trainer rank instead (``rank_groups``: the rank and the workers it sends to over the wire, none of them on
  its GPU). Both ends derive those groups from the plan, so no word passes between them.
- NIXL: no group; each worker reads its regions out of each rank's registered shards (``nixl_regions``), the
  handshake on the same store (``Kept.reads_end``).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import torch

from weightsync.channels import cpu, gpu, nccl, wire
from weightsync.channels.base import Rendezvous
from weightsync.channels.wire import dist
from weightsync.errors import PermanentError, TransferTimeoutError
from weightsync.sharding.links import Link
from weightsync.sharding.plans import Region
from weightsync.vocabulary import Channel

End = TypeVar("End", bound="_Closing")


class _Closing(Protocol):
    def close(self) -> None: ...


class Member(Protocol):
    pg: Any

    def connect(self) -> None: ...

    def close(self) -> None: ...


class NcclMember:
    """Group rank ``rank``'s side of an NCCL region group, on ``device``."""

    def __init__(self, rendezvous: Rendezvous, rank: int, device: torch.device) -> None:
        if rendezvous.endpoint is None:
            raise PermanentError(f"nccl channel: the rendezvous of region group {rendezvous.group!r} names no endpoint")
        self.rdv, self.rank, self.device = rendezvous, rank, device
        self.pg: Any = None

    def connect(self) -> None:
        """Form the communicator with every member, within the join deadline."""
        rdv, join_s = self.rdv, self.rdv.join_timeout_s
        assert rdv.endpoint is not None  # checked when made
        store = dist.PrefixStore(rdv.prefix, wire.join_store(rdv.endpoint, join_s, rdv.timeout_s, Channel.NCCL))

        def make() -> Any:
            opts = dist.ProcessGroupNCCL.Options()
            # torch's watchdog is the backstop only (it may end the process): it fires well after our own abort
            opts._timeout = datetime.timedelta(seconds=rdv.timeout_s * nccl.WATCHDOG_FACTOR)
            pg = dist.ProcessGroupNCCL(store, self.rank, rdv.world_size, opts)
            pg.eager_connect_single_device(self.device)
            self._connect_links(pg)
            return pg

        what = f"forming region group {rdv.group!r} ({rdv.world_size} ranks)"
        self.pg = wire.bounded(make, join_s, what, Channel.NCCL)

    def _connect_links(self, pg: Any) -> None:
        """One byte between this member and each member at the other end (the trainer's ranks, the workers), in one
        grouped launch. NCCL connects a pair at its first point-to-point call, inside the call that posts it, which
        never returns if the peer is gone: connected here, within the join deadline, the walk's calls only enqueue
        and its bounded waits see a peer that died."""
        trainers = self.rdv.rank  # the first worker's group rank
        sends = self.rank < trainers
        peers = range(trainers, self.rdv.world_size) if sends else range(trainers)
        bufs = [torch.zeros(1, dtype=torch.uint8, device=self.device) for _ in peers]
        pg._start_coalescing()
        for peer, buf in zip(peers, bufs, strict=True):
            pg.send([buf], peer, 0) if sends else pg.recv([buf], peer, 0)
        pg._end_coalescing().wait()
        torch.cuda.synchronize(self.device)

    def wait(self, work: Any, what: str) -> None:
        """Return once ``work`` completed; past the group's timeout abort the communicator and raise."""
        gpu.wait(work, self.rdv.timeout_s, f"nccl channel: region group {self.rdv.group!r}: {what}", self.abort)

    def abort(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.abort()

    def close(self) -> None:
        """Abort: a group let go is never used again (``Kept``), and a peer that failed leaves nothing to drain."""
        self.abort()


def member(rendezvous: Rendezvous, rank: int, device: torch.device | str) -> Member:
    """Group rank ``rank``'s side of ``rendezvous``'s region group (not formed yet: ``connect``), its tensors on
    ``device``."""
    if rendezvous.channel is Channel.NCCL and nccl.transport() == "nccl":
        return NcclMember(rendezvous, rank, gpu.cuda_device(device))
    if rendezvous.channel not in (Channel.CPU, Channel.NCCL):
        raise PermanentError(f"no region groups over the {rendezvous.channel.value} channel")
    return cpu.member(rendezvous, rank)


class Kept:
    """One end's region groups for one replica, kept across versions while its membership holds.

    The coordinator names a replica's region membership after its members, which gets a new name (and so a new
    store prefix) whenever it changes (a member restarted, the trainer's endpoint moved) and after a failure on
    either end (``versions._fall_back``, ``versions._lost``). So both ends keep what they formed under it (its
    group, or its groups per trainer rank and its IPC end) while the plan names the same membership, and form anew
    when it names another, without a word between them. Each is formed once per name: its store keys stay
    behind, and a second formation under them would meet the first's. An end that failed (``close``) refuses to
    form them again and fails the version at once; the failure reaches the coordinator, which names a new
    membership for the next version."""

    def __init__(self) -> None:
        self.groups: dict[str, Member] = {}
        """Store prefix -> the group formed under it."""
        self.reads: Any = None
        """The membership's end of the links a worker reads itself (``shard_reads``' ``Exporter`` or ``Importer``:
        over CUDA IPC where it has copied links, over NIXL for a replica planned on NIXL)."""
        self._membership = ""
        self._formed: set[str] = set()

    def get(
        self, rendezvous: Rendezvous, rank: int, device: torch.device | str, membership: Rendezvous | None = None
    ) -> Member:
        """The formed group ``rendezvous`` names: the one kept, or a new one, formed now. ``membership``: the
        replica's region membership it belongs to (``rank_groups``; default: its own): whatever was kept under
        another is let go first."""
        self._enter(membership or rendezvous)
        group = self.groups.get(rendezvous.prefix)
        if group is not None:
            return group
        self._first(rendezvous.prefix, f"region group {rendezvous.group!r}", rendezvous.channel)
        group = member(rendezvous, rank, device)
        try:
            group.connect()
        except BaseException:
            group.close()
            raise
        self.groups[rendezvous.prefix] = group
        return group

    def reads_end(self, membership: Rendezvous, channel: Channel, make: Callable[[Any], End]) -> End:
        """The membership's end of the links its workers read over ``channel`` (IPC or NIXL): the one kept, or
        ``make(store)`` on a store of its own under the membership's prefix on trainer rank 0's store (the one its
        groups form on)."""
        self._enter(membership)
        if self.reads is None:
            prefix = membership.prefix + f"{channel.value}/"
            self._first(prefix, f"the {channel.value} links of {membership.group!r}", channel)
            if membership.endpoint is None:
                raise PermanentError(
                    f"region membership {membership.group!r} names no endpoint for its {channel.value} links"
                )
            store = wire.join_store(
                membership.endpoint, membership.join_timeout_s, membership.timeout_s, membership.channel
            )
            self.reads = make(dist.PrefixStore(prefix, store))
        reads: End = self.reads
        return reads

    def _enter(self, membership: Rendezvous) -> None:
        if membership.prefix != self._membership:
            self.close()
            self._membership = membership.prefix

    def _first(self, prefix: str, what: str, channel: Channel) -> None:
        if prefix in self._formed:
            raise TransferTimeoutError(
                f"{channel.value} channel: {what} failed here in an earlier version, and each is formed once per "
                "name: this version fails, and the coordinator names a new membership for the next"
            )
        self._formed.add(prefix)

    def close(self) -> None:
        """Let everything go (a walk failed, or the plan names another membership): never formed again here."""
        groups, self.groups = self.groups, {}
        reads, self.reads = self.reads, None
        for group in groups.values():
            group.close()
        if reads is not None:
            reads.close()


def rank_groups(
    membership: Rendezvous, regions: Iterable[Region], copied: frozenset[Link]
) -> dict[int, tuple[Rendezvous, tuple[int, ...]]]:
    """A replica with copied links (``ReplicaPlan.copied``) takes its other links over one group per trainer rank:
    trainer rank -> (its group's rendezvous, the workers in it). Rank ``r``'s group holds ``r`` (group rank 0) and
    the workers it sends regions over the wire (group ranks 1.., in worker order), none on its GPU; it is named
    after the membership (``{group}-r{r}``), so it lives and dies with it. A rank with no wired link has none.
    Both ends compute it from the same plan; a copied link the regions do not have is refused (the ends would
    disagree on what moves how)."""
    wired: dict[int, set[int]] = {}
    links = set()
    for r in regions:
        links.add((r.rank, r.worker))
        if (r.rank, r.worker) not in copied:
            wired.setdefault(r.rank, set()).add(r.worker)
    if not copied <= links:
        raise PermanentError(
            f"region membership {membership.group!r}: the plan copies links {sorted(copied - links)} (trainer rank, "
            "worker) that carry no region"
        )
    return {
        rank: (
            dataclasses.replace(membership, group=f"{membership.group}-r{rank}", rank=1, world_size=1 + len(workers)),
            tuple(sorted(workers)),
        )
        for rank, workers in sorted(wired.items())
    }


def bound(*groups: Member) -> Any:
    """The bounded wait of the works of ``groups`` (one end's, for one replica) for ``regions.send``/``receive``
    (None: a work's own wait is bounded). Past the group's timeout every one of them is aborted: the walk fails,
    and the end lets them all go (``Kept.close``)."""
    nccl = [g for g in groups if isinstance(g, NcclMember)]
    if not nccl:
        return None
    if len(nccl) == 1:
        return nccl[0].wait

    def wait(work: Any, what: str) -> None:
        rdv = nccl[0].rdv
        gpu.wait(work, rdv.timeout_s, f"nccl channel: region groups of {rdv.group!r}: {what}", _abort_all(nccl))

    return wait


def _abort_all(groups: list[NcclMember]) -> Callable[[], None]:
    def abort() -> None:
        for g in groups:
            g.abort()

    return abort


__all__ = ["Kept", "Member", "NcclMember", "bound", "member", "rank_groups"]
