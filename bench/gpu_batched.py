"""The batched kernels on one GPU: a version's digests and a staged switch's copies, against per-tensor work and a
flat copy of the same bytes, in the same run.

    bash tools/gpu-host.sh python3 bench/gpu_batched.py --model qwen3-1.7b --json out.json

The tensors are the model's trainer tensors (``bench/gpu_models``), each its own allocation as a trainer holds
them; the stage is one buffer with every tensor at its table offset (``weightsync_inference.staging``). Timed on
the GPU (CUDA events, median of ``--reps`` after a warm-up):

- ``flat_copy``: one device copy of all the bytes (the raw baseline);
- ``digest_per_tensor``: ``digests.word`` per tensor (two kernels each), the path before ``batched``;
- ``digest_batched``: ``digests.words`` per table group, as the channels call it (one launch per group);
- ``copy_graph``: a CUDA graph of one memcpy per tensor (the switch before ``batched``);
- ``copy_batched``: ``batched.copies`` of the same pairs.

Both batched results are checked against the per-tensor ones (equal digests, equal bytes) before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_models, report  # noqa: E402
from weightsync.channels import batched, digests  # noqa: E402
from weightsync.channels.wire import view_from_bytes  # noqa: E402
from weightsync.tensors import align  # noqa: E402


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median GPU milliseconds of ``fn`` (CUDA events around each call, after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(model: str, reps: int) -> dict[str, object]:
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    table = gpu_models.trainer_table(model)
    gen = torch.Generator(device=device).manual_seed(1)
    tensors = []
    for spec in table:
        t = torch.empty(spec.shape, dtype=torch.bfloat16, device=device)
        t.view(torch.int16).random_(generator=gen)
        tensors.append(t)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    stage = torch.empty(max(align(s.end) for s in table), dtype=torch.uint8, device=device)
    views = [view_from_bytes(stage, s) for s in table]
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)

    by_name = {spec.name: t for spec, t in zip(table, tensors, strict=True)}
    groups = [[by_name[spec.name] for spec in group] for group in table.groups()]
    per_tensor = torch.stack([digests.word(t) for t in tensors])
    batched_words = torch.cat([digests.words(g) for g in groups])
    if not torch.equal(per_tensor, batched_words):
        raise SystemExit("batched digests differ from the per-tensor digests")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for v, t in zip(views, tensors, strict=True):
            v.copy_(t)
    batch = batched.copies(views, tensors)
    stage.zero_()
    batch()
    if not all(torch.equal(v.view(torch.int16), t.view(torch.int16)) for v, t in zip(views, tensors, strict=True)):
        raise SystemExit("the batched copy did not land every tensor")

    flat = timed(lambda: flat_dst.copy_(flat_src), reps)
    rows = {
        "digest_per_tensor": timed(lambda: torch.stack([digests.word(t) for t in tensors]), reps),
        "digest_batched": timed(lambda: [digests.words(g) for g in groups], reps),
        "copy_graph": timed(graph.replay, reps),
        "copy_batched": timed(batch, reps),
    }
    return {
        "model": model,
        "device": torch.cuda.get_device_name(device),
        "tensors": len(tensors),
        "groups": len(groups),
        "bytes": nbytes,
        "flat_copy_ms": flat,
        **{f"{k}_ms": v for k, v in rows.items()},
        **{f"{k}_x_flat_copy": v / flat for k, v in rows.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(gpu_models.MODELS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default="", help="write the result here too")
    args = p.parse_args()
    if not batched.available(torch.device("cuda")):
        raise SystemExit("needs a CUDA device and Triton")
    result = run(args.model, args.reps)
    report.emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
