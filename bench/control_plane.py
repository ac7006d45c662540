"""Control-plane overhead per sync, and a lease soak, on loopback with real processes.

What one sync costs the control plane, without any payload: the publisher opens a
version (negotiation, plans), every replica sees its assignment on its stream and
acks, the publisher reports the version sent (``report_sent``: a version is READY
only after it), the version is READY and the publisher's wait returns (the issue's
"register -> plan -> acks -> READY"). ``--with-joined`` adds the barrier the live
channels use (every planned receiver joined before the publisher sends): one more
RPC per replica and one more wait. Timed from ``open_version`` to the return of
``report_sent``, which waits for the verdict in the same call as the publisher's
does, in the publisher (this process). The coordinator runs as its
own ``weightsync coordinator`` process; each simulated replica is a real client
in its own process (``--per-process`` packs several per process for big fleets).

    python bench/control_plane.py                      # 1, 8, 64 replicas, 200 syncs each
    python bench/control_plane.py --replicas 8 --syncs 500
    python bench/control_plane.py --soak --soak-replicas 256 --soak-seconds 600

The soak registers 256 replicas (lease TTL 3 s: each renews every second), keeps
them watching, and samples the coordinator's resident memory; it reports growth
after the first minute (the goal: under 5%).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import AckReport, Capabilities, EngineKind, EventKind, TableSummary
from weightsync.tensors import DIGEST_PREFIX
from weightsync.vocabulary import Channel, SyncPhase, VersionState

JOB = "bench"
TABLE = TableSummary(291, 988_000_000, DIGEST_PREFIX + "b" * 64)  # a 0.5B model's table, in summary
CPU_OFFER = Offer(Channel.CPU, Endpoint("127.0.0.1", 29500))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_coordinator(lease_ttl: float) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightsync.cli.main",
            "coordinator",
            "--insecure",
            "--port",
            str(port),
            "--json",
            "--lease-ttl",
            str(lease_ttl),
            "--max-workers",
            "1024",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["target"]


def _replica(target: str, ids: list[str], ready: Any, stop: Any, with_joined: bool) -> None:
    """One process hosting ``ids`` replicas, each a client with its own channel, watch stream and renewals."""
    caps = Capabilities(host="bench", channels=(Channel.CPU,), engine=EngineKind.CPU)

    def serve(rid: str) -> None:
        client = CoordinatorClient(target, insecure=True, timeout_s=30)
        client.register_replica(JOB, rid, caps)
        ready.put(rid)
        for a in client.watch():
            if a.kind is not EventKind.ASSIGN or a.table is None:
                continue
            if with_joined:
                client.report_joined(a.version)
            client.ack(AckReport(a.version, a.table.layout_digest, True, {SyncPhase.TOTAL: 0.0}))

    for rid in ids:
        threading.Thread(target=serve, args=(rid,), daemon=True).start()
    stop.wait()


def start_replicas(target: str, n: int, per_process: int, with_joined: bool = False) -> tuple[list[Any], Any]:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    ids = [f"replica-{i:04d}" for i in range(n)]
    procs = []
    for i in range(0, n, per_process):
        p = ctx.Process(target=_replica, args=(target, ids[i : i + per_process], ready, stop, with_joined), daemon=True)
        p.start()
        procs.append(p)
    for _ in range(n):
        ready.get(timeout=300)
    return procs, stop


def _status_field(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return -1


def rss_mib(pid: int) -> float:
    return _status_field(pid, "VmRSS") / 1024


def threads(pid: int) -> int:
    return _status_field(pid, "Threads")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc), to report cost independent of machine load."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sync_latency(n: int, syncs: int, warmup: int, per_process: int, with_joined: bool) -> dict[str, Any]:
    coordinator, target = start_coordinator(lease_ttl=10.0)
    procs: list[Any] = []
    stop: Any = None
    try:
        procs, stop = start_replicas(target, n, per_process, with_joined)
        trainer = CoordinatorClient(target, insecure=True, timeout_s=30)
        trainer.register_trainer(
            JOB, "trainer", Capabilities(host="bench", channels=(Channel.CPU,)), offers=[CPU_OFFER]
        )
        samples: list[float] = []
        cpu0 = 0.0
        for step in range(warmup + syncs):
            if step == warmup:
                cpu0 = cpu_seconds(coordinator.pid)
            t0 = time.perf_counter()
            opened = trainer.open_version(step, TABLE)
            if with_joined:
                trainer.wait_receivers_joined(opened.version, timeout_s=60)
            state = trainer.report_sent(opened.version, "", {}, wait_s=60).state
            elapsed = time.perf_counter() - t0
            if state is not VersionState.READY:
                raise RuntimeError(f"version {opened.version} ended {state.value}")
            if len(opened.plans) != n:
                raise RuntimeError(f"version {opened.version} planned {len(opened.plans)} of {n} replicas")
            if step >= warmup:
                samples.append(elapsed * 1000)
        cpu_ms = (cpu_seconds(coordinator.pid) - cpu0) * 1000 / syncs
        trainer.close()
        return {
            "replicas": n,
            "with_joined": with_joined,
            "coordinator_cpu_ms_per_sync": round(cpu_ms, 2),
            "syncs": syncs,
            "p50_ms": round(statistics.median(samples), 2),
            "p99_ms": round(pct(samples, 0.99), 2),
            "mean_ms": round(statistics.fmean(samples), 2),
            "max_ms": round(max(samples), 2),
            "coordinator_rss_mib": round(rss_mib(coordinator.pid), 1),
        }
    finally:
        if stop is not None:
            stop.set()
        for p in procs:
            p.kill()
            p.join(5)
        coordinator.kill()
        coordinator.wait(10)


def soak(n: int, seconds: float, per_process: int, sample_every: float) -> dict[str, Any]:
    coordinator, target = start_coordinator(lease_ttl=3.0)  # clients renew every ttl/3 = 1 s
    procs: list[Any] = []
    stop: Any = None
    try:
        procs, stop = start_replicas(target, n, per_process)
        observer = CoordinatorClient(target, insecure=True, timeout_s=30)
        start = time.monotonic()
        series: list[tuple[float, float, int]] = []
        while (elapsed := time.monotonic() - start) < seconds:
            series.append((round(elapsed, 1), rss_mib(coordinator.pid), threads(coordinator.pid)))
            live = len(observer.get_job(JOB).members)
            if live != n:
                raise RuntimeError(f"{n - live} replicas lost their lease at {elapsed:.0f}s")
            time.sleep(sample_every)
        series.append((round(time.monotonic() - start, 1), rss_mib(coordinator.pid), threads(coordinator.pid)))
        observer.close()
        after_minute = [r for t, r, _ in series if t >= min(60.0, seconds / 2)]
        base, end = after_minute[0], after_minute[-1]
        return {
            "replicas": n,
            "seconds": seconds,
            "rss_mib_at_start": series[0][1],
            "rss_mib_after_first_minute": base,
            "rss_mib_at_end": end,
            "growth_after_first_minute_pct": round(100 * (end - base) / base, 2),
            "rss_mib_max": max(r for _, r, _ in series),
            "threads_max": max(n for _, _, n in series),
            "samples": series,
        }
    finally:
        if stop is not None:
            stop.set()
        for p in procs:
            p.kill()
            p.join(5)
        coordinator.kill()
        coordinator.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--syncs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--per-process", type=int, default=1, help="simulated replicas per process")
    parser.add_argument(
        "--with-joined",
        "--with-ready",
        dest="with_joined",
        action="store_true",
        help="also time the joined barrier of the live channels (one more RPC per replica, one more wait)",
    )
    parser.add_argument("--soak", action="store_true", help="run the lease soak instead of the latency bench")
    parser.add_argument("--soak-replicas", type=int, default=256)
    parser.add_argument("--soak-seconds", type=float, default=600.0)
    parser.add_argument("--soak-per-process", type=int, default=16)
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if args.soak:
        result: dict[str, Any] = {
            "machine": machine,
            "soak": soak(args.soak_replicas, args.soak_seconds, args.soak_per_process, args.sample_every),
        }
        if not args.json:
            s = result["soak"]
            print(
                f"soak: {s['replicas']} replicas renewing every 1 s for {s['seconds']:.0f} s: coordinator RSS "
                f"{s['rss_mib_after_first_minute']:.1f} MiB after the first minute -> {s['rss_mib_at_end']:.1f} MiB "
                f"at the end ({s['growth_after_first_minute_pct']:+.2f}%)"
            )
    else:
        rows = [sync_latency(n, args.syncs, args.warmup, args.per_process, args.with_joined) for n in args.replicas]
        result = {"machine": machine, "sync": rows}
        if not args.json:
            steps = "open -> joined -> sent -> acks -> READY" if args.with_joined else "open -> sent -> acks -> READY"
            print(f"control-plane overhead per sync on loopback ({machine['cpus']} CPUs), {steps}")
            print(
                f"{'replicas':>8} {'syncs':>6} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'max ms':>8} "
                f"{'coord CPU ms/sync':>18} {'RSS MiB':>8}"
            )
            for r in rows:
                print(
                    f"{r['replicas']:>8} {r['syncs']:>6} {r['p50_ms']:>8} {r['p99_ms']:>8} {r['mean_ms']:>8} "
                    f"{r['max_ms']:>8} {r['coordinator_cpu_ms_per_sync']:>18} {r['coordinator_rss_mib']:>8}"
                )
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
