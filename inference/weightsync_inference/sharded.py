"""A sharded update in one worker: only its regions, from every trainer rank, landed in its parameters.

The worker half of the sharded path's data path (``docs/sharded.md``). The worker joins
its replica's region group (a CPU-stream or NCCL ``Rendezvous`` whose ``rank`` is the number
of trainer ranks: they hold group ranks ``0..rank-1``, and worker ``w`` of the replica joins
as ``rank + w`` of ``world_size``; over NCCL on the worker's GPU; kept across versions while
the plan names the same group, ``region_groups.Kept``), checks
the table against vLLM's loader (``dryrun``, changing nothing), then inside vLLM's layerwise
reload receives its regions in plan order (``weightsync.channels.regions.receive``: each
region's digest checked on arrival) and
lands each one (``landing.Landing``); a failure after the first byte landed leaves the
worker torn (the updater's fail-stop state), as any in-place update does.

Answers what it received: bytes, each region's digest in its order (the agent combines
the workers' lists in plan order, ``regions.combine``), seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from weightsync.channels import region_groups, regions
from weightsync.channels.base import Rendezvous
from weightsync.errors import PermanentError
from weightsync.sharding import plans
from weightsync.sharding.fills import Fill, WorkerLayout
from weightsync.sharding.plans import Region
from weightsync.tensors import TensorTable
from weightsync_inference.landing import Landing


def receive(
    engine: Any, rendezvous: Rendezvous, table: TensorTable, replica_regions: Sequence[Region], layout: WorkerLayout
) -> dict[str, Any]:
    """Receive and land this worker's regions of ``replica_regions`` (its replica's, every worker's, plan order)."""
    worker = engine.updater.ctx.rank
    if layout.rank != worker:
        raise PermanentError(f"worker {worker} was given worker {layout.rank}'s layout")
    engine.updater.model.check(table)  # refuses a table the model would not load, having changed nothing
    device, kept = engine.updater.ctx.device, engine.updater.regions
    tally = regions.Tally()
    t0 = time.perf_counter()
    try:
        group = kept.get(rendezvous, rendezvous.rank + worker, device)  # its formation bounded, as every wait
        on = device if isinstance(group, region_groups.NcclMember) else "cpu"
        walk = regions.receive(
            group.pg, rendezvous.rank, worker, table, replica_regions, tally, on, bound=region_groups.bound(group)
        )
        landed = land(engine, layout, table, walk)
    except BaseException:
        kept.close()  # never formed again under its name: the coordinator names a new group after a failure
        raise
    return {
        "worker": worker,
        "layout_digest": table.layout_digest(),  # of the table this worker checked and landed
        "nbytes": tally.nbytes,
        "landed": landed,
        "digests": tally.digests,
        "seconds": time.perf_counter() - t0,
    }


def land(engine: Any, layout: WorkerLayout, table: TensorTable, pieces: Iterable[tuple[Fill, Any]]) -> int:
    """Land ``pieces`` (this worker's, as they arrive) in its parameters inside vLLM's layerwise reload, each module
    finished as its last piece lands; the bytes landed. Torn from the first piece until every parameter is whole: a
    failure leaves the worker torn (the updater's fail-stop state), its load abandoned."""
    model = engine.updater.model  # the engine's own adapter: what it fixed up once (MoE prepacking) stays once
    model.begin_load(table)
    engine.updater.torn = True
    try:
        landing = Landing(engine.model, layout, table)
        landing.land(pieces)
        landing.finish()
        model.end_load(False)
    except BaseException:
        model.abandon_load()
        raise
    engine.updater.torn = False
    return landing.nbytes


def request(
    rendezvous: Rendezvous, table: TensorTable, replica_regions: Sequence[Region], layouts: Sequence[WorkerLayout]
) -> dict[str, Any]:
    """The JSON a replica's workers take (``WorkerExtension.weightsync_receive_regions``)."""
    return {
        "rendezvous": rendezvous.to_dict(),
        "table": table.to_dict(),
        "regions": plans.regions_to(replica_regions),
        "layouts": [w.to_dict() for w in layouts],
    }


def from_request(engine: Any, d: Mapping[str, Any]) -> dict[str, Any]:
    worker = engine.updater.ctx.rank
    layouts = [WorkerLayout.from_dict(w) for w in d["layouts"]]
    mine = next((w for w in layouts if w.rank == worker), None)
    if mine is None:
        raise PermanentError(f"the request gives no layout for worker {worker} (it gives {[w.rank for w in layouts]})")
    rdv = Rendezvous.from_dict(d["rendezvous"])
    return receive(engine, rdv, TensorTable.from_dict(d["table"]), plans.regions_from(d["regions"]), mine)


__all__ = ["from_request", "land", "receive", "request"]
