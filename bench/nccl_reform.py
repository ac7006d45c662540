"""What it costs to form an NCCL communicator again without a member, and what the alternatives cost.

    bash tools/gpu-host.sh python3 bench/nccl_reform.py --gpus 2 --json /tmp/out.json  # GPU host (4: shrink, split)
    .venv/bin/python bench/nccl_reform.py --backend gloo --gpus 3 --mib 64               # the CPU smoke run

One process per GPU (rank 0 is the trainer, the others replicas' workers), on one TCPStore, as the NCCL
channel forms its groups. Median of ``--reps`` (after a warm-up), the slowest rank's time:

- ``init k``: a new communicator of ``k`` ranks, from the constructor to its first completed broadcast
  (``eager_connect_single_device``): what the channel pays for a new roster attempt, with the members
  that are left (a new membership generation costs the same);
- ``shrink``: ``ncclCommShrink`` (``ProcessGroupNCCL.shrink``, NCCL >= 2.27 and a torch that has it) of the
  full communicator without its last rank, which takes no part (as a dead member cannot), to the first
  broadcast on the result: with ``SHRINK_DEFAULT`` from an idle communicator, and with ``SHRINK_ABORT`` from
  one stuck in a broadcast the excluded rank never joins (a member that died mid-version);
- ``split``: ``ncclCommSplit`` through the backend options (``split_from``/``split_color``): every rank of
  the parent must call it, the excluded one with no color, so it serves only a member that is still alive;
- ``broadcast``: ``--mib`` MiB from rank 0 to every other rank, as one broadcast on one communicator and as one
  broadcast per replica on its own two-rank communicator (all posted at once): what per-replica groups (a
  member's death costs only its own group) would cost on every version.

The design choice and the numbers go to docs/gpu-channels.md ("A member lost").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

d: Any = dist  # the store and process-group classes are missing from torch's stubs


class Bench:
    def __init__(self, rank: int, world: int, port: int, backend: str) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        self.store = d.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=300))
        self._barriers = 0
        self.opts = d.BroadcastOptions()
        self.opts.rootRank = 0

    def barrier(self) -> None:
        self._barriers += 1
        key = f"barrier/{self._barriers}"
        self.store.add(key, 1)
        while int(self.store.add(key, 0)) < self.world:
            time.sleep(0.001)

    def sync(self) -> None:
        if self.backend == "nccl":
            torch.cuda.synchronize(self.device)

    def group(self, prefix: str, ranks: list[int], **options: Any) -> Any:
        """A communicator of ``ranks`` (this rank must be among them), formed and used once."""
        store = d.PrefixStore(prefix, self.store)
        rank, size = ranks.index(self.rank), len(ranks)
        if self.backend == "gloo":
            return d.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=120))
        opts = d.ProcessGroupNCCL.Options()
        for k, v in options.items():
            setattr(opts, k, v)
        pg = d.ProcessGroupNCCL(store, rank, size, opts)
        pg.eager_connect_single_device(self.device)
        return pg

    def first_broadcast(self, pg: Any) -> None:
        x = torch.ones(1, device=self.device)
        pg.broadcast([x], self.opts).wait()
        self.sync()

    def end(self, pg: Any) -> None:
        if self.backend == "nccl" and hasattr(pg, "abort"):
            pg.abort()

    def timed(self, what: Callable[[], Any]) -> tuple[float, Any]:
        self.barrier()
        t0 = time.perf_counter()
        out = what()
        return time.perf_counter() - t0, out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    b = Bench(rank, world, port, args.backend)
    rows: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    def trial(name: str, rep: int, takes_part: bool, make: Callable[[], Any], aside: Callable[[], Any] = int) -> None:
        """Time ``make()`` (a communicator, through its first broadcast) on the ranks that take part; the others
        meet them at the barrier and run ``aside``. The first rep is the warm-up."""
        if not takes_part:
            b.barrier()
            aside()
            return
        seconds, pg = b.timed(make)
        b.end(pg)
        if rep:
            record(name, seconds)

    def first(pg: Any) -> Any:
        b.first_broadcast(pg)
        return pg

    everyone = list(range(world))
    for k in range(2, world + 1):
        for rep in range(args.reps + 1):
            trial(f"init {k}", rep, rank < k, lambda k=k, rep=rep: first(b.group(f"init/{k}/{rep}/", list(range(k)))))
    if args.backend == "nccl" and hasattr(d.ProcessGroupNCCL, "shrink") and world > 2:
        for flags_name in ("SHRINK_DEFAULT", "SHRINK_ABORT"):
            flags = getattr(d.distributed_c10d, flags_name, 0 if flags_name == "SHRINK_DEFAULT" else 1)
            for rep in range(args.reps + 1):
                parent = first(b.group(f"shrink/{flags_name}/{rep}/", everyone))
                if rank < world - 1 and flags_name == "SHRINK_ABORT":
                    # a broadcast the excluded (dead) member never joins: stuck until the shrink aborts it
                    parent.broadcast([torch.ones(1, device=b.device)], b.opts)
                # the excluded rank takes no part, as a dead member cannot
                trial(f"shrink ({flags_name})", rep, rank < world - 1, lambda p=parent, f=flags: first(
                    p.shrink([world - 1], f, None)))  # fmt: skip
                b.end(parent)
    if args.backend == "nccl" and hasattr(d.ProcessGroupNCCL.Options(), "split_from") and world > 2:
        for rep in range(args.reps + 1):
            parent = first(b.group(f"split-parent/{rep}/", everyone))
            nocolor = getattr(parent, "perform_nocolor_split", None)
            trial(
                "split (excluded rank alive)",
                rep,
                rank < world - 1,
                lambda p=parent, rep=rep: first(b.group(f"split/{rep}/", everyone[:-1], split_from=p, split_color=1)),
                (lambda n=nocolor: n(b.device)) if nocolor is not None else int,
            )
            b.end(parent)
    nbytes = args.mib << 20
    buf = torch.empty(nbytes, dtype=torch.uint8, device=b.device)
    one = b.group("bcast/one/", everyone)
    pairs = {r: b.group(f"bcast/pair/{r}/", [0, r]) for r in range(1, world) if rank in (0, r)}
    for rep in range(args.reps + 1):

        def one_group() -> None:
            one.broadcast([buf], b.opts).wait()
            b.sync()

        seconds, _ = b.timed(one_group)
        if rep:
            record(f"broadcast {args.mib} MiB, one group of {world}", seconds)

        def per_replica() -> None:
            works = [pg.broadcast([buf], b.opts) for pg in pairs.values()]
            for w in works:
                w.wait()
            b.sync()

        seconds, _ = b.timed(per_replica)
        if rep:
            record(f"broadcast {args.mib} MiB, {world - 1} groups of 2", seconds)
    results.put((rank, rows))
    b.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2, help="processes (one per GPU)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mib", type=int, default=3282, help="bytes broadcast per version (default: Qwen3-1.7B's)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.gpus < 2:
        raise SystemExit("needs at least 2 GPUs (a trainer and a replica)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args.gpus, port, args, results)) for r in range(args.gpus)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join(120)
    names = sorted({n for rows in per_rank.values() for n in rows}, key=lambda n: (n.split()[0], n))
    out: dict[str, Any] = {
        "gpus": args.gpus,
        "backend": args.backend,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else "",
        "torch": torch.__version__,
        "rows": {},
    }
    print(f"| what ({args.backend}, {args.gpus} processes) | median ms (slowest rank) |\n|---|---:|")
    for name in names:
        reps = [max(rows[name][i] for rows in per_rank.values() if name in rows) for i in range(args.reps)]
        ms = statistics.median(reps) * 1000
        out["rows"][name] = {"median_ms": round(ms, 2), "samples_ms": [round(s * 1000, 2) for s in reps]}
        print(f"| {name} | {ms:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    os._exit(0)  # NCCL's teardown of aborted communicators can hang the interpreter's exit


if __name__ == "__main__":
    main()
