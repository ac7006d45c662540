"""A sharded version's control path at Qwen3-235B's size, through a real coordinator over gRPC.

    .venv/bin/python bench/control_at_scale.py [--model qwen3-235b-a22b] [--ranks 64] [--replicas 8] [--tp 8]

No bytes of weights move: a coordinator server (gRPC, in this process), a trainer's client that registers its
FSDP2 layout over ``--ranks`` ranks, and ``--replicas`` replicas' clients that each register the engine layout
vLLM's loaders recorded for TP``--tp`` with expert parallelism (``bench/engine_layouts.py``: recorded once, cached)
and watch. Then two versions, timed from the trainer's ``open_version`` call to each replica's decoded ``ASSIGN``:
the first computes the plan and carries it (parts past a message's room read with ``GetPlanRegions``), the second
names the plan's key only. Meanwhile one more client renews its lease in a loop: its slowest renewal is how long the
coordinator's other calls waited (a new plan is computed off the coordinator's lock).
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from typing import Any

from engine_layouts import checkpoint_table, engine_layout
from sharded_plan import fsdp

from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import serde, server
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import Assignment, Capabilities, summarize
from weightsync.vocabulary import Channel

CPU = Capabilities(host="n", channels=(Channel.CPU,))


def run(model: str, ranks: int, replicas: int, tp: int) -> dict[str, Any]:
    table = checkpoint_table(model)
    trainer_layout, engine = fsdp(table, ranks), engine_layout(model, tp, True)
    config = server.ServerConfig(insecure=True, port=0, lease_ttl_s=30.0, metrics_port=0)
    coordinator = server.CoordinatorServer(config).start()
    clients: list[CoordinatorClient] = []

    def client() -> CoordinatorClient:
        clients.append(CoordinatorClient(coordinator.target, insecure=True, timeout_s=600))
        return clients[-1]

    out: dict[str, Any] = {"model": model, "ranks": ranks, "replicas": replicas, "tp": tp}
    try:
        trainer = client()
        t = time.perf_counter()
        trainer.register_trainer(
            "job", "t", CPU, offers=[Offer(Channel.CPU, Endpoint("127.0.0.1", 29999))], layout=trainer_layout
        )
        out["register_trainer_s"] = time.perf_counter() - t
        out["layout_mb"] = {
            "trainer": serde.trainer_layout_to(trainer_layout).ByteSize() / 1e6,
            "engine": serde.engine_layout_to(engine).ByteSize() / 1e6,
        }
        events: queue.Queue[tuple[str, float, Assignment]] = queue.Queue()
        t = time.perf_counter()
        for i in range(replicas):
            c = client()
            c.register_replica("job", f"replica-{i}", CPU, layout=engine)
            rid = f"replica-{i}"
            threading.Thread(
                target=lambda c=c, rid=rid: [events.put((rid, time.perf_counter(), e)) for e in c.watch()],
                daemon=True,
            ).start()
        out["register_replicas_s"] = time.perf_counter() - t
        time.sleep(1.0)  # every stream up: each replica is planned
        renewals: list[float] = []
        renewer, stop = client(), threading.Event()
        renewer.register_replica("job", "renewer", Capabilities(host="n", channels=(Channel.VOLUME,)))

        def renew() -> None:
            while not stop.is_set():
                s = time.perf_counter()
                renewer._call("Renew", lambda: serde.renew_request(renewer.lease.lease_id))
                renewals.append(time.perf_counter() - s)
                time.sleep(0.05)

        threading.Thread(target=renew, daemon=True).start()
        for step, name in ((1, "first"), (2, "held")):
            renewals.clear()
            t = time.perf_counter()
            opened = trainer.open_version(step, summarize(table, True), timeout_s=600)
            opened_s = time.perf_counter() - t
            got = {}
            while len(got) < replicas:
                rid, at, e = events.get(timeout=600)
                if e.version == opened.version:
                    got[rid] = at - t
                    assert e.plan is not None and e.plan.regions_part() is not None, e.plan
            parts = [p.regions_part() for p in opened.plans]
            out[name] = {
                "open_version_s": opened_s,
                "last_assign_s": max(got.values()),
                "regions_per_replica": len(parts[0].regions) if parts[0] else 0,
                "slowest_renewal_s": max(renewals, default=0.0),
            }
            print(name, json.dumps(out[name]), flush=True)
        stop.set()
    finally:
        for c in clients:
            c.close()
        coordinator.stop(0.5)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-235b-a22b")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--json", default="", help="write the result to this file")
    args = p.parse_args()
    result = run(args.model, args.ranks, args.replicas, args.tp)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
