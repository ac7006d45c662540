"""Host time per version of the sharded path's control messages: a plan's regions on each hop, every time or once.

    .venv/bin/python bench/plan_messages.py [--model qwen3-8b] [--ranks 2] [--tp 2] [--replicas 1] [--reps 5]

A version's plan (``weightsync.sharding.plans``) names hundreds of regions per link (1,232 for Qwen3-8B from 2
FSDP2 ranks to a TP=2 replica). They cross four hops before the first byte moves, each encoding and decoding them
on the critical path of a publish: the coordinator's ``OpenVersionResponse`` to trainer rank 0 and its ``ASSIGN``
on each replica's watch stream (protobuf), rank 0's round to the other ranks (JSON over gloo), and each agent's
request to its workers (JSON through vLLM's ``collective_rpc``). Since the plan is computed once per (trainer
layout, engine layouts, membership) (``PlanCache``), each end keeps the regions it decoded under the plan's key
and later versions carry the key only (``ReplicaRegions.held``, the round's and the request's ``plan_key``).

One process, the product's functions on each hop (``serde``, ``region_sends.Round``, ``sharded.request`` /
``sharded.parse``), the plan from the coordinator's core with the trainer's FSDP2 layout and the engine layout vLLM's
loaders recorded (``bench/data/layouts``, as ``bench/sharded_gpu.py`` reads them). Per hop, the host time of the
sender's encoding plus one receiver's decoding, for a version that carries the regions (the first of a plan:
``full``) and one that names the plan only (every later one: ``held``); median of ``--reps``. The hops run one
after the other in a publish (the workers and ranks decode at once, so one of each counts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sharded_gpu import checkpoint_table, load_layout
from sharded_plan import fsdp

from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import serde
from weightsync.coordinator.clock import ManualClock
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import Assignment, Capabilities, EventKind, Role, summarize
from weightsync.coordinator.store import MemoryStore
from weightsync.vocabulary import Channel
from weightsync_inference import sharded
from weightsync_trainer import region_sends

CPU = Capabilities(host="n", channels=(Channel.CPU,))


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def run(model: str, ranks: int, tp: int, replicas: int, reps: int) -> dict[str, Any]:
    table = checkpoint_table(model)
    engine = load_layout(model, tp)
    core = Coordinator(lease_ttl_s=3600.0, store=MemoryStore(), clock=ManualClock())
    offers = (Offer(Channel.CPU, Endpoint("10.0.0.1", 29500)),)
    lease = core.register("job", Role.TRAINER, "t", "t1", CPU, offers=offers, layout=fsdp(table, ranks)).lease_id
    for i in range(replicas):
        core.register("job", Role.REPLICA, f"replica-{i}", f"i{i}", CPU, layout=engine)
    opened = core.open_version(lease, "job", "t1", 1, summarize(table, True))
    plan = next(p for p in opened.plans if p.replica_id == "replica-0")
    part = plan.regions_part()
    assert part is not None and plan.transfer is not None, plan.reason
    key = plan.transfer.key
    event = Assignment(EventKind.ASSIGN, "job", opened.version, plan=plan)
    targets = region_sends.targets(opened)
    told = region_sends.Round(opened.version, gather=False, targets=targets)
    order = sharded.Order(opened.version, plan.rendezvous, part.regions, part.copied)
    reported = {(t.plan_key, t.replica_id) for t in targets}
    kept = sharded.parse(sharded.request(order, table, engine.workers, key), 0, {})[1]  # what worker 0 parsed

    def hops(held: bool) -> dict[str, Callable[[], Any]]:
        return {
            "OpenVersion (coordinator -> rank 0)": lambda: serde.opened(
                serde.opened_to(opened, key if held else ""), _held(opened, held)
            ),
            "ASSIGN (coordinator -> each agent)": lambda: serde.event(
                serde.event_to(event, _held(opened, held, "replica-0")), _held(opened, held, "replica-0")
            ),
            "round (rank 0 -> each rank)": lambda: region_sends.Round.from_json(
                told.to_json(reported if held else frozenset()), _held(opened, held)
            ),
            "request (agent -> each worker)": lambda: sharded.parse(
                json.loads(json.dumps(sharded.request(order, table, engine.workers, key, held))),
                0,
                {key: kept} if held else {},
            ),
        }

    rows = {}
    for name in hops(False):
        rows[name] = {"full": _median_ms(hops(False)[name], reps), "held": _median_ms(hops(True)[name], reps)}
    return {
        "model": model,
        "ranks": ranks,
        "tp": tp,
        "replicas": replicas,
        "regions_per_replica": len(part.regions),
        "hops_ms": rows,
    }


def _held(opened: Any, held: bool, only: str | None = None) -> serde.HeldRegions:
    """What an end kept from the plan's first version (everything, or for a held version; nothing for a full one)."""
    out = serde.HeldRegions()
    if held:
        for p in opened.plans:
            if p.transfer is not None and (only is None or p.replica_id == only):
                for rp in p.transfer.replicas:
                    out.keep(p.transfer.key, rp.replica_id, rp.regions)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b", help="a model with recorded layouts (bench/data/layouts)")
    p.add_argument("--ranks", type=int, default=2, help="FSDP2 trainer ranks")
    p.add_argument("--tp", type=int, default=2, help="the replicas' tensor-parallel size (recorded: 1, 2, 4)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args()
    result = run(args.model, args.ranks, args.tp, args.replicas, args.reps)
    print(
        f"{result['model']}: {result['ranks']} ranks -> {result['replicas']} x TP={result['tp']}, "
        f"{result['regions_per_replica']} regions per replica; host ms per version, median of {args.reps}"
    )
    print(f"{'hop':40s} {'full':>9s} {'held':>9s}")
    for name, row in result["hops_ms"].items():
        print(f"{name:40s} {row['full']:9.2f} {row['held']:9.2f}")
    total = {k: sum(r[k] for r in result["hops_ms"].values()) for k in ("full", "held")}
    print(f"{'the four hops':40s} {total['full']:9.2f} {total['held']:9.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
