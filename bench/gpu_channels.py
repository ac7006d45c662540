"""GPU channel benchmark: our NCCL and IPC channels against the raw transfers, same bytes, same machine.

    PYTHONPATH=. python bench/gpu_channels.py --model qwen3-1.7b --part nccl --receivers 1 --json out.json
    PYTHONPATH=. python bench/gpu_channels.py --model qwen3-1.7b --part ipc --json out.json

``nccl`` (GPU 0 is the trainer, GPUs 1..N the engines): raw flat broadcast of the
table's bytes; our channel end to end (trainer bf16 tensors -> engine-layout
parameters, fused qkv/gate_up, each parameter its own allocation, through the direct
plan); the same from fp32 trainer tensors (cast included); per-tensor broadcast and
vLLM's packed scheme (two 1 GiB buffers, pack/broadcast/unpack, serial) into the same
engine parameters; verification timed on its own. ``ipc`` (GPU 0, two processes):
one flat same-GPU copy of the same bytes, and our IPC channel into the engine's
parameters (receive alone, and send + receive). Median of ``--reps`` after a warm-up.

The channels run as the publisher and the engine drive them, without a coordinator:
the trainer builds its sender from a ``SenderConfig``, plans the engines on it
(``direct_rendezvous``; several engines share one NCCL membership with consecutive
ranks, as the coordinator's negotiation plans them) and hands each engine its
``Rendezvous`` as JSON. Every run is a new version. The engines' tickets carry no
table: the channel carries it (a store key for NCCL, the version's metadata for IPC)
and the receiver checks it against the layout digest, so the channel rows include
that per-version step. Destinations come from a ``place`` callable that returns the
same mapping every version, as the engine's does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import gpu_models  # type: ignore[import-not-found,unused-ignore]

from weightsync.channels import ipc, nccl, placement
from weightsync.channels.base import Rendezvous, SenderConfig, UpdateTicket, WorkerContext, direct_rendezvous
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

PACKED_BUFFER = 1 << 30


def median_time(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median wall time of ``fn`` across all ranks (barriers around each run)."""
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        dist.barrier()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def trainer_tensors(table: TensorTable, device: torch.device, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    g = torch.Generator(device=device)
    g.manual_seed(0)
    return [torch.randn(s.shape, generator=g, device=device, dtype=dtype or TORCH_DTYPES[s.dtype]) for s in table]


def engine_params(layout: dict[str, tuple[str, tuple[int, ...]]], device: torch.device) -> dict[str, torch.Tensor]:
    """One allocation per parameter, as the engine holds them."""
    return {n: torch.empty(shape, dtype=TORCH_DTYPES[d], device=device) for n, (d, shape) in layout.items()}


def sender_ticket(table: TensorTable, layout_digest: str, version: int, channel: Channel, verify: bool) -> UpdateTicket:
    """The trainer's ticket: the table, and its layout digest (computed once, as the publisher does)."""
    return UpdateTicket(version, channel, table, layout_digest, verify=verify, timeout_s=60)


def engine_ticket(layout_digest: str, version: int, channel: Channel, verify: bool) -> UpdateTicket:
    """An engine's ticket: no table (the channel carries it), the layout digest to check it against."""
    return UpdateTicket(version, channel, layout_digest=layout_digest, verify=verify, timeout_s=60)


def grouped(table: TensorTable, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    index = {s.name: i for i, s in enumerate(table)}
    return [[tensors[index[s.name]] for s in g] for g in table.groups()]


def flat_broadcast(nbytes: int, reps: int, device: torch.device) -> float:
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return median_time(lambda: dist.broadcast(flat, 0), reps, device)


def flat_copy(nbytes: int, reps: int, device: torch.device) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return median_time(lambda: b.copy_(a), reps, device)


def packed_broadcast(views: list[torch.Tensor], rank: int, reps: int, device: torch.device) -> float:
    """vLLM's documented scheme: fill a 1 GiB buffer, broadcast it, unpack it; two buffers, serial."""
    raw = [v.reshape(-1).view(torch.uint8) for v in views]
    # a tensor larger than the buffer (the 8B's embedding) travels alone in a buffer of its size
    size = max(PACKED_BUFFER, *(r.numel() for r in raw))
    bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]

    def packed() -> None:
        i, k = 0, 0
        while i < len(raw):
            j, size = i, 0
            while j < len(raw) and (size == 0 or size + raw[j].numel() <= PACKED_BUFFER):
                size += raw[j].numel()
                j += 1
            buf = bufs[k % 2][:size]
            if rank == 0:
                torch.cat(raw[i:j], out=buf)
            dist.broadcast(buf, 0)
            if rank > 0:
                torch.split_with_sizes_copy(buf, [r.numel() for r in raw[i:j]], out=raw[i:j])
            i, k = j, k + 1

    return median_time(packed, reps, device)


def nccl_worker(rank: int, world: int, model: str, reps: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    table = gpu_models.trainer_table(model)
    layout, plan = gpu_models.load_plan(model)
    nbytes = table.total_bytes
    res: dict[str, float | int | str | bool] = {"bytes": nbytes, "tensors": len(table), "receivers": world - 1}
    # engine side: parameters in the engine's layout and their direct views; trainer side: its tensors
    if rank == 0:
        srcs = trainer_tensors(table, dev)
        views = srcs
    else:
        params = engine_params(layout, dev)
        dests = placement.resolve(plan, params)
        views = [dests[s.name] for s in table]

    res["raw_flat_broadcast"] = flat_broadcast(nbytes, reps, dev)

    res["per_tensor_broadcast"] = median_time(lambda: [dist.broadcast(v, 0) for v in views], reps, dev)

    res["packed_1GiB_x2_serial"] = packed_broadcast(views, rank, reps, dev)
    torch.cuda.empty_cache()

    # our channel: its own store and NCCL group beside the default one. Each engine GPU is one replica of one
    # worker; all of them share one membership (its group, secret, generation), each at its own rank.
    box: list[str] = [""]
    if rank == 0:
        sender = nccl.NcclSender.create(SenderConfig(device=str(dev), timeout_s=60))
        first = direct_rendezvous(sender.offer(), devices=world - 1, group="bench", join_timeout_s=50).with_timeout(60)
        members = {f"engine-{r}": dataclasses.replace(first, rank=r) for r in range(1, world)}
        sender.take_plan(members)  # forms the group in the background while the engines join
        box[0] = json.dumps({rid: rdv.to_dict() for rid, rdv in members.items()})
    dist.broadcast_object_list(box, 0)
    if rank > 0:
        rdv = Rendezvous.from_dict(json.loads(box[0])[f"engine-{rank}"])
        receiver = nccl.NcclReceiver.start(rdv, WorkerContext(0, 1, str(dev)))
    layout_digest = table.layout_digest()
    version = [0]

    def channel(tensors: list[list[torch.Tensor]] | None, verify: bool) -> Callable[[], None]:
        def run() -> None:
            version[0] += 1
            if rank == 0:
                assert tensors is not None
                sender.send(sender_ticket(table, layout_digest, version[0], Channel.NCCL, verify), tensors)
            else:
                ticket = engine_ticket(layout_digest, version[0], Channel.NCCL, verify)
                for _ in receiver.receive(ticket, lambda _table: dests):
                    raise AssertionError("every tensor should land in place")

        return run

    res["channel_e2e_bf16"] = median_time(channel(grouped(table, srcs) if rank == 0 else None, False), reps, dev)
    res["channel_e2e_bf16_verify"] = median_time(channel(grouped(table, srcs) if rank == 0 else None, True), 3, dev)
    res["verified"] = True  # the verify run raises on any digest mismatch
    if rank == 0:
        del srcs, views
        torch.cuda.empty_cache()
        fp32 = trainer_tensors(table, dev, torch.float32)
    res["channel_e2e_fp32_cast"] = median_time(channel(grouped(table, fp32) if rank == 0 else None, False), reps, dev)
    fp32_groups = grouped(table, fp32) if rank == 0 else None
    res["channel_e2e_fp32_cast_verify"] = median_time(channel(fp32_groups, True), 3, dev)
    res["card"] = torch.cuda.get_device_name(dev)
    if rank == 1:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    (sender if rank == 0 else receiver).close()
    dist.destroy_process_group()


def ipc_worker(rank: int, model: str, reps: int, port: int, out: str) -> None:
    """Rank 0 the trainer, rank 1 the engine, both on GPU 0; a gloo group times them together."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    table = gpu_models.trainer_table(model)
    layout, plan = gpu_models.load_plan(model)
    res: dict[str, float | int | str | bool] = {"bytes": table.total_bytes, "tensors": len(table)}
    # the engine times one flat copy of the same bytes (every rank joins the barriers of median_time)
    res["raw_flat_copy"] = flat_copy(table.total_bytes if rank == 1 else 0, reps, dev)
    torch.cuda.empty_cache()
    if rank == 1:
        params = engine_params(layout, dev)
        dests = placement.resolve(plan, params)
    box: list[str] = [""]
    if rank == 0:
        sender = ipc.IpcSender.create(SenderConfig(device=str(dev), timeout_s=60))
        rdv = direct_rendezvous(sender.offer(), group="bench", join_timeout_s=50).with_timeout(60)
        sender.take_plan({"engine": rdv})
        box[0] = json.dumps(rdv.to_dict())
    dist.broadcast_object_list(box, 0)
    if rank == 1:
        receiver = ipc.IpcReceiver.start(Rendezvous.from_dict(json.loads(box[0])), WorkerContext(0, 1, str(dev)))
    layout_digest = table.layout_digest()
    version, released = [0], [0]

    def receive(ticket: UpdateTicket) -> None:
        for _ in receiver.receive(ticket, lambda _table: dests):
            raise AssertionError("every tensor should land in place")

    def release() -> None:
        """The trainer's wait for the engine's copies of every version so far (outside the timed windows)."""
        if rank == 0:
            while released[0] < version[0]:
                released[0] += 1
                sender.release(released[0], 60)

    def one(src: list[list[torch.Tensor]] | None, verify: bool, timed_side: str) -> Callable[[], None]:
        def run() -> None:
            version[0] += 1
            if rank == 0 and timed_side == "both":
                assert src is not None
                sender.send(sender_ticket(table, layout_digest, version[0], Channel.IPC, verify), src)
            if rank == 1:
                receive(engine_ticket(layout_digest, version[0], Channel.IPC, verify))

        return run

    for label, dtype in (("bf16", None), ("fp32_cast", torch.float32)):
        src = grouped(table, trainer_tensors(table, dev, dtype)) if rank == 0 else None
        res[f"channel_send_receive_{label}"] = median_time(one(src, False, "both"), reps, dev)
        release()
        # receive alone: the trainer publishes each version before the timed window
        times = []
        for _ in range(reps + 1):
            version[0] += 1
            if rank == 0:
                assert src is not None
                sender.send(sender_ticket(table, layout_digest, version[0], Channel.IPC, False), src)
            dist.barrier()
            if rank == 1:
                torch.cuda.synchronize(dev)
                t = time.perf_counter()
                receive(engine_ticket(layout_digest, version[0], Channel.IPC, False))
                torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t)
            dist.barrier()
            release()
        if rank == 1:
            res[f"channel_receive_{label}"] = sorted(times[1:])[len(times[1:]) // 2]
        res[f"channel_send_receive_{label}_verify"] = median_time(one(src, True, "both"), 3, dev)
        release()
        del src
        torch.cuda.empty_cache()
    res["card"] = torch.cuda.get_device_name(dev)
    if rank == 1:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    (sender if rank == 0 else receiver).close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(gpu_models.MODELS), default="qwen3-1.7b")
    ap.add_argument("--part", choices=("nccl", "ipc"), default="nccl")
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--json", default="gpu_channels.json")
    args = ap.parse_args()
    spawner: Any = mp  # torch's stubs lack spawn
    if args.part == "nccl":
        world = args.receivers + 1
        spawner.spawn(nccl_worker, args=(world, args.model, args.reps, args.port, args.json), nprocs=world)
    else:
        spawner.spawn(ipc_worker, args=(args.model, args.reps, args.port, args.json), nprocs=2)
    res = json.loads(Path(args.json).read_text())
    gb = res["bytes"] / 1e9
    base = res.get("raw_flat_broadcast") or res["raw_flat_copy"]
    print(
        f"{args.model} {args.part} receivers={res.get('receivers', 1)} {gb:.3f} GB in {res['tensors']} tensors "
        f"on {res['card']}"
    )
    for k, v in res.items():
        if isinstance(v, float):
            print(f"  {k:34s} {v * 1e3:9.2f} ms  {gb / v:8.1f} GB/s  {v / base:5.2f}x")


if __name__ == "__main__":
    main()
