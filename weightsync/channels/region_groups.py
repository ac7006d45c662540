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
  A communicator takes one rank per GPU: the coordinator plans regions over NCCL only for a replica none of
  whose GPUs holds a trainer rank (``rules.regions``).
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

import torch

from weightsync.channels import cpu, gpu, nccl, wire
from weightsync.channels.base import Rendezvous
from weightsync.channels.wire import dist
from weightsync.errors import PermanentError, TransferTimeoutError
from weightsync.vocabulary import Channel


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
    """One end's region group for one replica, kept across versions while its membership holds.

    The coordinator names a replica's region group after its membership, which gets a new name (and so a new store
    prefix) whenever it changes (a member restarted, the trainer's endpoint moved) and after a failure on either end
    (``versions._fall_back``, ``versions._lost``). So both ends keep the group they formed while the plan names the
    same one, and form the next when it names another, without a word between them. A group is formed once per
    name: its store keys stay behind, and a second formation under them would meet the first's. An end whose group
    failed (``close``) refuses to form it again and fails the version at once; the failure reaches the coordinator,
    which names a new group for the next version."""

    def __init__(self) -> None:
        self.group: Member | None = None
        self._prefix = ""
        self._formed: set[str] = set()

    def get(self, rendezvous: Rendezvous, rank: int, device: torch.device | str) -> Member:
        """The formed group ``rendezvous`` names: the one kept, or (another name) a new one, formed now."""
        if self.group is not None and self._prefix == rendezvous.prefix:
            return self.group
        self.close()
        if rendezvous.prefix in self._formed:
            raise TransferTimeoutError(
                f"{rendezvous.channel.value} channel: region group {rendezvous.group!r} failed here in an earlier "
                "version, and a group is formed once per name: this version fails, and the coordinator names a new "
                "group for the next"
            )
        self._formed.add(rendezvous.prefix)
        group = member(rendezvous, rank, device)
        try:
            group.connect()
        except BaseException:
            group.close()
            raise
        self.group, self._prefix = group, rendezvous.prefix
        return group

    def close(self) -> None:
        """Let the group go (a walk over it failed, or the plan names another): never formed again here."""
        group, self.group = self.group, None
        if group is not None:
            group.close()


def bound(group: Member) -> Any:
    """The bounded wait of ``group``'s works for ``regions.send``/``receive`` (None: a work's own wait is bounded)."""
    return group.wait if isinstance(group, NcclMember) else None


__all__ = ["Kept", "Member", "NcclMember", "bound", "member"]
