"""The sharded path on GPUs, trainer ranks and replicas on GPUs of their own, against today's gather + broadcast and
against the link bound of the same run.

    bash tools/gpu-host.sh python3 bench/sharded_gpu.py --gpus 4 --json out.json          # issue 29's 4-GPU runs
    bash tools/gpu-host.sh python3 bench/sharded_gpu.py --gpus 8 --json out.json          # its 8-GPU runs
    bash tools/gpu-host.sh python3 bench/sharded_gpu.py --ranks 2 --tp 2 --model qwen3-8b # one configuration
    .venv/bin/python bench/sharded_gpu.py --device cpu --model qwen3-tiny --gpus 4         # the same over gloo
    /work/bin/heavy .venv/bin/python bench/sharded_gpu.py --record   # (re)write bench/data/layouts (needs vLLM)

One process per GPU (process ``i`` on GPU ``i``) in one NCCL group: trainer ranks first (``--ranks``), then
``--replicas`` replicas of ``--tp`` workers each. The job: Qwen3's checkpoint tensors (real shapes, seeded random
bf16 values), held by the trainer as FSDP2 holds them (``Shard(0)`` over the ranks: ``sharded_plan.fsdp``), kept by
each worker as vLLM keeps them: the engine layouts recorded from vLLM's own loaders on meta models
(``engine_layouts.engine_layout``), carried as ``bench/data/layouts/<model>-tp<T>.json.gz`` because the GPU host
has no vLLM. The plan is ``weightsync.sharding.plans.plan``, computed in every process (torch-free, deterministic).

Per configuration:

- ``probe``: each link (trainer rank -> worker) alone, a plain ``send/recv`` of ``--probe-mb`` between its two
  GPUs, median of ``--reps``: that link's raw rate in this run;
- ``sharded``: every rank sends its regions from its own shard (``weightsync.channels.regions.send``, digests on:
  each link's regions packed into buckets of ``--bucket-mb``, the links of a rank batched), replica after replica
  in plan order; every worker receives only its regions (``regions.receive``) and copies each into its parameter;
- ``gathered``: today's path: each layer group's tensors all-gathered over the trainer ranks (FSDP2's padded
  ``Shard(0)`` chunks, as ``full_tensor`` does) into one flat buffer, which rank 0 broadcasts to every worker of
  every replica; each worker copies its part into its parameters.

Both timed from a barrier of every process (CUDA-synchronised) to the last process's CUDA-synchronised end (the
last region landed), clock ``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process of the host); a
first round of both, untimed, warms them up, and in it every worker checks its parameters bit-exact against the
trainer's tensors (zeroed before each mode, so a region that never came shows). The link bound: for each link,
the bytes the plan puts on it over its probed rate; the slowest link sets it. Printed: per worker bytes received /
bytes its layout needs, per rank bytes sent, the median times and the ratios, and whether issue 24's goals hold
(sharded <= 1.2 x the binding bound, the larger of the link and per-GPU bounds; <= 0.2 x gather + broadcast);
``--json`` writes every sample.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_layouts import checkpoint_table
from sharded_plan import fsdp

from weightsync.sharding.fills import WHOLE, EngineLayout, WorkerLayout
from weightsync.sharding.plans import Member, TransferPlan, plan

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = Path(__file__).resolve().parent / "data" / "layouts"
RECORDED = {"qwen3-tiny": (1, 2, 4), "qwen3-1.7b": (1, 2, 4), "qwen3-8b": (1, 2, 4)}
PRESETS = {
    # (trainer ranks, tp, replicas): issue 29's runs for the GPUs the host lends
    4: [(2, 2, 1), (1, 1, 1), (1, 1, 3)],
    8: [(4, 2, 2), (4, 4, 1), (1, 1, 1), (1, 1, 7)],
}


def layout_path(model: str, tp: int) -> Path:
    return LAYOUTS / f"{model}-tp{tp}.json.gz"


def record() -> None:
    """Write the recorded engine layouts the GPU host reads (vLLM's loaders on meta models: needs vLLM here)."""
    from engine_layouts import engine_layout

    LAYOUTS.mkdir(parents=True, exist_ok=True)
    for model, tps in RECORDED.items():
        for tp in tps:
            layout = engine_layout(model, tp)
            data = {
                "model": model,
                "tp": tp,
                "table_digest": layout.table_digest,
                "workers": [w.to_dict() for w in layout.workers],
            }
            path = layout_path(model, tp)
            # mtime 0: the same layout writes the same bytes, so a re-record shows no diff
            with gzip.GzipFile(path, "wb", mtime=0) as f:
                f.write(json.dumps(data, sort_keys=True).encode())
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1e3:.1f} kB", file=sys.stderr)


def load_layout(model: str, tp: int) -> EngineLayout:
    path = layout_path(model, tp)
    if not path.is_file():
        raise SystemExit(
            f"no recorded engine layout for {model} at TP={tp} ({path}); record it where vLLM is installed: "
            f"/work/bin/heavy .venv/bin/python bench/sharded_gpu.py --record (after adding it to RECORDED)"
        )
    data = json.loads(gzip.decompress(path.read_bytes()))
    table = checkpoint_table(model)
    if data["table_digest"] != table.layout_digest():
        raise SystemExit(
            f"{path} was recorded against table {data['table_digest']}, but {model}'s checkpoint table is now "
            f"{table.layout_digest()}: re-record it (bench/sharded_gpu.py --record)"
        )
    return EngineLayout(data["table_digest"], tuple(WorkerLayout.from_dict(w) for w in data["workers"]))


def job(model: str, ranks: int, tp: int, replicas: int) -> tuple[Any, EngineLayout, TransferPlan]:
    """(trainer layout, one replica's engine layout, the plan to ``replicas`` replicas of it)."""
    trainer = fsdp(checkpoint_table(model), ranks)
    engine = load_layout(model, tp)
    return trainer, engine, plan(trainer, [Member(f"replica-{i}", engine) for i in range(replicas)])


def tensor(table: Any, t: int, device: Any, seed: int) -> Any:
    """Table tensor ``t``'s values: the same on every process (one generator per tensor)."""
    import torch

    from weightsync.channels.wire import TORCH_DTYPES

    spec = table.tensors[t]
    g = torch.Generator(device=device).manual_seed(seed + t)
    return torch.randn(spec.shape, generator=g, device=device, dtype=TORCH_DTYPES[spec.dtype])


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from weightsync.channels import regions
    from weightsync.channels.wire import TORCH_DTYPES

    trainer, engine, result = job(args.model, args.ranks, args.tp, args.replicas)
    table = trainer.table
    bucket = int(args.bucket_mb * (1 << 20)) or regions.BUCKET
    world = args.ranks + args.replicas * args.tp
    cuda = args.device == "cuda"
    device = torch.device("cuda", args.me) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=args.me,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
        device_id=device if cuda else None,
    )
    trainers = dist.new_group(list(range(args.ranks)))
    workers = list(range(args.ranks, world))
    fanout = dist.new_group([0, *workers])
    # one group per replica, trainer ranks first: group rank = trainer rank, then R + worker (regions' convention)
    per_replica = [
        dist.new_group([*range(args.ranks), *workers[i * args.tp : (i + 1) * args.tp]]) for i in range(args.replicas)
    ]
    is_trainer = args.me < args.ranks
    replica, worker = divmod(args.me - args.ranks, args.tp)
    rid = f"replica-{replica}"
    layout = None if is_trainer else engine.workers[worker]
    local: list[Any] = []
    if is_trainer:
        for t in range(len(table)):
            box = trainer.shard(t, args.me)
            local.append(None if box is None else tensor(table, t, device, args.seed)[_slices(box)].clone())
    params = [torch.empty(p.shape, dtype=TORCH_DTYPES[p.dtype], device=device) for p in layout.params] if layout else []
    wholes = {
        f.tensor: torch.empty(
            table.tensors[f.tensor].shape, dtype=TORCH_DTYPES[table.tensors[f.tensor].dtype], device=device
        )
        for f in (layout.fills if layout else ())
        if f.param == WHOLE
    }

    def land(fill: Any, data: Any) -> None:
        into = wholes[fill.tensor] if fill.param == WHOLE else params[fill.param]
        into[_slices(fill.dest)].copy_(data.reshape(fill.dest.lengths))

    def sharded() -> int:
        if is_trainer:
            sent = 0
            for i, pg in enumerate(per_replica):  # replica after replica, in plan order
                mine = [r for r in result.replica(f"replica-{i}").regions if r.rank == args.me]
                sent += regions.send(pg, trainer, args.me, local, mine, bucket=bucket).nbytes
            return sent
        tally = regions.Tally()
        rows = result.replica(rid).regions
        for fill, data in regions.receive(
            per_replica[replica], args.ranks, worker, table, rows, tally, device, bucket=bucket
        ):
            land(fill, data)
        return tally.nbytes

    def gathered() -> int:
        moved = 0
        needs = layout.needs() if layout else {}
        for group in table.groups():
            ids = [table.tensors.index(spec) for spec in group]
            size = sum(spec.nbytes for spec in group)
            flat = torch.empty(size, dtype=torch.uint8, device=device) if args.me == 0 or not is_trainer else None
            at = 0
            for t in ids if is_trainer else ():
                full = _all_gather(dist, trainers, trainer, t, local[t], args.ranks, device)
                if flat is not None:
                    flat[at : at + full.nbytes].copy_(full.view(-1).view(torch.uint8))
                    at += full.nbytes
            if flat is None:
                continue
            dist.broadcast(flat, src=0, group=fanout)
            moved += size
            at = 0
            for t in ids:
                spec = table.tensors[t]
                whole = flat[at : at + spec.nbytes].view(TORCH_DTYPES[spec.dtype]).view(spec.shape)
                for fill in needs.get(t, ()):
                    land(fill, whole[_slices(fill.source)])
                at += spec.nbytes
        return moved

    def wrong() -> list[str]:
        """The fills whose parameter box differs from the trainer's tensor (bit-exact)."""
        out = []
        for t, fills in (layout.needs() if layout else {}).items():
            full = tensor(table, t, device, args.seed)
            for fill in fills:
                into = wholes[fill.tensor] if fill.param == WHOLE else params[fill.param]
                got = into[_slices(fill.dest)].reshape(-1)
                if not torch.equal(got, full[_slices(fill.source)].reshape(-1)):
                    out.append(f"{table.tensors[t].name} {fill.source}")
        return out

    def barrier() -> None:
        sync()
        if cuda:
            dist.barrier(device_ids=[args.me])
        else:
            dist.barrier()
        sync()

    probes = _probe(dist, barrier, sync, args, result, world, device)
    samples: list[dict[str, Any]] = []
    nbytes: dict[str, int] = {}
    mismatches: dict[str, list[str]] = {}
    for rep in range(args.reps + 1):  # round 0 warms up (NCCL's pairs, the allocator) and checks: not counted
        for mode, run in (("sharded", sharded), ("gathered", gathered)):
            if rep == 0:
                for p in [*params, *wholes.values()]:
                    p.zero_()
            barrier()
            start = time.perf_counter()
            moved = run()
            sync()
            end = time.perf_counter()
            if rep == 0:
                nbytes[mode] = moved
                mismatches[mode] = wrong()
            else:
                samples.append({"mode": mode, "start": start, "end": end})
    report = {
        "me": args.me,
        "role": "trainer" if is_trainer else "worker",
        "replica": None if is_trainer else rid,
        "worker": None if is_trainer else worker,
        "needed": layout.bytes_needed(table) if layout else 0,
        "nbytes": nbytes,
        "wrong": mismatches,
        "probes": probes,
        "samples": samples,
    }
    Path(args.out, f"{args.me}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _all_gather(dist: Any, group: Any, trainer: Any, t: int, shard: Any, ranks: int, device: Any) -> Any:
    """Tensor ``t`` whole on every trainer rank from their ``Shard(0)`` chunks, padded to equal size as FSDP2 pads."""
    import torch

    from weightsync.channels.wire import TORCH_DTYPES

    spec = trainer.table.tensors[t]
    rows = -(-spec.shape[0] // ranks)
    chunk = torch.zeros((rows, *spec.shape[1:]), dtype=TORCH_DTYPES[spec.dtype], device=device)
    if shard is not None:
        chunk[: shard.shape[0]].copy_(shard)
    out = torch.empty((rows * ranks, *spec.shape[1:]), dtype=chunk.dtype, device=device)
    if device.type == "cuda":
        dist.all_gather_into_tensor(out, chunk, group=group)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.chunk(ranks)), chunk, group=group)
    return out[: spec.shape[0]]


def _probe(
    dist: Any, barrier: Any, sync: Any, args: argparse.Namespace, result: TransferPlan, world: int, device: Any
) -> dict[str, float]:
    """Each planned link alone: a plain ``send/recv`` of ``--probe-mb`` MB; the receiver's median seconds, by
    ``"rank->global worker"``."""
    import torch

    buffer = torch.ones(args.probe_mb * 1_000_000, dtype=torch.uint8, device=device)
    out: dict[str, float] = {}
    for key in sorted(links(result, args.ranks, args.tp)):
        src, dst = (int(x) for x in key.split("->"))
        times = []
        for rep in range(args.reps + 1):
            barrier()
            start = time.perf_counter()
            if args.me == src:
                dist.send(buffer, dst)
            elif args.me == dst:
                dist.recv(buffer, src)
            sync()
            if rep:
                times.append(time.perf_counter() - start)
        if args.me == dst:
            out[key] = statistics.median(times)
    return out


def _global(ranks: int, tp: int, rid: str, worker: int) -> int:
    return ranks + int(rid.rsplit("-", 1)[1]) * tp + worker


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


def run_one(args: argparse.Namespace, model: str, ranks: int, tp: int, replicas: int) -> dict[str, Any]:
    """One configuration: its processes, then its numbers (printed and returned)."""
    import torch.distributed as dist

    world = ranks + replicas * tp
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < world:
            raise SystemExit(
                f"{model} {ranks} ranks -> {replicas} x TP={tp} needs {world} GPUs; this host has "
                f"{torch.cuda.device_count()}: pass fewer (--gpus 4) or ask for more"
            )
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300)
    )
    out = Path(tempfile.mkdtemp(prefix="sharded-gpu-"))
    common = [
        *("--model", model, "--ranks", str(ranks), "--tp", str(tp), "--replicas", str(replicas)),
        *("--reps", str(args.reps), "--device", args.device, "--probe-mb", str(args.probe_mb)),
        *("--seed", str(args.seed), "--port", str(store.port), "--out", str(out)),
        *("--bucket-mb", str(args.bucket_mb)),
    ]
    procs = [subprocess.Popen([sys.executable, __file__, *common, "--me", str(me)], cwd=ROOT) for me in range(world)]
    codes = [proc.wait(timeout=1800) for proc in procs]
    if codes != [0] * world:
        raise SystemExit(f"{model} {ranks} -> {replicas} x TP={tp}: bench processes exited {codes}")
    reports = [json.loads((out / f"{me}.json").read_text()) for me in range(world)]
    trainer, _, result = job(model, ranks, tp, replicas)
    return summarise(args, model, ranks, tp, replicas, trainer.table, result, reports)


def summarise(
    args: argparse.Namespace,
    model: str,
    ranks: int,
    tp: int,
    replicas: int,
    table: Any,
    result: TransferPlan,
    reports: list[dict[str, Any]],
) -> dict[str, Any]:
    from weightsync.channels import regions

    bucket_mb = args.bucket_mb or regions.BUCKET / (1 << 20)
    times: dict[str, list[float]] = {"sharded": [], "gathered": []}
    for i, s in enumerate(reports[0]["samples"]):
        times[s["mode"]].append(
            max(r["samples"][i]["end"] for r in reports) - min(r["samples"][i]["start"] for r in reports)
        )
    med = {m: statistics.median(v) for m, v in times.items()}
    probes = {k: v for r in reports for k, v in r["probes"].items()}
    rate = {k: args.probe_mb * 1e6 / s for k, s in probes.items()}
    link_bytes = links(result, ranks, tp)
    link_s = {k: n / rate[k] for k, n in link_bytes.items()}
    slowest = max(link_s, key=lambda k: link_s[k])
    bound = link_s[slowest]
    # links out of one GPU (into one GPU) share its NVLink ports: each GPU's bytes out and in at its fastest probed
    # link's rate, the busiest GPU, is a second bound the per-link one can hide
    gpus = {int(x) for k in link_bytes for x in k.split("->")}
    fastest = {g: max(r for k, r in rate.items() if str(g) in k.split("->")) for g in gpus}
    gpu_bound = max(max(_out_in(link_bytes, g)) / fastest[g] for g in gpus)
    what = f"{model}, FSDP {ranks} -> {replicas} x TP{tp}"
    print(f"\n{what} ({args.device}): {len(table)} tensors, {table.total_bytes / 1e9:.3f} GB; {len(reports)} processes")
    wrong = {m: sum(len(r["wrong"][m]) for r in reports) for m in times}
    for r in reports[ranks:]:
        got = r["nbytes"]
        print(
            f"  {r['replica']} worker {r['worker']} (proc {r['me']}): sharded received {got['sharded'] / 1e6:.1f} MB "
            f"= {got['sharded'] / r['needed']:.2f} x its need ({r['needed'] / 1e6:.1f} MB); gathered received "
            f"{got['gathered'] / 1e6:.1f} MB = {got['gathered'] / r['needed']:.2f} x; wrong fills: sharded "
            f"{len(r['wrong']['sharded'])}, gathered {len(r['wrong']['gathered'])}"
        )
    for r in reports[:ranks]:
        print(f"  rank {r['me']}: sharded sent {r['nbytes']['sharded'] / 1e6:.1f} MB")
    for k in sorted(link_s):
        print(f"  link {k}: {link_bytes[k] / 1e6:.1f} MB at {rate[k] / 1e9:.1f} GB/s raw = {link_s[k] * 1e3:.2f} ms")
    print(
        f"  time (median of {args.reps}): sharded {med['sharded'] * 1e3:.2f} ms, gathered + broadcast "
        f"{med['gathered'] * 1e3:.2f} ms, link bound {bound * 1e3:.2f} ms (link {slowest}), per-GPU bound "
        f"{gpu_bound * 1e3:.2f} ms; sharded / gathered "
        f"{med['sharded'] / med['gathered']:.3f}, sharded / bound {med['sharded'] / bound:.2f}, sharded / per-GPU "
        f"bound {med['sharded'] / gpu_bound:.2f}; bit-exact: {'yes' if not any(wrong.values()) else f'NO ({wrong})'}"
    )
    print(
        f"  issue 24's goals (buckets of {bucket_mb:g} MiB): sharded <= 1.2 x "
        f"the binding bound ({max(bound, gpu_bound) * 1e3:.2f} ms): "
        f"{'yes' if med['sharded'] <= 1.2 * max(bound, gpu_bound) else 'no'}; sharded <= 0.2 x gathered + "
        f"broadcast: {'yes' if med['sharded'] <= 0.2 * med['gathered'] else 'no'}"
    )
    return {
        "what": what,
        "model": model,
        "ranks": ranks,
        "tp": tp,
        "replicas": replicas,
        "device": args.device,
        "bucket_mb": bucket_mb,
        "table_bytes": table.total_bytes,
        "times": times,
        "median_s": med,
        "bound_s": bound,
        "gpu_bound_s": gpu_bound,
        "slowest_link": slowest,
        "link_s": link_s,
        "link_rate_bps": rate,
        "wrong": wrong,
        "reports": reports,
    }


def _out_in(link_bytes: dict[str, int], gpu: int) -> tuple[int, int]:
    """Bytes the plan sends out of ``gpu`` and into it."""
    ends = [(tuple(int(x) for x in k.split("->")), n) for k, n in link_bytes.items()]
    return sum(n for (a, _), n in ends if a == gpu), sum(n for (_, b), n in ends if b == gpu)


def links(result: TransferPlan, ranks: int, tp: int) -> dict[str, int]:
    """The plan's bytes per link, by ``"rank->process"`` (the worker's process: its GPU)."""
    return {f"{rank}->{_global(ranks, tp, rid, w)}": n for (rank, rid, w), n in result.links().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", choices=sorted(RECORDED), help="repeatable; default 1.7B and 8B")
    p.add_argument("--gpus", type=int, choices=sorted(PRESETS), help="issue 29's runs for this many GPUs")
    p.add_argument("--ranks", type=int, default=2, help="trainer ranks (without --gpus)")
    p.add_argument("--tp", type=int, default=2, help="workers per replica (without --gpus)")
    p.add_argument("--replicas", type=int, default=1, help="replicas (without --gpus)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, one process per 'GPU'")
    p.add_argument("--probe-mb", type=int, default=0, help="link probe size (default 512 on cuda, 8 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-mb", type=float, default=0, help="sharded: bytes per message per link, MiB (default regions.BUCKET)"
    )
    p.add_argument("--json")
    p.add_argument("--record", action="store_true", help="write bench/data/layouts (needs vLLM: run here)")
    p.add_argument("--me", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.record:
        record()
        return
    args.probe_mb = args.probe_mb or (512 if args.device == "cuda" else 8)
    if args.me is not None:
        args.model = args.model[0]
        child(args)
        return
    models = args.model or ["qwen3-1.7b", "qwen3-8b"]
    configs = PRESETS[args.gpus] if args.gpus else [(args.ranks, args.tp, args.replicas)]
    rows = [run_one(args, m, *c) for m in models for c in configs]
    print(
        "\n| configuration | GB | sharded ms | gathered + broadcast ms | link bound ms | per-GPU bound ms "
        "| sharded / gathered | sharded / bound | received / needed (max) | bit-exact |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ratio = max(w["nbytes"]["sharded"] / w["needed"] for w in r["reports"][r["ranks"] :])
        m = r["median_s"]
        print(
            f"| {r['what']} ({r['device']}) | {r['table_bytes'] / 1e9:.2f} | {m['sharded'] * 1e3:.2f} "
            f"| {m['gathered'] * 1e3:.2f} | {r['bound_s'] * 1e3:.2f} | {r['gpu_bound_s'] * 1e3:.2f} "
            f"| {m['sharded'] / m['gathered']:.3f} "
            f"| {m['sharded'] / r['bound_s']:.2f} | {ratio:.2f} | {'yes' if not any(r['wrong'].values()) else 'NO'} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
