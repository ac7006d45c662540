"""The sharded path on the trainer: every rank sends its own regions, with no gather.

Only rank 0 talks to the coordinator, yet every rank sends. So each publish of a trainer
whose ranks agreed on a readable layout (``layouts.agreed``) is a *round* over a gloo
group of the publisher's own, in three steps that every rank takes in the same order:

1. rank 0 broadcasts the round (``Round``): the version, whether the gathered path runs
   this time (a replica planned on it, or the gathered volume copy), and for each replica
   the plan sends regions its region group's rendezvous and its regions (every rank's, in
   plan order), these only where the ranks do not hold them under the plan's key already
   (the last round every rank reported on sent them: a version whose plan did not change
   broadcasts and parses none);
2. every rank sends its regions to each of those replicas at once, a thread each (``regions.send``: cut
   from its own local shards, each region's digest word appended), over that replica's
   region group, formed at its first round and kept while the plan names the same group
   (``region_groups.Kept``: let go when a send over it failed or the replica left);
3. every rank's per-region digests (or why its sends failed) go to rank 0
   (``exchanges.all_gather_bytes``), which combines each replica's in plan order
   (``regions.combine``): what that replica's ack must match (``Sent.digests``).

The region group's rendezvous comes from the coordinator, inside the replica's plan on the
CPU stream or NCCL (``versions.region_group``): the store is the one rank 0 serves for that
channel (the endpoint its publisher offered), the trainer's ranks are group ranks ``0..R-1``
and the replica's workers ``R..R+W-1``. No other rank offers an endpoint: each joins rank 0's
store as a client (``region_groups.member``); gloo binds its own host's address on the route
to it, which gloo exchanges through the store, as a CPU-stream receiver does; NCCL forms a
communicator on the rank's GPU. Each rank's GPU is gathered once, at construction, for rank 0
to register (``gpus``): NCCL takes one rank per GPU, so where a replica's worker shares a GPU
with a rank, the plan lists that link as copied (the worker copies its regions out of the
rank's shards by CUDA IPC) and the rank's other links go over a group of its own
(``send_to``, ``region_groups.rank_groups``).

Messages are JSON in uint8 tensors (nothing pickled); every wait is bounded: the round's
broadcast by the control group's timeout, a group's formation by the join deadline, the
sends by the group's timeout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from weightsync.channels import exchanges, ipc_regions, nixl_regions, region_groups, regions, shard_reads, wire
from weightsync.channels.base import Rendezvous
from weightsync.coordinator import models, serde
from weightsync.errors import PermanentError, TransferTimeoutError, WeightsyncError
from weightsync.sharding import plans
from weightsync.sharding.links import Link
from weightsync.sharding.plans import Region
from weightsync.sharding.shards import TrainerLayout
from weightsync.vocabulary import Channel
from weightsync_trainer.layouts import local_shards
from weightsync_trainer.sources import ModuleSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Target:
    """One replica the round sends regions to."""

    replica_id: str
    rendezvous: Rendezvous
    regions: tuple[Region, ...]
    """The replica's regions, every rank's, in plan order (what its digests combine in)."""
    copied: frozenset[Link] = frozenset()
    """Its links whose ends share a GPU (``ReplicaPlan.copied``): the worker copies those regions by CUDA IPC."""
    plan_key: str = ""
    """The plan they were computed for: the regions depend on it only (``TransferPlan.key``)."""


@dataclass(frozen=True)
class Round:
    """What rank 0 tells every rank at the start of a publish."""

    version: int
    """0: nothing is published this time (the coordinator was unreachable)."""
    gather: bool
    """Whether the gathered path runs (a collective: every rank takes part in the gather)."""
    targets: tuple[Target, ...] = ()

    def to_json(self, held: Set[tuple[str, str]] = frozenset()) -> bytes:
        """``held``: the (plan key, replica id) pairs whose regions every rank holds: theirs are left out."""
        out = []
        for t in self.targets:
            target = {
                "replica": t.replica_id,
                "rendezvous": t.rendezvous.to_dict(),
                "copied": plans.links_to(t.copied),
                "plan_key": t.plan_key,
            }
            if (t.plan_key, t.replica_id) not in held:
                target["regions"] = plans.regions_to(t.regions)
            out.append(target)
        return json.dumps({"version": self.version, "gather": self.gather, "targets": out}).encode()

    @classmethod
    def from_json(cls, data: bytes, held: serde.HeldRegions) -> Round:
        """The round, a target's regions left out taken from ``held`` (by plan key and replica), and those sent
        kept there."""
        try:
            d = json.loads(data)
            targets = []
            for t in d["targets"]:
                rid, key = str(t["replica"]), str(t["plan_key"])
                if "regions" in t:
                    regions_ = tuple(plans.regions_from(t["regions"]))
                    held.keep(key, rid, regions_)
                else:
                    regions_ = held.regions(key, rid, f"rank 0's round for {rid!r}")
                targets.append(
                    Target(rid, Rendezvous.from_dict(t["rendezvous"]), regions_, plans.links_from(t["copied"]), key)
                )
            return cls(int(d["version"]), bool(d["gather"]), tuple(targets))
        except (KeyError, TypeError, ValueError) as e:
            raise PermanentError(f"rank 0's round is malformed ({type(e).__name__}: {e})") from None


def targets(opened: models.OpenedVersion) -> tuple[Target, ...]:
    """The replicas ``opened`` plans on regions, in plan order, each with its region group's rendezvous."""
    parts = ((p, p.regions_part()) for p in opened.plans)
    return tuple(
        Target(p.replica_id, p.rendezvous, part.regions, part.copied, p.transfer.key if p.transfer else "")
        for p, part in parts
        if part is not None
    )


@dataclass(frozen=True)
class Sent:
    """Rank 0's account of a round's region sends."""

    digests: dict[str, str] = field(default_factory=dict)
    """Replica id -> the senders' combined region digest, for each replica every rank sent to."""
    failed: dict[str, str] = field(default_factory=dict)
    """Replica id -> why a rank's sends to it failed (it falls back alone)."""
    bytes_sent: dict[int, int] = field(default_factory=dict)
    """Trainer rank -> bytes it sent this round."""
    seconds: float = 0.0


class RegionSends:
    """One rank's part of every round; see the module docstring. Build it on every rank at once (it creates its
    own gloo group, a collective)."""

    def __init__(
        self, source: ModuleSource, layout: TrainerLayout, rank: int, timeout_s: float, device: torch.device
    ) -> None:
        """``timeout_s`` bounds the waits of the round's messages: the other ranks wait in the round's broadcast
        while rank 0 opens the version and its replicas join, so it must cover that (the version's timeout).
        ``device``: where the rank's shards live (a region group over NCCL forms there)."""
        import torch.distributed as dist

        from weightsync.channels import gpu

        if layout.unsupported:
            raise PermanentError(f"no region sends for a layout the core cannot describe: {layout.unsupported}")
        self.source, self.layout, self.rank, self.timeout_s = source, layout, rank, timeout_s
        self.device = device
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.kept: dict[str, region_groups.Kept] = {}
        """Replica id -> its region group, kept across rounds while the plan names the same one."""
        self.cuts: dict[str, regions.Cuts] = {}
        """Replica id -> this rank's regions of it as views of its shards, kept while they stay in the same memory."""
        self._held = serde.HeldRegions()
        """The regions of the rounds' targets this rank decoded (the ranks but rank 0)."""
        self._reported: set[tuple[str, str]] = set()
        """Rank 0: the targets whose regions every rank holds: sent in full in the last round every rank reported
        on, and in none that failed since (a rank that failed may have parsed another round's or none)."""
        mine = gpu.uuid(device) if device.type == "cuda" else ""
        gpus = [b.decode() for b in exchanges.all_gather_bytes(self.group, layout.world_size, mine.encode())]
        self.gpus: tuple[str, ...] = tuple(gpus) if all(gpus) else ()
        """Each rank's GPU, in rank order (empty off GPUs): the coordinator keeps a replica on any of them off
        regions over NCCL (``rules.regions``)."""

    def round(self, lead: Round | None = None) -> Round:
        """Rank 0 passes its round and every rank returns it."""
        if (lead is None) != (self.rank != 0):
            raise PermanentError("rank 0 leads a round, and only rank 0")
        data = exchanges.broadcast_bytes(self.group, self.rank, lead.to_json(self._reported) if lead else b"")
        return lead if lead is not None else Round.from_json(data, self._held)

    def send(self, r: Round) -> Sent | None:
        """This rank's sends of round ``r``, then the reports to rank 0; rank 0 returns the round's account."""
        t0 = time.perf_counter()
        mine: dict[str, Any] = {}
        if r.version:  # a replica no round targets has left its region membership: its next one has a new name
            for rid in set(self.kept) - {t.replica_id for t in r.targets}:
                self.kept.pop(rid).close()
            for rid in set(self.cuts) - {t.replica_id for t in r.targets}:
                del self.cuts[rid]
        if r.targets:
            local = local_shards(self.source, self.layout, self.rank)
            # every replica's sends at once, each over its own group: one slow to join, or failing, delays no other
            with ThreadPoolExecutor(len(r.targets), thread_name_prefix=f"weightsync-regions-r{self.rank}") as pool:
                sending = {t.replica_id: pool.submit(self._send_one, r.version, t, local) for t in r.targets}
            mine = {rid: f.result() for rid, f in sending.items()}
        try:
            reports = exchanges.all_gather_bytes(self.group, self.layout.world_size, json.dumps(mine).encode())
        except RuntimeError as e:  # gloo: a rank died, or did not report within the group's timeout
            self._reported = set()
            why = f"regions: not every trainer rank reported its sends ({e})"
            return Sent(failed={t.replica_id: why for t in r.targets}) if self.rank == 0 else None
        if self.rank != 0:
            return None
        if r.targets:  # every rank parsed this round: its targets' regions are what each holds under their keys
            self._reported = {(t.plan_key, t.replica_id) for t in r.targets}
        return _account(r, [json.loads(b) for b in reports], time.perf_counter() - t0)

    def start(self, r: Round) -> InFlight:
        """``send(r)`` on a thread of its own: the gathered path (its groups' join, the gather, the CPU stream)
        runs meanwhile, so a replica of either path that is slow to join costs the others nothing."""
        return InFlight(self, r)

    def _send_one(self, version: int, t: Target, local: Sequence[Any]) -> dict[str, Any]:
        """This rank's regions of ``t`` over its region group: ``{"digests": [...], "nbytes": n}`` or
        ``{"error": why}``."""
        kept = self.kept.setdefault(t.replica_id, region_groups.Kept())
        cuts = self.cuts.setdefault(t.replica_id, regions.Cuts())
        on = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        try:
            try:
                with on:  # a thread of its own: the rank's device made current, for its kernels and NCCL calls
                    tally = send_to(kept, t, version, self.rank, self.layout, local, self.device, cuts)
            except BaseException:
                kept.close()
                raise
        except (WeightsyncError, OSError) as e:
            log.warning(
                "v%d: trainer rank %d could not send its regions to %s: %s", version, self.rank, t.replica_id, e
            )
            return {"error": f"trainer rank {self.rank}: {e}"}
        return {"digests": tally.digests, "nbytes": tally.nbytes}

    def close(self) -> None:
        import torch.distributed as dist

        for kept in self.kept.values():
            kept.close()
        dist.destroy_process_group(self.group)


def send_to(
    kept: region_groups.Kept,
    t: Target,
    version: int,
    rank: int,
    layout: TrainerLayout,
    local: Sequence[torch.Tensor | None],
    device: torch.device,
    cuts: regions.Cuts | None = None,
) -> regions.Tally:
    """Trainer ``rank``'s regions of ``t`` (from its ``local`` shards) over what ``kept`` holds for the replica's
    membership, formed now where it holds nothing yet (every formation bounded): its region group; or, where some
    of its workers share the trainer's GPUs (``t.copied``), the co-located links by CUDA IPC (the rank publishes its
    shards and each region's digest word, the worker copies) and the others over the rank's own group
    (``region_groups.rank_groups``); or, for a replica planned on NIXL, every link read by its worker out of the
    rank's registered shards (``nixl_regions``). The shards stay unchanged until the reading workers said they are
    done. ``cuts``: the regions' views kept across versions (``regions.Cuts``)."""
    ours = [g for g in t.regions if g.rank == rank]
    # its workers say done when their walk ended, failed too: a walk waits up to the join deadline and the timeout
    # for another rank's placement, then the timeout for its reads; the rank waits longer, so that a worker failed
    # by another rank's death says so before this rank gives up on it (and the version fails naming that rank)
    wait_s = t.rendezvous.join_timeout_s + 2 * t.rendezvous.timeout_s
    if t.rendezvous.channel is Channel.NIXL:
        reads = kept.reads_end(t.rendezvous, Channel.NIXL, lambda store: nixl_regions.Exporter(store, rank, wait_s))
        return _shared(reads, version, layout, rank, local, ours, sorted({g.worker for g in ours}), {}, cuts=cuts)
    if not t.copied:
        group = kept.get(t.rendezvous, rank, device)
        return regions.send(group.pg, layout, rank, local, ours, bound=region_groups.bound(group), cuts=cuts)
    links: dict[int, regions.Wire | regions.Shared] = {}
    wired = []
    mine = region_groups.rank_groups(t.rendezvous, t.regions, t.copied).get(rank)
    if mine is not None:
        rdv, workers = mine
        group = kept.get(rdv, 0, device, t.rendezvous)
        wired.append(group)
        links.update({w: regions.Wire(group.pg, 1 + i) for i, w in enumerate(workers)})
    near = sorted({w for r, w in t.copied if r == rank})
    if not near:
        bound = region_groups.bound(*wired)
        return regions.send(None, layout, rank, local, ours, links=links, bound=bound, cuts=cuts)
    copies = kept.reads_end(t.rendezvous, Channel.IPC, lambda store: ipc_regions.Exporter(store, rank, wait_s))
    return _shared(copies, version, layout, rank, local, ours, near, links, region_groups.bound(*wired), cuts)


def _shared(
    exporter: shard_reads.Exporter,
    version: int,
    layout: TrainerLayout,
    rank: int,
    local: Sequence[torch.Tensor | None],
    ours: Sequence[Region],
    readers: Sequence[int],
    links: dict[int, regions.Wire | regions.Shared],
    bound: Any = None,
    cuts: regions.Cuts | None = None,
) -> regions.Tally:
    """The rank's regions with the links of ``readers`` read by those workers from ``exporter`` (its shards
    published for ``version``), the others over ``links``; the shards stay unchanged until the readers said they
    are done."""
    exporter.publish(version, layout, local)
    links.update({w: exporter.link(w) for w in readers})
    tally = regions.send(None, layout, rank, local, ours, links=links, bound=bound, cuts=cuts)
    exporter.release()
    return tally


class InFlight:
    """A round's sends under way (``RegionSends.start``)."""

    def __init__(self, sends: RegionSends, r: Round) -> None:
        self.sends, self.round = sends, r
        self._out: list[Sent | None] = []
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name=f"weightsync-regions-v{r.version}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._out.append(self.sends.send(self.round))
        except BaseException as e:  # noqa: BLE001 - re-raised by ``result`` on the publishing thread
            self._error.append(e)

    def result(self) -> Sent | None:
        """The round's account on rank 0 (None on the others), once every rank's sends ended; bounded by the
        control group's timeout, past which every wait inside has failed already."""
        self._thread.join(self.sends.timeout_s + wire.GRACE_S)
        if self._thread.is_alive():
            raise TransferTimeoutError(
                f"v{self.round.version}: trainer rank {self.sends.rank}'s region sends did not end within "
                f"{self.sends.timeout_s:g}s"
            )
        if self._error:
            raise self._error[0]
        return self._out[0]


def _account(r: Round, reports: Sequence[Mapping[str, Any]], seconds: float) -> Sent:
    """Rank 0: each replica's combined digest from every rank's list (plan order), or why it failed."""
    sent = Sent(seconds=seconds)
    for rank, report in enumerate(reports):
        sent.bytes_sent[rank] = sum(int(x.get("nbytes", 0)) for x in report.values())
    for t in r.targets:
        errors = [str(rep[t.replica_id]["error"]) for rep in reports if "error" in rep.get(t.replica_id, {})]
        if errors:
            sent.failed[t.replica_id] = "regions: " + "; ".join(errors)
            continue
        lists = {rank: list(rep[t.replica_id]["digests"]) for rank, rep in enumerate(reports)}
        try:
            sent.digests[t.replica_id] = regions.combine(t.regions, lists, regions.rank_of)
        except WeightsyncError as e:
            sent.failed[t.replica_id] = f"regions: the ranks' digests do not match the plan: {e}"
    return sent


__all__ = ["InFlight", "RegionSends", "Round", "Sent", "Target", "send_to", "targets"]
