"""GPU fleet benchmark: what a user waits for, publish -> READY, through the product, against the raw wire.

    PYTHONPATH=.:trainer:inference python3 bench/gpu_fleet.py --model qwen3-1.7b --json fleet.json

Real processes as in tests/gpu/test_fleet_gpu.py: the coordinator, the trainer (the real
``Publisher`` on GPU 0, tests/gpu/fleet_trainer.py) and one replica on GPU 1 (the real
``Agent`` driving the GPU harness: the plugin's own ``Updater`` into vLLM-layout parameters)
planned on NCCL; ``--ipc`` adds a colocated replica on GPU 0. No volume (the durable copy is
off the critical path). Each row is the median of ``--versions`` timed versions after two
warm-ups, with verification off and on; ``publish -> READY`` is ``Publisher.publish``'s
wall time (open, plan, joined, one gather streamed, report, the replicas' acks, release).

The raw baseline of the same run is one flat NCCL broadcast of the table's bytes from GPU 0
to GPU 1 (``bench/gpu_channels.py``'s baseline); ``--tiny`` runs a few-KB table instead, for
the fixed overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_registered(target: str, job: str, members: set[str], timeout_s: float = 180) -> None:
    from weightsync.coordinator.client import CoordinatorClient

    with CoordinatorClient(target, insecure=True) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if members <= {m.member_id for m in client.get_job(job).members}:
                    return
            except Exception:  # noqa: BLE001 - still starting
                pass
            time.sleep(0.3)
    raise TimeoutError(f"{members} did not register")


def _mean_between(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean seconds per phase/channel of the acks between two scrapes of the coordinator's metrics."""
    means = {}
    for key, (count, total) in after.items():
        count0, total0 = before.get(key, (0.0, 0.0))
        if count > count0:
            means[key] = (total - total0) / (count - count0)
    return means


def fleet_run(model: str, versions: int, ipc: bool, verify: bool, work: Path) -> dict[str, Any]:
    from weightsync import metrics

    job = "bench"
    port, metrics_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    target = f"127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "trainer"), str(ROOT / "inference"),
           os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    channels = "ipc,nccl" if ipc else "nccl"
    (work / "job.json").write_text(json.dumps({"job": job, "sync": {"channels": channels.split(","),
                                                "timeoutSeconds": 120, "transferTimeoutSeconds": 30}}))  # fmt: skip
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    procs = []

    def spawn(name: str, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
        kw.setdefault("stdout", (logs / f"{name}.log").open("ab"))
        proc = subprocess.Popen(argv, stderr=(logs / f"{name}.err").open("ab"), env=env, cwd=ROOT, **kw)
        procs.append(proc)
        return proc

    try:
        spawn("coordinator", [sys.executable, "-m", "weightsync.cli.main", "coordinator", "--insecure", "--port",
              str(port), "--job-config", str(work / "job.json"), "--lease-ttl", "10",
              "--metrics-port", str(metrics_port)])  # fmt: skip
        replicas = {"r-nccl": ("cuda:1", "nccl")} | ({"r-ipc": ("cuda:0", "ipc")} if ipc else {})
        for rid, (device, channel) in replicas.items():
            spawn(rid, [sys.executable, "-m", "tests.gpu.harness", "--coordinator", target, "--job", job,
                  "--replica-id", rid, "--device", device, "--channels", channel, "--nccl-domain", "fabric",
                  "--model", model])  # fmt: skip
        _wait_registered(target, job, set(replicas))
        argv = [sys.executable, "-m", "tests.gpu.fleet_trainer", "--coordinator", target, "--job", job, "--model",
                model, "--channels", channels, "--nccl-domain", "fabric", "--volume", str(work / "unused")]  # fmt: skip
        if not verify:
            argv.append("--no-verify")
        trainer = spawn("trainer", argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert trainer.stdin is not None and trainer.stdout is not None

        def answer() -> dict[str, Any]:
            assert trainer.stdout is not None
            while not (line := trainer.stdout.readline()).startswith("{"):  # libraries (NIXL) log to stdout too
                if not line:
                    raise RuntimeError("the trainer exited")
            result: dict[str, Any] = json.loads(line)
            return result

        ready = answer()
        rows = []
        for v in range(versions + 2):
            trainer.stdin.write(json.dumps({"seed": v, "step": v, "durable": False}) + "\n")
            trainer.stdin.flush()
            out = answer()
            if out["state"] != "READY":
                raise RuntimeError(f"version {out['version']} {out['state']}: {out}")
            rows.append(out)
            if len(rows) == 2:  # the replicas' phases count from here: the warm-ups formed the groups
                before = metrics.sync_seconds_totals(url)
        timed = rows[2:]
        phases = {k: statistics.median(r["seconds"][k] for r in timed) * 1e3 for k in timed[0]["seconds"]}
        after = metrics.sync_seconds_totals(url)
        acked = _mean_between(before, after)
        return {
            "bytes": ready["bytes"],
            "tensors": ready["tensors"],
            "verify": verify,
            "replicas": {r: c for r, (_, c) in replicas.items()},
            "publish_to_ready_ms": statistics.median(r["wall"] for r in timed) * 1e3,
            "phases_ms": phases,
            "replica_phases_mean_ms": {k: v * 1e3 for k, v in acked.items()},
            "samples_ms": [r["wall"] * 1e3 for r in timed],
        }
    finally:
        for proc in procs:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b")
    p.add_argument("--versions", type=int, default=7)
    p.add_argument("--ipc", action="store_true", help="add a colocated replica on GPU 0 (CUDA IPC)")
    p.add_argument("--json", default=None)
    p.add_argument("--work", default=None, help="keep each run's logs under this folder (default: a temporary one)")
    args = p.parse_args()
    out: dict[str, Any] = {"model": args.model, "gpu": _gpu_name()}
    out["raw_flat_broadcast_ms"] = raw_flat_broadcast_ms(args.model)
    for verify in (False, True):
        key = f"fleet_verify_{'on' if verify else 'off'}"
        if args.work:
            Path(args.work).mkdir(parents=True, exist_ok=True)
            out[key] = fleet_run(args.model, args.versions, args.ipc, verify, Path(tempfile.mkdtemp(dir=args.work)))
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out[key] = fleet_run(args.model, args.versions, args.ipc, verify, Path(tmp))
    raw = out["raw_flat_broadcast_ms"]
    for key in ("fleet_verify_off", "fleet_verify_on"):
        row = out[key]
        row["ratio_to_raw"] = row["publish_to_ready_ms"] / raw
        row["overhead_ms"] = row["publish_to_ready_ms"] - raw
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


def _raw_worker(rank: int, port: int, nbytes: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from bench import gpu_channels

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    seconds = gpu_channels.flat_broadcast(nbytes, 10, dev)
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def raw_flat_broadcast_ms(model: str) -> float:
    """One flat NCCL broadcast of the table's bytes, GPU 0 -> GPU 1, median of 10 (the raw wire)."""
    import torch.multiprocessing as mp

    from bench import gpu_models

    nbytes = gpu_models.trainer_table(model).total_bytes
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(_raw_worker, args=(_free_port(), nbytes, f.name), nprocs=2, join=True)
        return float(json.loads(Path(f.name).read_text())) * 1e3


def _gpu_name() -> str:
    import torch

    return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"


if __name__ == "__main__":
    sys.exit(main())
