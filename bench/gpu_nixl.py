"""NIXL channel benchmark: our NIXL channel against a raw flat NCCL broadcast and a raw flat NIXL READ, same bytes.

    PYTHONPATH=.:/tmp/site python bench/gpu_nixl.py --model qwen3-1.7b --json nixl.json

GPU 0 is the trainer, GPU 1 the engine (two processes). Measured, median of
``--reps`` after a warm-up: ``raw_flat_broadcast`` (one NCCL broadcast of the table's
bytes), ``raw_nixl_flat_read`` (one NIXL READ of one registered flat buffer of the
same bytes into another, timed on the engine), ``raw_nixl_tensor_descs_*`` (the
trainer's tensors READ with one descriptor each, in one transfer and in one transfer
per group posted together: NIXL's cost per descriptor, no channel code), and our channel end to end: the
trainer's bf16 tensors (registered as they are, once) to engine-layout parameters
(fused qkv/gate_up, each parameter its own allocation, through the direct plan),
``send`` + ``receive`` + the trainer's ``release`` (it awaits the engine's ack), at the
default READ window and with every group's READ in flight at once; the engine's
``receive`` alone (version published before the timed window); the same from fp32
trainer tensors (cast into the sender's registered buffers included); verification
timed on its own.

As in bench/gpu_channels.py, the trainer plans the engine without a coordinator
(``direct_rendezvous`` over its offer, which carries the NIXL agent's name and
metadata) and hands it the ``Rendezvous`` as JSON; the engine's tickets carry no
table (the version's metadata does, checked against the layout digest).
"""

from __future__ import annotations

import argparse
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
import gpu_channels  # type: ignore[import-not-found,unused-ignore]
import gpu_models  # type: ignore[import-not-found,unused-ignore]

from weightsync.channels import nixl, placement
from weightsync.channels.base import Rendezvous, SenderConfig, WorkerContext, direct_rendezvous
from weightsync.tensors import TensorTable, align
from weightsync.vocabulary import Channel


def raw_nixl_read(nbytes: int, rank: int, reps: int, device: torch.device) -> float:
    """One READ of ``nbytes`` from the trainer's registered flat buffer into the engine's, timed on the engine."""
    agent = nixl.new_agent(f"raw-{rank}")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    agent.register_memory(flat)
    box: list[str] = [json.dumps({"md": nixl.encode_metadata(agent.get_agent_metadata()), "addr": flat.data_ptr()})]
    dist.broadcast_object_list(box, 0)
    handle: Any = None
    if rank == 1:
        peer = json.loads(box[0])
        agent.add_remote_agent(nixl.decode_metadata(peer["md"], "raw trainer metadata"))
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(flat), agent.get_xfer_descs([(peer["addr"], nbytes, 0)], "VRAM"), "raw-0"
        )

    def read() -> None:
        if handle is None:
            return
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read: {state}")

    t = float(gpu_channels.median_time(read, reps, device))
    dist.barrier()
    if handle is not None:
        handle.release()
    return t


def raw_nixl_tensor_reads(table: TensorTable, rank: int, reps: int, device: torch.device) -> tuple[float, float]:
    """The trainer's tensors (each its own registered allocation) READ into one flat buffer with one descriptor
    per tensor, no channel code: as one transfer, and as one transfer per table group all posted at once (the
    channel's shape with every group in flight). What NIXL costs per descriptor, against the flat read."""
    agent = nixl.new_agent(f"raw-tensors-{rank}")
    box: list[str] = [""]
    tensors: list[torch.Tensor] = []
    if rank == 0:
        tensors = gpu_channels.trainer_tensors(table, device)
        agent.register_memory([(t.data_ptr(), t.nbytes, device.index, "") for t in tensors], "VRAM")
        segments = [(t.data_ptr(), t.nbytes) for t in tensors]
        box[0] = json.dumps({"md": nixl.encode_metadata(agent.get_agent_metadata()), "segments": segments})
    dist.broadcast_object_list(box, 0)
    handles: list[Any] = []
    if rank == 1:
        peer = json.loads(box[0])
        agent.add_remote_agent(nixl.decode_metadata(peer["md"], "raw trainer metadata"))
        flat = torch.empty(sum(align(n, 256) for _, n in peer["segments"]), dtype=torch.uint8, device=device)
        agent.register_memory(flat)
        local, offset = [], 0
        for _, n in peer["segments"]:
            local.append((flat.data_ptr() + offset, n, device.index))
            offset += align(n, 256)
        remote = [(a, n, 0) for a, n in peer["segments"]]
        index = {s.name: i for i, s in enumerate(table)}
        spans = [[index[s.name] for s in g] for g in table.groups()]

        def xfer(ids: list[int]) -> Any:
            return agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs([local[i] for i in ids], "VRAM"),
                agent.get_xfer_descs([remote[i] for i in ids], "VRAM"),
                "raw-tensors-0",
            )

        handles = [xfer(list(range(len(local))))] + [xfer(ids) for ids in spans]

    def read(posted: list[Any]) -> Callable[[], None]:
        def run() -> None:
            for h in posted:
                if agent.transfer(h) == "ERR":
                    raise RuntimeError("raw NIXL read: ERR")
            for h in posted:
                state = agent.check_xfer_state(h)
                while state == "PROC":
                    state = agent.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL read: {state}")

        return run

    one = float(gpu_channels.median_time(read(handles[:1]), reps, device))
    per_group = float(gpu_channels.median_time(read(handles[1:]), reps, device))
    dist.barrier()
    for h in handles:
        h.release()
    return one, per_group


def worker(rank: int, model: str, reps: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=dev)
    table = gpu_models.trainer_table(model)
    layout, plan = gpu_models.load_plan(model)
    nbytes = table.total_bytes
    res: dict[str, float | int | str | bool] = {"bytes": nbytes, "tensors": len(table), "groups": len(table.groups())}
    res["raw_flat_broadcast"] = gpu_channels.flat_broadcast(nbytes, reps, dev)
    torch.cuda.empty_cache()
    res["raw_nixl_flat_read"] = raw_nixl_read(nbytes, rank, reps, dev)
    torch.cuda.empty_cache()
    one, per_group = raw_nixl_tensor_reads(table, rank, reps, dev)
    res["raw_nixl_tensor_descs_one_read"], res["raw_nixl_tensor_descs_read_per_group"] = one, per_group
    torch.cuda.empty_cache()

    box: list[str] = [""]
    if rank == 0:
        sender = nixl.NixlSender.create(SenderConfig(device=str(dev), timeout_s=60))
        rdv = direct_rendezvous(sender.offer(), group="bench", join_timeout_s=50).with_timeout(60)
        sender.take_plan({"engine": rdv})
        box[0] = json.dumps(rdv.to_dict())
        srcs = gpu_channels.grouped(table, gpu_channels.trainer_tensors(table, dev))
    else:
        params = gpu_channels.engine_params(layout, dev)
        dests = placement.resolve(plan, params)
    dist.broadcast_object_list(box, 0)
    if rank == 1:
        started = nixl.NixlReceiver.start(Rendezvous.from_dict(json.loads(box[0])), WorkerContext(0, 1, str(dev)))
        assert isinstance(started, nixl.NixlReceiver)
        receiver = started
    layout_digest = table.layout_digest()
    version = [0]

    def receive(verify: bool) -> None:
        ticket = gpu_channels.engine_ticket(layout_digest, version[0], Channel.NIXL, verify)
        for _ in receiver.receive(ticket, lambda _table: dests):
            raise AssertionError("every tensor should land in place")

    def channel(src: list[list[torch.Tensor]] | None, verify: bool) -> Callable[[], None]:
        def run() -> None:
            version[0] += 1
            if rank == 0:
                assert src is not None
                sender.send(gpu_channels.sender_ticket(table, layout_digest, version[0], Channel.NIXL, verify), src)
                sender.release(version[0], 60)
            else:
                receive(verify)

        return run

    # the READ window (groups in flight at once) picked by measurement: the default, then others
    for window in (nixl.DEFAULT_WINDOW, 2, 4, 8, 16, len(table.groups())):
        if rank == 1:
            receiver.window = window
        key = "channel_e2e_bf16" if window == nixl.DEFAULT_WINDOW and "channel_e2e_bf16" not in res else None
        t = gpu_channels.median_time(channel(srcs if rank == 0 else None, False), reps, dev)
        res[key or f"channel_e2e_bf16_window_{window}"] = t
    if rank == 1:
        receiver.window = nixl.DEFAULT_WINDOW
    # receive alone: the trainer publishes each version before the timed window
    times = []
    for _ in range(reps + 1):
        version[0] += 1
        if rank == 0:
            sender.send(gpu_channels.sender_ticket(table, layout_digest, version[0], Channel.NIXL, False), srcs)
        dist.barrier()
        if rank == 1:
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            receive(False)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
        else:
            sender.release(version[0], 60)
        dist.barrier()
    if rank == 1:
        res["channel_receive_bf16"] = sorted(times[1:])[len(times[1:]) // 2]
    res["channel_e2e_bf16_verify"] = gpu_channels.median_time(channel(srcs if rank == 0 else None, True), 3, dev)
    res["verified"] = True  # the verify run raises on any digest mismatch
    if rank == 0:
        res["registrations_bf16"] = sender.registrations
        del srcs
        torch.cuda.empty_cache()
        fp32 = gpu_channels.grouped(table, gpu_channels.trainer_tensors(table, dev, torch.float32))
    res["channel_e2e_fp32_cast"] = gpu_channels.median_time(channel(fp32 if rank == 0 else None, False), reps, dev)
    res["card"] = torch.cuda.get_device_name(dev)
    meta: list[dict[str, Any]] = [{}]
    if rank == 0:
        meta[0] = {"registrations_bf16": res["registrations_bf16"], "registrations_fp32": sender.registrations}
    dist.broadcast_object_list(meta, 0)
    res.update(meta[0])
    if rank == 1:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    (sender if rank == 0 else receiver).close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(gpu_models.MODELS), default="qwen3-1.7b")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--port", type=int, default=29631)
    ap.add_argument("--json", default="gpu_nixl.json")
    args = ap.parse_args()
    spawner: Any = mp  # torch's stubs lack spawn
    spawner.spawn(worker, args=(args.model, args.reps, args.port, args.json), nprocs=2)
    res = json.loads(Path(args.json).read_text())
    gb = res["bytes"] / 1e9
    base = res["raw_flat_broadcast"]
    print(f"{args.model} nixl {gb:.3f} GB in {res['tensors']} tensors, {res['groups']} groups, on {res['card']}")
    for k, v in res.items():
        if isinstance(v, float):
            print(f"  {k:34s} {v * 1e3:9.2f} ms  {gb / v:8.1f} GB/s  {v / base:5.2f}x")
        else:
            print(f"  {k:34s} {v}")


if __name__ == "__main__":
    main()
