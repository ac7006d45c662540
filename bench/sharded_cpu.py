"""The sharded path's data path on the CPU (gloo) against today's gather + broadcast, in one run.

    .venv/bin/python bench/sharded_cpu.py [--ranks 2] [--tp 2] [--layers 2] [--reps 3] [--json out.json]

One process per trainer rank and per worker of one tensor-parallel replica, on this host, over gloo. The job:
Qwen2-0.5B's layer shapes (``--layers`` decoder layers, a ``--vocab``-row vocabulary, bf16), held by the trainer as
FSDP2 does (``Shard(0)`` of every tensor over ``--ranks``), kept by the workers as vLLM keeps them at
``--tp`` (q/k/v, gate/up and the vocabulary by rows, o/down by columns, norms whole). Per rep, both timed from
a barrier of every process to the last worker holding its bytes:

- ``sharded``: the plan (``weightsync.sharding.plans``); every rank sends its regions from its own shard
  (``weightsync.channels.regions.send``, digests on), every worker receives only its regions and copies each
  into its parameter;
- ``gathered``: today's path: every tensor all-gathered over the trainer's ranks (what ``full_tensor`` does),
  then rank 0 broadcasts each layer group, packed, to the workers, each of which receives every full tensor
  and copies its slice (no digests: conservative for the sharded side).

A first round of both, untimed, warms them up. Prints, per worker, bytes received / bytes its layout needs,
bytes sent per rank, and the median times with their ratio; ``--json`` writes every sample.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, KV, INTER = 896, 128, 4864


def job(layers: int, ranks: int, tp: int, vocab: int) -> tuple[Any, Any, Any]:
    """(trainer layout, engine layout, plan)."""
    from weightsync.sharding.boxes import Box
    from weightsync.sharding.fills import EngineLayout, Fill, ParamSpec, WorkerLayout
    from weightsync.sharding.plans import Member, plan
    from weightsync.sharding.shards import Mesh, Placement, TrainerLayout, chunk
    from weightsync.tensors import TensorTable

    def layer(i: int) -> list[tuple[str, str, tuple[int, ...]]]:
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (HIDDEN, HIDDEN), "self_attn.k_proj.weight": (KV, HIDDEN),
            "self_attn.v_proj.weight": (KV, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            "mlp.gate_proj.weight": (INTER, HIDDEN), "mlp.up_proj.weight": (INTER, HIDDEN),
            "mlp.down_proj.weight": (HIDDEN, INTER), "input_layernorm.weight": (HIDDEN,),
            "post_attention_layernorm.weight": (HIDDEN,),
        }  # fmt: skip
        return [(p + n, "bfloat16", s) for n, s in shapes.items()]

    groups = [[("model.embed_tokens.weight", "bfloat16", (vocab, HIDDEN))]]
    groups += [layer(i) for i in range(layers)]
    groups += [[("model.norm.weight", "bfloat16", (HIDDEN,)), ("lm_head.weight", "bfloat16", (vocab, HIDDEN))]]
    table = TensorTable.build(groups)
    trainer = TrainerLayout(
        table, ranks, (Mesh((ranks,), tuple(range(ranks))),), tuple(Placement(0, (0,)) for _ in table)
    )
    workers = []
    for w in range(tp):
        params, fills = [], []
        for t, spec in enumerate(table):
            dim = 1 if spec.name.endswith(("o_proj.weight", "down_proj.weight")) else 0
            if len(spec.shape) == 1:
                need = Box.whole(spec.shape)
            else:
                start, n = chunk(spec.shape[dim], tp, w)
                need = Box(
                    tuple(start if d == dim else 0 for d in range(2)),
                    tuple(n if d == dim else s for d, s in enumerate(spec.shape)),
                )
            params.append(ParamSpec(spec.name, spec.dtype, need.lengths))
            fills.append(Fill(t, need, len(params) - 1, Box((0,) * len(need.lengths), need.lengths)))
        workers.append(WorkerLayout(w, tuple(params), tuple(fills)))
    engine = EngineLayout(table.layout_digest(), tuple(workers))
    return trainer, engine, plan(trainer, [Member("r", engine)])


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from weightsync.channels import regions

    trainer, engine, result = job(args.layers, args.ranks, args.tp, args.vocab)
    table = trainer.table
    world = args.ranks + args.tp
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=args.me, world_size=world)
    trainers = dist.new_group(list(range(args.ranks)))
    fanout = dist.new_group([0, *range(args.ranks, world)])
    everyone = dist.group.WORLD
    is_trainer = args.me < args.ranks
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s.shape, generator=gen).bfloat16() for s in table] if is_trainer else []
    boxes = [trainer.shard(t, args.me) for t in range(len(table))] if is_trainer else []
    local = [None if b is None else full[t][_slices(b)].clone() for t, b in enumerate(boxes)]
    worker = args.me - args.ranks
    layout = engine.workers[worker] if not is_trainer else None
    params = [torch.empty(p.shape, dtype=torch.bfloat16) for p in layout.params] if layout else []
    samples: list[dict[str, Any]] = []
    for _ in range(args.reps + 1):  # the first round warms both paths up (gloo's pairs, the allocator): not counted
        for mode in ("sharded", "gathered"):
            dist.barrier(everyone)
            start = time.time()
            nbytes = 0
            if mode == "sharded":
                if is_trainer:
                    mine = [r for r in result.replica("r").regions if r.rank == args.me]
                    nbytes = regions.send(everyone, trainer, args.me, local, mine).nbytes
                else:
                    tally = regions.Tally()
                    for fill, data in regions.receive(
                        everyone, args.ranks, worker, table, result.replica("r").regions, tally
                    ):
                        params[fill.param][_slices(fill.dest)].copy_(data.reshape(fill.dest.lengths))
                    nbytes = tally.nbytes
            else:
                for group in table.groups():
                    tensors = []
                    if is_trainer:
                        for spec in group:
                            t = table.tensors.index(spec)
                            parts = [torch.empty_like(local[t]) for _ in range(args.ranks)]
                            dist.all_gather(parts, local[t], group=trainers)  # even Shard(0) chunks here
                            tensors.append(torch.cat(parts))
                    if args.me == 0 or not is_trainer:
                        size = sum(s.nbytes for s in group)
                        flat = (
                            torch.cat([t.view(-1).view(torch.uint8) for t in tensors])
                            if tensors
                            else torch.empty(size, dtype=torch.uint8)
                        )
                        dist.broadcast(flat, src=0, group=fanout)
                        nbytes += size
                        if layout is not None:
                            at = 0
                            for spec in group:
                                t = table.tensors.index(spec)
                                whole = flat[at : at + spec.nbytes].view(torch.bfloat16).view(spec.shape)
                                (f,) = layout.needs()[t]
                                params[f.param].copy_(whole[_slices(f.source)])
                                at += spec.nbytes
            samples.append({"mode": mode, "start": start, "end": time.time(), "nbytes": nbytes})
    Path(args.out, f"{args.me}.json").write_text(
        json.dumps({"me": args.me, "needed": layout.bytes_needed(table) if layout else 0, "samples": samples})
    )
    dist.destroy_process_group()


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000, help="rows of the embedding and the head")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--me", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.me is not None:
        child(args)
        return
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
    )
    out = Path(tempfile.mkdtemp(prefix="sharded-cpu-"))
    common = [
        *("--ranks", str(args.ranks), "--tp", str(args.tp), "--layers", str(args.layers)),
        *("--vocab", str(args.vocab), "--reps", str(args.reps)),
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *common, "--me", str(me), "--port", str(store.port), "--out", str(out)], cwd=ROOT
        )
        for me in range(args.ranks + args.tp)
    ]
    codes = [proc.wait(timeout=1800) for proc in procs]
    if codes != [0] * len(procs):
        raise SystemExit(f"bench processes exited {codes}")
    reports = [json.loads((out / f"{me}.json").read_text()) for me in range(len(procs))]
    table = job(args.layers, args.ranks, args.tp, args.vocab)[0].table
    times: dict[str, list[float]] = {"sharded": [], "gathered": []}
    for i in range(2, 2 * (args.reps + 1)):
        mode = reports[0]["samples"][i]["mode"]
        times[mode].append(
            max(r["samples"][i]["end"] for r in reports) - min(r["samples"][i]["start"] for r in reports)
        )
    print(f"table: {len(table)} tensors, {table.total_bytes / 1e6:.1f} MB; trainer ranks {args.ranks}, TP={args.tp}")
    for r in reports[args.ranks :]:
        got = {s["mode"]: s["nbytes"] for s in r["samples"][:2]}
        print(
            f"worker {r['me'] - args.ranks}: sharded received {got['sharded'] / 1e6:.1f} MB = "
            f"{got['sharded'] / r['needed']:.2f} x its need; gathered received {got['gathered'] / 1e6:.1f} MB = "
            f"{got['gathered'] / r['needed']:.2f} x"
        )
    for r in reports[: args.ranks]:
        got = {s["mode"]: s["nbytes"] for s in r["samples"][:2]}
        print(
            f"rank {r['me']}: sharded sent {got['sharded'] / 1e6:.1f} MB; gathered sent {got['gathered'] / 1e6:.1f} MB"
        )
    med = {m: statistics.median(v) for m, v in times.items()}
    print(
        f"time (median of {args.reps}): sharded {med['sharded'] * 1e3:.0f} ms, gathered + broadcast "
        f"{med['gathered'] * 1e3:.0f} ms, ratio {med['sharded'] / med['gathered']:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "times": times, "reports": reports}))


if __name__ == "__main__":
    main()
