"""A sharded update in one worker: only its regions, from every trainer rank, landed in its parameters.

The worker half of the sharded path's data path (``docs/sharded.md``). The worker joins
its replica's region group (a CPU-stream or NCCL ``Rendezvous`` whose ``rank`` is the number
of trainer ranks: they hold group ranks ``0..rank-1``, and worker ``w`` of the replica joins
as ``rank + w`` of ``world_size``; over NCCL on the worker's GPU; kept across versions while
the plan names the same group, ``region_groups.Kept``; where the plan copies some of its
links, ``walk``: those by CUDA IPC from the trainer rank on its GPU, the others over the
ranks' own groups; planned on NIXL, it reads every region itself), checks
the table against vLLM's loader (``dryrun``, changing nothing), then inside vLLM's layerwise
reload receives its regions in plan order (``weightsync.channels.regions.receive``: every
region's digest checked once all arrived, one host sync) and
lands each one (``landing.Landing``); a failure after the first byte landed (a region whose
digest differs included) leaves the worker torn (the updater's fail-stop state), as any
in-place update does.

Answers what it received: bytes, each region's digest in its order (the agent combines
the workers' lists in plan order, ``regions.combine``), seconds.

The request names the plan's key; its table, regions and layouts (every region of the
replica: a few hundred a link) come only where the agent's workers did not parse them
under that key yet (``request``'s ``held``): each worker keeps what it parsed of the last
plans (``Part``), so a version whose plan did not change carries and parses none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.channels import ipc_regions, nixl_regions, region_groups, regions
from weightsync.channels.base import Rendezvous
from weightsync.errors import PermanentError
from weightsync.sharding import plans
from weightsync.sharding.fills import Fill, WorkerLayout
from weightsync.sharding.links import Link
from weightsync.sharding.plans import Region
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel
from weightsync_inference.landing import Landing

PARTS_KEPT = 2
"""Plans whose parts a worker keeps (the newest): the agent names only the last one it delivered in full."""


@dataclass(frozen=True)
class Part:
    """What a worker parsed of a plan's request, kept under the plan's key for its later versions."""

    table: TensorTable
    layout: WorkerLayout
    """This worker's."""
    regions: tuple[Region, ...]
    """Every worker's of the replica, in plan order."""


@dataclass(frozen=True)
class Order:
    """What a worker is told to receive: its replica's part of one version's plan."""

    version: int
    rendezvous: Rendezvous
    """The replica's region membership: its group, or (with copied links) its groups per trainer rank."""
    regions: tuple[Region, ...]
    """Every worker's, in plan order."""
    copied: frozenset[Link] = frozenset()
    """The links the worker copies by CUDA IPC from a trainer rank on its GPU (``ReplicaPlan.copied``)."""


def receive(engine: Any, order: Order, table: TensorTable, layout: WorkerLayout) -> dict[str, Any]:
    """Receive and land this worker's regions of ``order`` (its replica's, every worker's, plan order)."""
    worker = engine.updater.ctx.rank
    if layout.rank != worker:
        raise PermanentError(f"worker {worker} was given worker {layout.rank}'s layout")
    engine.updater.model.check(table)  # refuses a table the model would not load, having changed nothing
    device, kept = engine.updater.ctx.device, engine.updater.regions
    tally = regions.Tally()
    t0 = time.perf_counter()
    try:
        # the walk copies co-located regions straight into their places in the landing's parameters
        landed = land(engine, layout, table, lambda landing: walk(kept, order, worker, table, tally, device, landing))
    except BaseException:
        kept.close()  # never formed again under its name: the coordinator names a new membership after a failure
        raise
    return {
        "worker": worker,
        "layout_digest": table.layout_digest(),  # of the table this worker checked and landed
        "nbytes": tally.nbytes,
        "landed": landed,
        "digests": tally.digests,
        "seconds": time.perf_counter() - t0,
    }


def walk(
    kept: region_groups.Kept,
    order: Order,
    worker: int,
    table: TensorTable,
    tally: regions.Tally,
    device: torch.device | str,
    places: regions.Places | None = None,
) -> Iterator[tuple[Fill, torch.Tensor]]:
    """Worker ``worker``'s regions of ``order`` as they arrive and check (``regions.receive``), over what ``kept``
    holds for the replica's membership (formed now where it holds nothing yet; every formation bounded): its region
    group; or, with copied links, the trainer ranks' groups it is in (in rank order, as every worker forms them,
    so none waits on another in a cycle) and its IPC end, which copies each region straight into its place where
    ``places`` gives one (``regions.Places``: the engine's ``Landing``; those regions are not yielded); or, planned
    on NIXL, its NIXL reader (every link read out of the ranks' registered shards)."""
    rdv = order.rendezvous
    if rdv.channel is Channel.NIXL:
        reader = kept.reads_end(
            rdv,
            Channel.NIXL,
            lambda store: nixl_regions.Importer(store, worker, device, rdv.timeout_s, rdv.join_timeout_s),
        )
        ranks = sorted({r.rank for r in order.regions if r.worker == worker})
        reads = {r: reader.link(order.version, r, table) for r in ranks}
        return regions.receive(None, rdv.rank, worker, table, order.regions, tally, device, links=reads)
    if not order.copied:
        group = kept.get(rdv, rdv.rank + worker, device)
        on = device if isinstance(group, region_groups.NcclMember) else "cpu"
        return regions.receive(
            group.pg, rdv.rank, worker, table, order.regions, tally, on, bound=region_groups.bound(group)
        )
    links: dict[int, regions.Wire | regions.Copied] = {}
    wired = []
    for rank, (group_rdv, workers) in region_groups.rank_groups(rdv, order.regions, order.copied).items():
        if worker in workers:
            group = kept.get(group_rdv, 1 + workers.index(worker), device, rdv)
            wired.append(group)
            links[rank] = regions.Wire(group.pg, 0)
    near = sorted({r for r, w in order.copied if w == worker})
    if near:
        importer = kept.reads_end(
            rdv,
            Channel.IPC,
            lambda store: ipc_regions.Importer(store, worker, device, rdv.timeout_s, rdv.join_timeout_s),
        )
        links.update({r: importer.link(order.version, r, table) for r in near})
    bound = region_groups.bound(*wired)
    return regions.receive(
        None, rdv.rank, worker, table, order.regions, tally, device, links=links, bound=bound, places=places
    )


def land(
    engine: Any, layout: WorkerLayout, table: TensorTable, pieces: Callable[[Landing], Iterable[tuple[Fill, Any]]]
) -> int:
    """Land ``pieces(landing)`` (this worker's, as they arrive; given the landing, a walk may write some in place
    itself, ``Landing.place``) in its parameters inside vLLM's layerwise reload, each module finished as its last
    piece lands; the bytes landed. Torn from the first piece until every parameter is whole: a
    failure leaves the worker torn (the updater's fail-stop state), its load abandoned."""
    model = engine.updater.model  # the engine's own adapter: what it fixed up once (MoE prepacking) stays once
    model.begin_load(table)
    engine.updater.torn = True
    try:
        landing = Landing(engine.model, layout, table)
        landing.land(pieces(landing))
        landing.finish()
        model.end_load(False)
    except BaseException:
        model.abandon_load()
        raise
    engine.updater.torn = False
    return landing.nbytes


def request(
    order: Order, table: TensorTable, layouts: Sequence[WorkerLayout], plan_key: str, held: bool = False
) -> dict[str, Any]:
    """The JSON a replica's workers take (``WorkerExtension.weightsync_receive_regions``); ``held``: every worker
    parsed the plan ``plan_key``'s table, regions and layouts before (they are left out)."""
    out = {
        "version": order.version,
        "rendezvous": order.rendezvous.to_dict(),
        "copied": plans.links_to(order.copied),
        "plan_key": plan_key,
    }
    if not held:
        out |= {
            "table": table.to_dict(),
            "regions": plans.regions_to(order.regions),
            "layouts": [w.to_dict() for w in layouts],
        }
    return out


def from_request(engine: Any, d: Mapping[str, Any]) -> dict[str, Any]:
    order, part = parse(d, engine.updater.ctx.rank, engine.updater.parts)
    return receive(engine, order, part.table, part.layout)


def parse(d: Mapping[str, Any], worker: int, parts: dict[str, Part]) -> tuple[Order, Part]:
    """Worker ``worker``'s order and part of ``request``'s JSON ``d``: the plan's part parsed from it, or taken from
    ``parts`` (the worker's, by plan key) where it left them out; ``parts`` keeps it, the newest last."""
    key = str(d["plan_key"])
    part = parts.pop(key, None)
    if "regions" in d:
        layouts = [WorkerLayout.from_dict(w) for w in d["layouts"]]
        mine = next((w for w in layouts if w.rank == worker), None)
        if mine is None:
            raise PermanentError(
                f"the request gives no layout for worker {worker} (it gives {[w.rank for w in layouts]})"
            )
        part = Part(TensorTable.from_dict(d["table"]), mine, tuple(plans.regions_from(d["regions"])))
    elif part is None:
        raise PermanentError(
            f"worker {worker}: the request leaves out the regions of plan {key[:19]}..., which this worker has not "
            f"parsed (it holds {len(parts)} plans' parts: a worker restarted under its agent?); the next version "
            "carries them"
        )
    parts[key] = part  # the newest last
    while len(parts) > PARTS_KEPT:
        del parts[next(iter(parts))]
    order = Order(int(d["version"]), Rendezvous.from_dict(d["rendezvous"]), part.regions, plans.links_from(d["copied"]))
    return order, part


__all__ = ["PARTS_KEPT", "Order", "Part", "from_request", "land", "parse", "receive", "request", "walk"]
