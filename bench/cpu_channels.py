"""CPU channels end to end into a real vLLM CPU engine, against raw baselines of the same bytes.

    .venv/bin/python bench/cpu_channels.py [--preset small-qwen2] [--reps 3] [--json out.json]

Times, on the same machine in one run:
- ``cpu`` channel: from ``publish`` until the engine holds the new weights (vLLM's
  finish_weight_update returned), verification off; then again with per-tensor
  verification on (timed apart);
- ``volume`` channel: publish (write + fsync + atomic rename) + engine load, on disk and on
  /dev/shm;
- raw baselines of the same byte count: one flat gloo broadcast between two processes,
  a memcpy, and safetensors save + fsync + load (disk and /dev/shm).
Prints a table of medians and ratios; ``--json`` writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _raw_gloo_receiver(port: int, nbytes: int, reps: int) -> None:
    from weightsync.channels.base import tcp_store
    from weightsync.channels.cpu import _Group

    group = _Group(tcp_store("127.0.0.1", port, False, 120), "127.0.0.1", 2, 1, 120, "raw")
    group.connect()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(reps + 1):
        group.wait(group.broadcast(buf), "raw")


def raw_gloo(nbytes: int, reps: int) -> list[float]:
    from weightsync.channels.base import tcp_store
    from weightsync.channels.cpu import _Group

    store = tcp_store("127.0.0.1", 0, True, 120)
    group = _Group(store, "127.0.0.1", 2, 0, 120, "raw")
    proc = subprocess.Popen([sys.executable, __file__, "--raw-receiver", str(store.port), str(nbytes), str(reps)])
    group.connect()
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    group.wait(group.broadcast(buf), "warm-up")
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        group.wait(group.broadcast(buf), "raw")
        samples.append(time.perf_counter() - t0)
    proc.wait(timeout=120)
    return samples


def _stream_receiver(port: int, reps: int) -> None:
    from weightsync.channels.base import UpdateTicket
    from weightsync.channels.cpu import CpuReceiver
    from weightsync.tensors import TensorTable
    from weightsync.vocabulary import Channel

    receiver = CpuReceiver(f"127.0.0.1:{port}", 2, 1)
    for v in range(1, reps + 2):
        for _ in receiver.receive(UpdateTicket(v, Channel.CPU, TensorTable(()), verify=False)):
            pass


def stream_transport(source: Any, reps: int) -> list[float]:
    """The CPU stream alone: trainer tensors to a receiver that drains them (no engine)."""
    from weightsync.channels.cpu import CpuSender
    from weightsync.vocabulary import Channel
    from weightsync_trainer.publisher import Publisher

    sender = CpuSender()
    proc = subprocess.Popen([sys.executable, __file__, "--stream-receiver", str(sender.port), str(reps)])
    sender.connect()
    publisher = Publisher(source, [sender], verify=False)
    samples = []
    for v in range(1, reps + 2):
        t0 = time.perf_counter()
        publisher.publish(v, v, [publisher.ticket(v, v, Channel.CPU)])
        samples.append(time.perf_counter() - t0)
    proc.wait(timeout=300)
    sender.close()
    return samples[1:]


def volume_transport(source: Any, base: Path, reps: int) -> list[float]:
    """The volume alone: write (shards, sha256, fsync, rename), verify every shard, read every tensor."""
    from weightsync.channels.volume import VolumeReceiver, VolumeSender
    from weightsync.vocabulary import Channel
    from weightsync_trainer.publisher import Publisher

    publisher = Publisher(source, [VolumeSender(base / "transport", keep=2)], verify=False)
    receiver = VolumeReceiver(base / "transport")
    samples = []
    for v in range(1, reps + 1):
        t0 = time.perf_counter()
        publisher.publish(v, v)
        for group in receiver.receive(publisher.ticket(v, v, Channel.VOLUME)):
            for _, tensor in group:
                tensor.sum()  # touch the bytes, as a loader would
        samples.append(time.perf_counter() - t0)
    return samples


def raw_memcpy(nbytes: int, reps: int) -> list[float]:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return samples


def raw_safetensors(tensors: dict[str, torch.Tensor], folder: Path, reps: int) -> list[float]:
    from safetensors.torch import load_file, save_file

    samples = []
    for i in range(reps):
        path = folder / f"raw-{i}.safetensors"
        t0 = time.perf_counter()
        save_file(tensors, str(path))
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        loaded = load_file(str(path))
        samples.append(time.perf_counter() - t0)
        del loaded
        path.unlink()
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small-qwen2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--raw-receiver", nargs=3, type=int, metavar=("PORT", "BYTES", "REPS"), help=argparse.SUPPRESS)
    p.add_argument("--stream-receiver", nargs=2, type=int, metavar=("PORT", "REPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_receiver:
        _raw_gloo_receiver(*args.raw_receiver)
        return
    if args.stream_receiver:
        _stream_receiver(*args.stream_receiver)
        return

    import transformers

    from weightsync.channels.cpu import CpuSender
    from weightsync.channels.volume import VolumeSender
    from weightsync.vocabulary import Channel
    from weightsync_inference.lifecycle import Replica
    from weightsync_inference.offline import OfflineEngine
    from weightsync_trainer import tiny_models
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    folder = tiny_models.generate(args.preset)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn_like(param) * 1e-3)  # a delta, as a training step would make
    source = ModuleSource(trainer)
    table = source.table()
    nbytes = table.total_bytes
    print(f"model {args.preset}: {len(table)} tensors, {nbytes / 1e9:.3f} GB", flush=True)
    results: dict[str, list[float]] = {}

    engine = OfflineEngine(folder, Channel.CPU, memory_fraction=0.15)
    replica = Replica(engine)
    sender = CpuSender(world_size=2)
    replica.init_transfer({"address": sender.address, "world_size": 2, "rank_offset": 1}, rendezvous=sender.connect)
    version = 0
    for verify in (False, True):
        publisher = Publisher(source, [sender], verify=verify)
        key = "cpu channel, verified" if verify else "cpu channel"
        results[key] = []
        for _ in range(args.reps + 1):
            version += 1
            ticket = publisher.ticket(version, version, Channel.CPU)
            t0 = time.perf_counter()
            replica.apply(ticket, send=lambda p=publisher, t=ticket: p.publish(t.version, t.step, [t]))
            results[key].append(time.perf_counter() - t0)
        results[key] = results[key][1:]  # first: warm-up
        print(key, [f"{s:.3f}" for s in results[key]], flush=True)

    for where, base in (("disk", Path(tempfile.mkdtemp())), ("/dev/shm", Path(tempfile.mkdtemp(dir="/dev/shm")))):
        publisher = Publisher(source, [VolumeSender(base / "volume", keep=2)], verify=False)
        key = f"volume channel ({where})"
        results[key] = []
        for _ in range(args.reps + 1):
            version += 1
            t0 = time.perf_counter()
            publisher.publish(version, version)
            replica.apply(publisher.ticket(version, version, Channel.VOLUME, root=str(base / "volume")))
            results[key].append(time.perf_counter() - t0)
        results[key] = results[key][1:]
        print(key, [f"{s:.3f}" for s in results[key]], flush=True)
        tensors = {s.name: t for s, t in zip(table, (t for g in source.groups() for t in g), strict=True)}
        results[f"raw safetensors save+fsync+load ({where})"] = raw_safetensors(tensors, base, args.reps)
        results[f"volume transport only, no engine ({where})"] = volume_transport(source, base, args.reps)
    engine.close()
    results["cpu stream transport only, no engine"] = stream_transport(source, args.reps)

    results["raw gloo flat broadcast"] = raw_gloo(nbytes, args.reps)
    results["raw memcpy"] = raw_memcpy(nbytes, args.reps)

    med = {k: statistics.median(v) for k, v in results.items()}
    base = med["raw gloo flat broadcast"]
    lines = [
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; model {args.preset} ({nbytes / 1e9:.3f} GB bf16, {len(table)} tensors); "
        f"median of {args.reps}",
        "",
        "| method | seconds | GB/s | vs raw gloo |",
        "|---|---:|---:|---:|",
    ]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.3f} | {nbytes / v / 1e9:.2f} | {v / base:.2f}x |")
    for where in ("disk", "/dev/shm"):
        raw = med[f"raw safetensors save+fsync+load ({where})"]
        lines.append(
            f"\nvolume ({where}) vs raw safetensors save+fsync+load: "
            f"end to end {med[f'volume channel ({where})'] / raw:.2f}x, "
            f"transport only {med[f'volume transport only, no engine ({where})'] / raw:.2f}x"
        )
    lines.append(
        f"\ncpu channel bandwidth vs raw gloo flat broadcast: end to end {base / med['cpu channel'] * 100:.0f}%, "
        f"transport only {base / med['cpu stream transport only, no engine'] * 100:.0f}%"
    )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": results, "median": med, "bytes": nbytes}, indent=1))


if __name__ == "__main__":
    main()
