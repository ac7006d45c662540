"""What the sharded transfer plan moves, per worker, per trainer rank and per link, against today's gathered path.

CPU only, no bytes move: the trainer's layout (FSDP2 over ``R`` ranks), the replicas'
engine layouts recorded from vLLM's own loaders (``bench/engine_layouts.py``: vLLM's
model classes on the meta device, one per worker) and the plan
(``weightsync.sharding.plans``). Printed per configuration:

- per worker, bytes received / bytes its layout needs (1.00: nothing extra arrives),
  against the gathered path, where every worker receives the whole table;
- bytes sent per trainer rank (min / max), the busiest link, the regions per link;
- the time to compute the plan, and to find it again in the cache.

``--scale`` adds the at-scale model (Qwen3-235B-A22B from 64 FSDP GPUs to 8 replicas
at TP8/EP8; Kimi-K2 from 256 to 128 GPUs): every trainer-to-worker link crosses the
InfiniBand fabric (trainer and replicas on nodes of their own), and the bound is the
busiest NIC, sending or receiving, over its rate.

    python bench/sharded_plan.py            # tiny, Qwen3-1.7B, Qwen3-8B; a few minutes the first time
    python bench/sharded_plan.py --scale    # + 235B and Kimi-K2 (records their layouts once: ~10 min)
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from engine_layouts import CONFIGS, checkpoint_table, engine_layout

from weightsync.coordinator import serde
from weightsync.sharding.fills import EngineLayout
from weightsync.sharding.plans import Member, PlanCache, TransferPlan
from weightsync.sharding.shards import REPLICATE, Mesh, Placement, TrainerLayout
from weightsync.tensors import TensorTable

NVLINK_GBS = 360.0
"""H200 NVLink, one direction, what NCCL moves GPU to GPU (ENVIRONMENT.md: 360.6 GB/s flat broadcast, 2x H200)."""
HBM_COPY_GBS = 2072.0
"""Same-GPU device copy (ENVIRONMENT.md: 3.44 GB in 1.66 ms)."""
IB_GBS = 46.0
"""Assumed, not measured here: one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s line rate), ~92% of it for large
RDMA writes (NCCL's and NIXL's published all-to-all figures on such fabrics)."""
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def fsdp(table: TensorTable, ranks: int) -> TrainerLayout:
    """FSDP2 over ``ranks``: dense tensors ``Shard(0)``; experts as transformers 5 holds them, one 3-D parameter per
    layer sharded on the expert dimension, so each expert is whole on one rank (``torch.chunk``'s owner)."""
    meshes = [Mesh((ranks,), tuple(range(ranks)))] + [Mesh((1,), (r,)) for r in range(ranks)]
    experts = max((int(m.group(1)) + 1 for s in table if (m := _EXPERT.search(s.name))), default=0)
    per_rank = -(-experts // ranks) if experts else 1
    placements = []
    for spec in table:
        m = _EXPERT.search(spec.name)
        if m:
            placements.append(Placement(1 + int(m.group(1)) // per_rank, (REPLICATE,)))
        else:
            placements.append(Placement(0, (0,)))
    return TrainerLayout(table, ranks, tuple(meshes), tuple(placements))


@dataclass
class Row:
    what: str
    workers: int
    need_gb: float
    ratio: float
    gathered_ratio: float
    sent_min_gb: float
    sent_max_gb: float
    busiest_link_gb: float
    regions: int
    regions_per_link: float
    plan_s: float
    cached_ms: float


def measure(what: str, trainer: TrainerLayout, layouts: list[EngineLayout]) -> Row:
    members = [Member(f"replica-{i}", layout) for i, layout in enumerate(layouts)]
    cache = PlanCache()
    start = time.perf_counter()
    plan = cache.get(trainer, members)
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    assert cache.get(trainer, members) is plan and cache.computed == 1
    cached_ms = (time.perf_counter() - start) * 1e3
    table = trainer.table
    received = plan.bytes_received()
    ratios, needs = [], []
    for m in members:
        assert m.layout is not None
        for w in m.layout.workers:
            need = w.bytes_needed(table)
            needs.append(need)
            ratios.append(received.get((m.replica_id, w.rank), 0) / need)
    sent = plan.bytes_sent()
    links = plan.links()
    regions = sum(len(r.regions) for r in plan.replicas)
    row = Row(
        what,
        len(needs),
        max(needs) / 1e9,
        max(ratios) if min(ratios) == max(ratios) else float("nan"),
        table.total_bytes / max(needs),
        min(sent.get(r, 0) for r in range(trainer.world_size)) / 1e9,
        max(sent.values()) / 1e9,
        max(links.values()) / 1e9,
        regions,
        regions / len(links),
        plan_s,
        cached_ms,
    )
    return row


def print_rows(rows: list[Row]) -> None:
    print(
        "| configuration | workers | GB per worker | received / needed | gathered: received / needed "
        "| GB sent per rank (min-max) | busiest link GB | regions | regions per link | plan s | cached ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.what} | {r.workers} | {r.need_gb:.3f} | {r.ratio:.2f} | {r.gathered_ratio:.2f} "
            f"| {r.sent_min_gb:.3f}-{r.sent_max_gb:.3f} | {r.busiest_link_gb:.3f} | {r.regions} "
            f"| {r.regions_per_link:.1f} | {r.plan_s:.2f} | {r.cached_ms:.3f} |"
        )


def colocated_bound(plan: TransferPlan, gpus: int) -> dict[str, float]:
    """Trainer rank r and worker r share GPU r (the 2-GPU case of the issue): rank r -> worker r is a same-GPU
    copy, every other pair crosses NVLink. The bound is the slowest GPU: its NVLink sends and receives run both
    ways at once, its copies beside them."""
    cross_out, cross_in, local = [0] * gpus, [0] * gpus, [0] * gpus
    for (rank, _, worker), nbytes in plan.links().items():
        if rank == worker:
            local[rank] += nbytes
        else:
            cross_out[rank] += nbytes
            cross_in[worker] += nbytes
    nvlink_ms = max(max(o, i) for o, i in zip(cross_out, cross_in, strict=True)) / NVLINK_GBS / 1e6
    copy_ms = max(local) / HBM_COPY_GBS / 1e6
    model_gb = sum(plan.bytes_received().values()) / 1e9 if gpus == 2 else float("nan")  # the TP halves, summed
    return {
        "cross_gb_each_way": max(cross_out) / 1e9,
        "colocated_gb": sum(local) / 1e9,
        "nvlink_ms": nvlink_ms,
        "copy_ms": copy_ms,
        "bound_ms": max(nvlink_ms, copy_ms),
        # today's path on the same GPUs, links only: an all-gather (each GPU receives the other's half), then rank
        # 0's broadcast of the whole model to worker 1 (worker 0 shares rank 0's GPU)
        "gathered_ms": (model_gb / 2 + model_gb) / NVLINK_GBS * 1e3,
    }


def at_scale(model: str, trainer_gpus: int, replicas: int, tp: int, ep: bool, layers: int | None) -> dict[str, Any]:
    """The plan's busiest NIC over InfiniBand, trainer and replicas on nodes of their own.

    With ``layers``, the plan covers the embedding, the first ``layers`` decoder layers and the head, and the
    per-link bytes of the decoder layers past the dense ones are scaled to the model's full depth (all its MoE
    layers have one shape, and FSDP2 places each alike)."""
    config = CONFIGS[model]
    full_table = checkpoint_table(model)
    short = model if layers is None else _shortened(model, layers)
    table = checkpoint_table(short)
    trainer = fsdp(table, trainer_gpus)
    layout = engine_layout(short, tp, ep)
    start = time.perf_counter()
    one = PlanCache().get(trainer, [Member("replica-0", layout)])  # replicas alike: each link's bytes repeat
    plan_s = time.perf_counter() - start
    depth = config["num_hidden_layers"]
    dense = config.get("first_k_dense_replace", 0)
    scale: dict[int, float] = {}
    for t, spec in enumerate(table):
        m = _LAYER.search(spec.name)
        layer = int(m.group(1)) if m else -1
        scale[t] = (depth - dense) / (layers - dense) if layers is not None and layer >= dense else 1.0
    send, recv = [0.0] * trainer_gpus, [0.0] * tp
    regions = 0
    for _, r in one.ordered():
        send[r.rank] += r.nbytes * scale[r.tensor] * replicas
        recv[r.worker] += r.nbytes * scale[r.tensor]
        regions += 1
    model_gb = full_table.total_bytes / 1e9
    send_s, recv_s = max(send) / IB_GBS / 1e9, max(recv) / IB_GBS / 1e9
    # wire sizes against the coordinator's 4 MiB message limit; a shortened model's grow with its depth
    depth_scale = depth / (layers or depth)
    part_mb = serde.transfer_part_to(one.part_for_replica("replica-0")).ByteSize() / 1e6 * depth_scale
    wire_mb = {
        "trainer_layout_mb": serde.trainer_layout_to(fsdp(full_table, trainer_gpus)).ByteSize() / 1e6,
        "engine_layout_mb": serde.engine_layout_to(layout).ByteSize() / 1e6 * depth_scale,
        "replica_part_mb": part_mb,
        "open_version_mb": part_mb * replicas,  # rank 0's: every replica's part (each repeats the one planned here)
    }
    return {
        "model": model,
        "model_gb": model_gb,
        "trainer_gpus": trainer_gpus,
        "replicas": replicas,
        "tp": tp,
        "worker_gb": max(recv) / 1e9,
        "rank_sent_gb_max": max(send) / 1e9,
        "rank_sent_gb_mean": sum(send) / trainer_gpus / 1e9,
        "bound_s": max(send_s, recv_s),
        "limit": "trainer NICs (each rank sends its shard to every replica)" if send_s > recv_s else "worker NICs",
        "recv_s": recv_s,
        "send_s": send_s,
        "gathered_s": model_gb / IB_GBS,
        "regions_per_replica_planned": regions,
        "plan_s": plan_s,
        "layers_planned": layers or depth,
        **wire_mb,
    }


def _shortened(model: str, layers: int) -> str:
    name = f"{model}-{layers}l"
    CONFIGS[name] = {**CONFIGS[model], "num_hidden_layers": layers}
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", action="store_true", help="also the at-scale model (235B, Kimi-K2)")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args()
    out: dict[str, Any] = {}
    rows = []
    cases = [("qwen3-tiny", (1, 2), (2, 4)), ("qwen3-1.7b", (1, 2, 4, 8), (2, 8)), ("qwen3-8b", (1, 2, 4, 8), (2, 8))]
    for model, tps, trainers in cases:
        table = checkpoint_table(model)
        for tp in tps:
            layout = engine_layout(model, tp)
            for ranks in trainers:
                rows.append(measure(f"{model}, FSDP {ranks} -> TP{tp} x2", fsdp(table, ranks), [layout, layout]))
                if ranks == 2 and tp == 2 and model != "qwen3-tiny":
                    one = PlanCache().get(fsdp(table, 2), [Member("replica-0", layout)])
                    out[f"{model}-2gpu"] = colocated_bound(one, 2)
    print_rows(rows)
    out["rows"] = [r.__dict__ for r in rows]
    for key, bound in ((k, v) for k, v in out.items() if k.endswith("2gpu")):
        print(f"{key}: {json.dumps({k: round(v, 3) for k, v in bound.items()})}")
    if args.scale:
        out["scale"] = [
            at_scale("qwen3-235b-a22b", 64, 8, 8, True, None),
            at_scale("kimi-k2", 256, 4, 32, True, 4),
        ]
        for s in out["scale"]:
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
