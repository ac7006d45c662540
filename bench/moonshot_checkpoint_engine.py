"""checkpoint-engine 0.4.2 (MoonshotAI), broadcast mode, against the raw wire: same bytes, same run.

    bash tools/gpu-host.sh python3 bench/moonshot_checkpoint_engine.py --model qwen3-1.7b --json ce.json

The parameter set is ``bench/gpu_models.py``'s trainer table (real shapes, bf16, random
values, Hugging Face names). GPU 0 is the trainer / parameter-server side, GPU 1 the
inference side. The setup is the smallest one checkpoint-engine's own 2-GPU test drives
(its tests/test_update.py): one ``ParameterServer`` process per GPU (ranks 0 and 1, one
NCCL group), each with a colocated worker process on the same GPU that runs
``checkpoint_engine.worker.update_weights_from_ipc`` (what vLLM's worker extension runs),
reached through a queue where vLLM would get an HTTP ``collective_rpc``. Rank 0 registers
every tensor (``register_checkpoint(named_tensors=...)``: host copies into its pinned
buffers); rank 1 registers none, so broadcast mode (``update`` with no ranks) moves each
bucket pinned host -> GPU 0 -> NCCL broadcast -> GPU 1's IPC buffer. GPU 1's worker copies
each received tensor into preallocated parameters (one ``torch.empty`` per table tensor,
``param.copy_(tensor)``, the load_weights callback); GPU 0's worker must answer its rank's
zmq handshake too, and acks each bucket without loading (the trainer GPU holds no
inference parameters). No vLLM: the post hook is a device synchronize.

Timed window (per update; median of ``--reps`` after ``--warmups``): from both ranks leaving
a store barrier to the later of the two ``ParameterServer.update`` returns, which is after
GPU 1's worker acked its last copy. Inside: the bucket-size all_reduce; allocation of the
H2D buffer and the two-bucket IPC buffer on each GPU (checkpoint-engine empties the cache
after every update, so these are fresh allocations); the IPC handle over zmq; the request
to the workers; per bucket the H2D copy from pinned host memory, the copy into the IPC
buffer, the NCCL broadcast, the metadata over zmq, the worker's copies and ack, an
all_reduce of error codes; the release handshakes, ipc_collect/empty_cache, the closing
NCCL and store barriers. Outside: making the tensors, ``register_checkpoint`` (pinning and
filling the host buffers once; a trainer would pay a device-to-host copy of its weights per
version), ``gather_metas``, process-group formation (formed once; ``--auto-pg`` re-forms it
inside every update, checkpoint-engine's default), worker start and parameter allocation,
the bit-exactness check (digests of GPU 1's parameters against the sources, once, at the
end). The bucket size is checkpoint-engine's own (``PS_MAX_BUCKET_SIZE_GB``, 8 GiB unless
``--bucket-gb``): Qwen3-1.7B travels as one bucket.

The raw baseline of the same run is one flat NCCL broadcast of the table's bytes from GPU 0
to GPU 1 (``bench/gpu_fleet.py``'s); "x" (``ratio``) is checkpoint_engine_ms over it.
``raw_pinned_h2d_ms`` is one flat pinned host -> GPU 0 copy of the same bytes, for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

NAME = "bench"


def _worker(rank: int, uuid: str, model: str, load: bool, requests: Any, replies: Any, timeout_s: float) -> None:
    """The inference side on GPU ``rank``: checkpoint-engine's receive loop into preallocated parameters."""
    import queue

    import torch
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    from bench import gpu_models
    from weightsync.channels import digests
    from weightsync.channels.wire import TORCH_DTYPES

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    ctx = zmq.Context()
    ctx.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))  # every socket of this context: no recv waits forever
    table = gpu_models.trainer_table(model)
    params = {s.name: torch.empty(s.shape, dtype=TORCH_DTYPES[s.dtype], device=dev) for s in table} if load else {}

    def load_weights(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            params[name].copy_(tensor)

    parent, idle = os.getppid(), time.monotonic() + timeout_s
    replies.put("ready")
    while True:
        try:
            msg = requests.get(timeout=1)
        except queue.Empty:
            if os.getppid() != parent or time.monotonic() > idle:
                return
            continue
        idle = time.monotonic() + timeout_s
        if msg is None:
            return
        if msg == "digests":
            replies.put({n: digests.digest(p) for n, p in params.items()})
            continue
        run = load_weights if load else (lambda _weights: None)
        update_weights_from_ipc(ctx, dict(msg)[uuid], device_id=rank, run=run, post_hook=torch.cuda.synchronize)


def _ps_rank(rank: int, args: argparse.Namespace, ports: tuple[int, int], out: str) -> None:
    """One ParameterServer process (rank 0 on GPU 0 owns every tensor; rank 1 on GPU 1) and its worker."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    if args.bucket_gb:
        os.environ["PS_MAX_BUCKET_SIZE_GB"] = str(args.bucket_gb)
    import checkpoint_engine
    import checkpoint_engine.distributed as cdist
    import checkpoint_engine.ps as ps_mod
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import zmq
    from loguru import logger

    from bench import gpu_channels, gpu_models
    from weightsync.channels import digests

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    try:
        ps_mod.get_ip()
    except OSError:  # no route out and an unresolvable host name: the address is only metadata on one node
        ps_mod.get_ip = lambda: "127.0.0.1"
    td = timedelta(seconds=args.timeout)
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    table = gpu_models.trainer_table(args.model)
    ps = ps_mod.ParameterServer(rank=rank, world_size=2, auto_pg=args.auto_pg, master_addr="127.0.0.1",
                                master_port=ports[0])  # fmt: skip
    for opt in (zmq.RCVTIMEO, zmq.SNDTIMEO):  # its sockets come from this context: no zmq wait lasts forever
        ps._zmq_ctx.setsockopt(opt, int(args.timeout * 1000))
    uuid = ps_mod._get_physical_gpu_id(ps.device_manager, rank)
    spawn = mp.get_context("spawn")
    requests, replies = spawn.Queue(), spawn.Queue()
    worker = spawn.Process(target=_worker, args=(rank, uuid, args.model, rank == 1, requests, replies, args.timeout),
                           daemon=True)  # fmt: skip
    worker.start()
    res: dict[str, Any] = {"version": checkpoint_engine.__version__}
    named: dict[str, torch.Tensor] = {}
    if rank == 0:
        host = torch.empty(table.total_bytes, dtype=torch.uint8, pin_memory=True)
        flat = torch.empty(table.total_bytes, dtype=torch.uint8, device=dev)
        h2d = []
        for _ in range(args.reps + 1):
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            flat.copy_(host, non_blocking=True)
            torch.cuda.synchronize(dev)
            h2d.append(time.perf_counter() - t)
        res["raw_pinned_h2d_ms"] = statistics.median(h2d[1:]) * 1e3
        del host, flat
        srcs = gpu_channels.trainer_tensors(table, dev)
        res["digests"] = {s.name: digests.digest(t) for s, t in zip(table, srcs, strict=True)}
        named = {s.name: t.cpu() for s, t in zip(table, srcs, strict=True)}
        del srcs
        torch.cuda.empty_cache()
    t = time.perf_counter()
    ps.register_checkpoint(NAME, named_tensors=named)  # copies into checkpoint-engine's own pinned buffers
    res["register_checkpoint_s"] = time.perf_counter() - t
    del named
    if replies.get(timeout=args.timeout) != "ready":
        raise RuntimeError("the worker did not start")
    if not args.auto_pg:
        ps.init_process_group(timeout=td)
    ps.gather_metas(NAME)
    store = dist.TCPStore("127.0.0.1", ports[1], 2, rank == 0, timeout=td)

    def barrier(key: str) -> None:
        store.set(f"{key}.{rank}", "1")
        store.wait([f"{key}.0", f"{key}.1"], td)

    samples = []
    for i in range(args.warmups + args.reps):
        if args.auto_pg:
            time.sleep(1)  # checkpoint-engine's test waits for the destroyed group before the next update
        barrier(f"go{i}")
        t = time.perf_counter()
        ps.update(NAME, requests.put, timeout=td)
        samples.append(time.perf_counter() - t)
    res["samples_s"] = samples[args.warmups :]
    if rank == 1:
        requests.put("digests")
        res["digests"] = replies.get(timeout=args.timeout)
    requests.put(None)
    worker.join(timeout=args.timeout)
    if worker.is_alive():
        worker.kill()
    ps.unregister_checkpoint(NAME)
    barrier("end")
    if cdist.is_initialized():
        cdist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(res))


def checkpoint_engine_run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both ranks' results; the whole run is bounded by ``--deadline`` (its processes are killed past it)."""
    import torch.multiprocessing as mp

    from bench.gpu_fleet import _free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank")
        spawner: Any = mp  # torch's stubs lack spawn
        ports = (_free_port(), _free_port())
        while ports[1] == ports[0]:
            ports = (ports[0], _free_port())
        ctx = spawner.spawn(_ps_rank, args=(args, ports, out), nprocs=2, join=False)
        deadline = time.monotonic() + args.deadline
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"checkpoint-engine run past {args.deadline} s")
        r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
        return r0, r1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", help="qwen3-1.7b, qwen3-8b or qwen3-tiny (bench/gpu_models.py)")
    p.add_argument("--reps", type=int, default=5, help="timed updates")
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--bucket-gb", type=float, default=None, help="PS_MAX_BUCKET_SIZE_GB (checkpoint-engine: 8)")
    p.add_argument("--auto-pg", action="store_true", help="ParameterServer(auto_pg=True): a new group per update")
    p.add_argument("--timeout", type=float, default=300, help="seconds, each blocking step")
    p.add_argument("--deadline", type=float, default=480, help="seconds, the whole checkpoint-engine run")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from bench import gpu_fleet, gpu_models

    table = gpu_models.trainer_table(args.model)
    out: dict[str, Any] = {"model": args.model, "gpu": gpu_fleet._gpu_name(), "bytes": table.total_bytes,
                           "tensors": len(table)}  # fmt: skip
    out["raw_flat_broadcast_ms"] = gpu_fleet.raw_flat_broadcast_ms(args.model)
    r0, r1 = checkpoint_engine_run(args)
    samples = [max(a, b) * 1e3 for a, b in zip(r0["samples_s"], r1["samples_s"], strict=True)]
    out["checkpoint_engine_ms"] = statistics.median(samples)
    out["ratio"] = out["checkpoint_engine_ms"] / out["raw_flat_broadcast_ms"]
    out["samples_ms"] = samples
    out["raw_pinned_h2d_ms"] = r0["raw_pinned_h2d_ms"]
    out["bit_exact"] = r0["digests"] == r1["digests"]
    out["settings"] = {"checkpoint_engine": r0["version"], "mode": "broadcast", "auto_pg": args.auto_pg,
                       "bucket_gb": args.bucket_gb or "default (8)", "warmups": args.warmups, "reps": args.reps,
                       "register_checkpoint_s": r0["register_checkpoint_s"]}  # fmt: skip
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if out["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
