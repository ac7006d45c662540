"""Regions over CUDA IPC on one GPU (``weightsync.channels.ipc_regions``) against a raw device copy of the same bytes.

    bash tools/gpu-host.sh python3 bench/ipc_regions_gpu.py --json out.json            # the test job and Qwen3-1.7B
    bash tools/gpu-host.sh python3 bench/ipc_regions_gpu.py --model qwen3-1.7b --reps 9

Four processes on GPU 0: 2 trainer ranks holding FSDP2 ``Shard(0)`` shards, a TP=2 replica's 2 workers, every
link co-located. Jobs: ``job`` (the seeded job of ``tests/gpu/test_ipc_regions_gpu.py``, a few hundred KB) and
``qwen3-1.7b`` (its checkpoint tensors, seeded bf16 values, the TP=2 engine layout vLLM's loaders recorded:
``bench/sharded_gpu.py``'s job). Per repetition, timed from a store barrier of all four (each CUDA-synchronised) to
the last process's CUDA-synchronised end, clock ``time.perf_counter`` (one monotonic clock on the host):

- ``ipc``: each rank publishes its shards (exports reused after the first round) and its links' digest words
  (computed on the device), each worker walks its regions (``regions.receive`` with IPC links, default bucket:
  copies into buckets, digests checked on the device) and lands each in its parameters; the ranks wait for the
  workers' done (``release``);
- ``walk``: the same without the landing copies (what the channel costs alone);
- ``raw``: each worker one flat device-to-device copy of as many bytes as its regions hold (the floor: the same
  bytes read and written once), the two workers at once.

Round 0 is a warm-up, and in it each worker checks its parameters bit-exact against the full tensors. Printed:
per worker bytes copied / bytes its layout needs, the median of each mode and its ratio to ``raw``, and for
``walk`` when each process reached each step (the ranks: published, shared; the workers: first region; all: end).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RANKS, TP = 2, 2


def _job(model: str) -> tuple[Any, Any, Any, Any]:
    """(trainer layout, one replica's engine layout, the plan, tensor(t) -> full tensor t on cuda:0)."""
    import torch

    if model == "job":
        sys.path.insert(0, str(ROOT))
        from tests.integration.region_ranks import job

        trainer, result, members, full = job(24, RANKS)
        cuda = [t.to("cuda:0") for t in full]
        return trainer, members[0].layout, result, lambda t: cuda[t]
    from sharded_gpu import job as sharded_job
    from sharded_gpu import tensor

    trainer, engine, result = sharded_job(model, RANKS, TP, 1)
    return trainer, engine, result, lambda t: tensor(trainer.table, t, torch.device("cuda", 0), 7)


def child(idx: int, model: str, port: int, reps: int, out: str) -> None:
    import torch

    from weightsync.channels import ipc_regions, regions, wire
    from weightsync.channels.base import Endpoint
    from weightsync.channels.wire import TORCH_DTYPES
    from weightsync.sharding.fills import WHOLE
    from weightsync.vocabulary import Channel

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = (
        wire.serve_store("127.0.0.1", port, 300.0)
        if idx == 0
        else wire.join_store(Endpoint("127.0.0.1", port), 60.0, 300.0, Channel.IPC)
    )
    trainer, engine, result, full = _job(model)
    table = trainer.table
    rid = next(iter(r.replica_id for r in result.replicas))
    rows = result.replica(rid).regions
    is_rank = idx < RANKS
    worker = idx - RANKS
    layout = None if is_rank else engine.workers[worker]
    local: list[Any] = []
    if is_rank:
        for t in range(len(table)):
            box = trainer.shard(t, idx)
            local.append(None if box is None else full(t)[_slices(box)].clone())
        exporter = ipc_regions.Exporter(store, idx, 120.0)
        mine = [r for r in rows if r.rank == idx]
        ends = {w: exporter.link(w) for w in sorted({r.worker for r in mine})}
    else:
        importer = ipc_regions.Importer(store, worker, device, 120.0)
        assert layout is not None
        params = [torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype], device=device) for p in layout.params]
        wholes = {
            f.tensor: torch.zeros(table.tensors[f.tensor].shape, dtype=TORCH_DTYPES[table.tensors[f.tensor].dtype],
                                  device=device)
            for f in layout.fills if f.param == WHOLE
        }  # fmt: skip
        needed = layout.bytes_needed(table)
        src = torch.empty(needed, dtype=torch.uint8, device=device).random_(256)
        dst = torch.empty_like(src)
    torch.cuda.synchronize(device)

    step = [0]

    def barrier() -> None:
        step[0] += 1
        torch.cuda.synchronize(device)
        store.set(f"b{step[0]}/{idx}", "1")
        store.wait([f"b{step[0]}/{i}" for i in range(RANKS + TP)])

    marks: dict[str, float] = {}

    def ipc(version: int, land: bool) -> int:
        if is_rank:
            exporter.publish(version, trainer, local)
            marks["published"] = time.perf_counter()
            n = regions.send(None, trainer, idx, local, mine, links=ends).nbytes  # type: ignore[arg-type]
            marks["shared"] = time.perf_counter()
            exporter.release()
            return n
        tally = regions.Tally()
        walk = regions.receive(
            None, RANKS, worker, table, rows, tally, device,
            links={r: importer.link(version, r, table) for r in range(RANKS)},
        )  # fmt: skip
        for fill, data in walk:
            if "first" not in marks:
                torch.cuda.synchronize(device)
                marks["first"] = time.perf_counter()
            if land:
                into = wholes[fill.tensor] if fill.param == WHOLE else params[fill.param]
                into[_slices(fill.dest)].copy_(data.reshape(fill.dest.lengths))
        return tally.nbytes

    def raw() -> int:
        if is_rank:
            return 0
        dst.copy_(src)
        return needed

    def wrong() -> list[str]:
        """Parameters (and whole tensors) other than the layout's fills of the full tensors make them, in order (a
        later fill may overwrite an earlier one's box: compare whole parameters, not fill by fill)."""
        if layout is None:
            return []
        expected = [torch.zeros_like(p) for p in params]
        out = []
        for f in layout.fills:
            if f.param == WHOLE:
                if not torch.equal(wholes[f.tensor], full(f.tensor)):
                    out.append(table.tensors[f.tensor].name)
            else:
                expected[f.param][_slices(f.dest)] = full(f.tensor)[_slices(f.source)].reshape(f.dest.lengths)
        return out + [s.name for s, a, b in zip(layout.params, params, expected, strict=True) if not torch.equal(a, b)]

    samples: list[dict[str, Any]] = []
    moved: dict[str, int] = {}
    mismatches: list[str] = []
    version = 0
    for rep in range(reps + 1):
        for mode in ("ipc", "walk", "raw"):
            version += 1
            marks.clear()
            barrier()
            start = time.perf_counter()
            n = raw() if mode == "raw" else ipc(version, mode == "ipc")
            torch.cuda.synchronize(device)
            end = time.perf_counter()
            if rep == 0:
                moved[mode] = n
                if mode == "ipc":
                    mismatches = wrong()
            else:
                samples.append({"mode": mode, "start": start, "end": end, **marks})
    Path(out, f"{idx}.json").write_text(
        json.dumps({"idx": idx, "needed": 0 if is_rank else needed, "moved": moved, "wrong": mismatches,
                    "samples": samples})
    )  # fmt: skip
    if not is_rank:
        importer.close()  # before the ranks exit: they keep their memory until no worker maps it
    barrier()
    if idx == 0:
        time.sleep(1.0)  # the store lives here: let the others' last wait return


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


def run_one(model: str, reps: int, port: int) -> dict[str, Any]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=child, args=(i, model, port, reps, out)) for i in range(RANKS + TP)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"{model}: a process failed: exit codes {[p.exitcode for p in procs]}")
        reports = [json.loads(Path(out, f"{i}.json").read_text()) for i in range(RANKS + TP)]
    times: dict[str, list[float]] = {}
    for k in range(len(reports[0]["samples"])):
        rows = [r["samples"][k] for r in reports]
        times.setdefault(rows[0]["mode"], []).append(max(r["end"] for r in rows) - min(r["start"] for r in rows))
    phases: dict[str, list[float]] = {}
    for k in range(len(reports[0]["samples"])):
        rows = [r["samples"][k] for r in reports]
        if rows[0]["mode"] != "walk":
            continue
        t0 = min(r["start"] for r in rows)
        for i, r in enumerate(rows):
            for mark in ("published", "shared", "first"):
                if mark in r:
                    phases.setdefault(f"{i}:{mark}", []).append((r[mark] - t0) * 1e3)
            phases.setdefault(f"{i}:end", []).append((r["end"] - t0) * 1e3)
    workers = reports[RANKS:]
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    needed = sum(w["needed"] for w in workers)
    summary = {
        "model": model,
        "bytes": needed,
        "per_worker": [f"{w['moved']['ipc']}/{w['needed']}" for w in workers],
        "exact": all(w["wrong"] == [] and w["moved"]["ipc"] == w["needed"] for w in workers),
        "median_ms": med,
        "ratio_to_raw": {m: med[m] / med["raw"] for m in med},
        "samples_ms": {m: [x * 1e3 for x in v] for m, v in times.items()},
        "walk_phases_ms": {k: statistics.median(v) for k, v in sorted(phases.items())},
    }
    print(
        f"{model}: {needed / 1e9:.4f} GB to 2 workers ({', '.join(summary['per_worker'])} bytes), bit-exact "
        f"{summary['exact']}; " + ", ".join(f"{m} {med[m]:.3f} ms ({med[m] / med['raw']:.2f}x raw)" for m in med),
        flush=True,
    )
    print("  walk, ms from the barrier (process 0-1 ranks, 2-3 workers):", summary["walk_phases_ms"], flush=True)
    return summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="append", help="job, qwen3-1.7b (default: both)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--port", type=int, default=29660)
    p.add_argument("--json", default="")
    args = p.parse_args()
    import torch

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    got = [run_one(m, args.reps, args.port + i) for i, m in enumerate(args.model or ["job", "qwen3-1.7b"])]
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
