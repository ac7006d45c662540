"""CPU channels end to end into a real vLLM CPU engine, against raw baselines of the same bytes.

    .venv/bin/python bench/cpu_channels.py [--preset small-qwen2] [--reps 3] [--json out.json]

Times, on the same machine in one run:
- ``cpu`` channel: from the trainer's ``send`` until the engine holds the new weights
  (vLLM's finish_weight_update returned), verification off; then again with per-tensor
  verification on (timed apart);
- ``volume`` channel: publish (write + fsync + atomic rename, and the manifest checksum
  the coordinator records) + engine load, on disk and on /dev/shm;
- raw baselines of the same byte count: one flat gloo broadcast between two processes,
  a memcpy, and safetensors save + fsync + load (disk and /dev/shm).
Prints a table of medians and ratios; ``--json`` writes every sample.

No coordinator: the trainer builds its senders, plans the engine (``direct_rendezvous``)
and hands it the ``Rendezvous`` as ``init_info``; ``weightsync_trainer.publisher.send``
does one gather into one sender. The engine's tickets carry no table (the stream's
header carries it; the volume's manifest, checked against the recorded checksum). Old
volume versions are deleted between runs, outside the timed windows (the coordinator
prunes the volume now, not the writer). ``--preset tiny-qwen2 --reps 1`` is a quick check.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _raw_gloo_receiver(rendezvous: str, nbytes: int, reps: int) -> None:
    from weightsync.channels import wire
    from weightsync.channels.base import Rendezvous
    from weightsync.channels.cpu import GlooGroup
    from weightsync.vocabulary import Channel

    rdv = Rendezvous.from_dict(json.loads(rendezvous))
    assert rdv.endpoint is not None
    store = wire.join_store(rdv.endpoint, rdv.join_timeout_s, rdv.timeout_s, Channel.CPU)
    group = GlooGroup(store, "127.0.0.1", rdv, 1)
    group.connect()
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(reps + 1):
        group.wait(group.broadcast(buf), "raw")


def raw_gloo(nbytes: int, reps: int) -> list[float]:
    """One flat gloo broadcast between two processes: the CPU stream's own group class, nothing of the channel."""
    from weightsync.channels import wire
    from weightsync.channels.base import Endpoint, Rendezvous
    from weightsync.channels.cpu import GlooGroup
    from weightsync.vocabulary import Channel

    store = wire.serve_store("127.0.0.1", 0, 120)
    endpoint = Endpoint("127.0.0.1", int(store.port))
    rdv = Rendezvous(Channel.CPU, endpoint, "raw", secrets.token_hex(16), 1, rank=1, world_size=2, timeout_s=120)
    group = GlooGroup(store, "127.0.0.1", rdv, 0)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--raw-receiver", json.dumps(rdv.to_dict()), str(nbytes), str(reps)]
    )
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


def _send(source: Any, sender: Any, ticket: Any) -> None:
    """One gather of ``source`` into ``sender``; raise when the sender lost its receiver."""
    from weightsync_trainer.publisher import send

    report = send(source, sender, ticket)
    if report.failed:
        raise RuntimeError(f"v{ticket.version}: the {ticket.channel.value} sender lost {report.failed}")


def _stream_receiver(rendezvous: str, layout_digest: str, reps: int) -> None:
    from weightsync.channels.base import Rendezvous, UpdateTicket, WorkerContext
    from weightsync.channels.cpu import CpuReceiver
    from weightsync.vocabulary import Channel

    receiver = CpuReceiver.start(Rendezvous.from_dict(json.loads(rendezvous)), WorkerContext())
    for v in range(1, reps + 2):
        for _ in receiver.receive(UpdateTicket(v, Channel.CPU, layout_digest=layout_digest, verify=False)):
            pass
    receiver.close()


def stream_transport(source: Any, reps: int) -> list[float]:
    """The CPU stream alone: trainer tensors to a receiver that drains them (no engine)."""
    from weightsync.channels.base import UpdateTicket, direct_rendezvous
    from weightsync.channels.cpu import CpuSender
    from weightsync.vocabulary import Channel

    table = source.table()
    sender = CpuSender()
    rdv = direct_rendezvous(sender.offer(), join_timeout_s=60)
    sender.take_plan({"drain": rdv})  # the group forms in the background; the first send waits for it
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--stream-receiver",
            json.dumps(rdv.to_dict()),
            table.layout_digest(),
            str(reps),
        ]
    )
    samples = []
    for v in range(1, reps + 2):
        t0 = time.perf_counter()
        _send(source, sender, UpdateTicket(v, Channel.CPU, table, table.layout_digest(), step=v, verify=False))
        samples.append(time.perf_counter() - t0)
    proc.wait(timeout=300)
    sender.close()
    return samples[1:]


def _prune(root: Path, keep: int = 2) -> None:
    """What the coordinator's retention does: delete all but the newest ``keep`` versions."""
    from weightsync.channels import manifests

    manifests.delete(root, manifests.list_versions(root)[:-keep])


def volume_transport(source: Any, base: Path, reps: int) -> list[float]:
    """The volume alone: write (shards, sha256, fsync, rename), verify every shard, read every tensor."""
    from weightsync.channels import manifests
    from weightsync.channels.base import UpdateTicket
    from weightsync.channels.volume import VolumeReceiver, VolumeSender
    from weightsync.tensors import manifest_checksum
    from weightsync.vocabulary import Channel
    from weightsync_trainer.publisher import send

    table = source.table()
    root = base / "transport"
    sender = VolumeSender(root)
    receiver = VolumeReceiver(root)
    samples = []
    for v in range(1, reps + 1):
        t0 = time.perf_counter()
        send(source, sender, UpdateTicket(v, Channel.VOLUME, table, step=v, verify=False))
        checksum = manifest_checksum(manifests.manifest_path(root, v).read_bytes())
        ticket = UpdateTicket(
            v, Channel.VOLUME, layout_digest=table.layout_digest(), manifest_checksum=checksum, verify=False
        )
        for group in receiver.receive(ticket):
            for _, tensor in group:
                tensor.sum()  # touch the bytes, as a loader would
        samples.append(time.perf_counter() - t0)
        _prune(root)
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
    p.add_argument("--raw-receiver", nargs=3, metavar=("RENDEZVOUS", "BYTES", "REPS"), help=argparse.SUPPRESS)
    p.add_argument("--stream-receiver", nargs=3, metavar=("RENDEZVOUS", "LAYOUT", "REPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.raw_receiver:
        rendezvous, nbytes, reps = args.raw_receiver
        _raw_gloo_receiver(rendezvous, int(nbytes), int(reps))
        return
    if args.stream_receiver:
        rendezvous, layout_digest, reps = args.stream_receiver
        _stream_receiver(rendezvous, layout_digest, int(reps))
        return

    import transformers

    from weightsync.channels import manifests
    from weightsync.channels.base import UpdateTicket, direct_rendezvous
    from weightsync.channels.cpu import CpuSender
    from weightsync.channels.volume import VolumeSender
    from weightsync.tensors import manifest_checksum
    from weightsync.vocabulary import Channel
    from weightsync_inference.lifecycle import Replica
    from weightsync_inference.offline import OfflineEngine
    from weightsync_trainer import tiny_models
    from weightsync_trainer.publisher import send
    from weightsync_trainer.sources import ModuleSource

    folder = tiny_models.generate(args.preset)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.randn_like(param) * 1e-3)  # a delta, as a training step would make
    source = ModuleSource(trainer)
    table = source.table()
    layout_digest = table.layout_digest()
    nbytes = table.total_bytes
    print(f"model {args.preset}: {len(table)} tensors, {nbytes / 1e9:.3f} GB", flush=True)
    results: dict[str, list[float]] = {}

    engine = OfflineEngine(folder, Channel.CPU, memory_fraction=0.15)
    replica = Replica(engine)
    sender = CpuSender()
    rdv = direct_rendezvous(sender.offer(), join_timeout_s=60)
    sender.take_plan({"replica-0": rdv})  # the group forms in the background while the engine joins
    replica.init_transfer(rdv.to_dict())
    version = 0
    for verify in (False, True):
        key = "cpu channel, verified" if verify else "cpu channel"
        results[key] = []
        for _ in range(args.reps + 1):
            version += 1
            sent = UpdateTicket(version, Channel.CPU, table, layout_digest, step=version, verify=verify)
            ticket = UpdateTicket(version, Channel.CPU, layout_digest=layout_digest, step=version, verify=verify)
            t0 = time.perf_counter()
            replica.apply(ticket, send=functools.partial(_send, source, sender, sent))
            results[key].append(time.perf_counter() - t0)
        results[key] = results[key][1:]  # first: warm-up
        print(key, [f"{s:.3f}" for s in results[key]], flush=True)
    sender.close()

    for where, base in (("disk", Path(tempfile.mkdtemp())), ("/dev/shm", Path(tempfile.mkdtemp(dir="/dev/shm")))):
        root = base / "volume"
        volume = VolumeSender(root)
        key = f"volume channel ({where})"
        results[key] = []
        for _ in range(args.reps + 1):
            version += 1
            t0 = time.perf_counter()
            send(source, volume, UpdateTicket(version, Channel.VOLUME, table, step=version, verify=False))
            checksum = manifest_checksum(manifests.manifest_path(root, version).read_bytes())
            ticket = UpdateTicket(
                version,
                Channel.VOLUME,
                layout_digest=layout_digest,
                manifest_checksum=checksum,
                step=version,
                verify=False,
                root=str(root),
            )
            replica.apply(ticket)
            results[key].append(time.perf_counter() - t0)
            _prune(root)
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
    gloo = med["raw gloo flat broadcast"]
    lines = [
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; model {args.preset} ({nbytes / 1e9:.3f} GB bf16, {len(table)} tensors); "
        f"median of {args.reps}",
        "",
        "| method | seconds | GB/s | vs raw gloo |",
        "|---|---:|---:|---:|",
    ]
    for k, v in med.items():
        lines.append(f"| {k} | {v:.3f} | {nbytes / v / 1e9:.2f} | {v / gloo:.2f}x |")
    for where in ("disk", "/dev/shm"):
        raw = med[f"raw safetensors save+fsync+load ({where})"]
        lines.append(
            f"\nvolume ({where}) vs raw safetensors save+fsync+load: "
            f"end to end {med[f'volume channel ({where})'] / raw:.2f}x, "
            f"transport only {med[f'volume transport only, no engine ({where})'] / raw:.2f}x"
        )
    lines.append(
        f"\ncpu channel bandwidth vs raw gloo flat broadcast: end to end {gloo / med['cpu channel'] * 100:.0f}%, "
        f"transport only {gloo / med['cpu stream transport only, no engine'] * 100:.0f}%"
    )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": results, "median": med, "bytes": nbytes}, indent=1))


if __name__ == "__main__":
    main()
