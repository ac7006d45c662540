"""The GPU fleet's trainer: the real ``Publisher`` on one GPU, publishing a model-sized table of random weights.

Started by tests/gpu/test_fleet_gpu.py and bench/gpu_fleet.py; driven over stdin, one JSON
command per line, answering one JSON line each:

    {"seed": 3, "step": 7}     new random weights (seed 3) in the same tensors, publish step 7

The answer carries the publish report and the per-tensor digests of what was published
(computed here, on the trainer's GPU), which the test compares with the digests of each
replica's parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator

import torch

from weightsync.channels import digests
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.coordinator.client import CoordinatorClient
from weightsync.jobconfig import JobConfig
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel
from weightsync_trainer.publisher import Publisher


class RandomSource:
    """A trainer's weights: one tensor per table entry on the trainer's GPU, refilled in place per version."""

    def __init__(self, table: TensorTable, device: torch.device) -> None:
        self._table = table
        self.tensors = [torch.empty(s.shape, dtype=TORCH_DTYPES[s.dtype], device=device) for s in table]
        self.device = device

    def fill(self, seed: int) -> None:
        g = torch.Generator(device=self.device).manual_seed(seed)
        for t in self.tensors:
            t.copy_(torch.randn(t.shape, generator=g, device=self.device, dtype=torch.float32))

    def table(self) -> TensorTable:
        return self._table

    def groups(self) -> Iterator[list[torch.Tensor]]:
        start = 0
        for group in self._table.groups():
            yield self.tensors[start : start + len(group)]
            start += len(group)


def main() -> int:
    sys.path.insert(0, ".")
    from bench import gpu_models

    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--job", default="gpu-fleet")
    p.add_argument("--model", default="qwen3-1.7b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--channels", default="ipc,nccl,nixl,volume")
    p.add_argument("--nccl-domain", default="fabric")
    p.add_argument("--volume", required=True)
    p.add_argument("--node", default="gpu-host")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--no-verify", action="store_true")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    source = RandomSource(gpu_models.trainer_table(args.model), device)
    channels = tuple(Channel.parse(c) for c in args.channels.split(",") if c)
    config = JobConfig(args.job, channels, timeout_s=300, transfer_timeout_s=args.timeout, nccl_domain=args.nccl_domain)
    publisher = Publisher(
        source,
        CoordinatorClient(args.coordinator, insecure=True),
        job=args.job,
        channels_=channels,
        host="127.0.0.1",
        node=args.node,
        device=args.device,
        checkpoint_dir=args.volume,
        config=config,
        timeout_s=args.timeout,
        version_timeout_s=300,
        verify=not args.no_verify,
    )
    print(json.dumps({"ready": True, "tensors": len(source.tensors), "bytes": source.table().total_bytes}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        source.fill(command["seed"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        report = publisher.publish(command["step"])
        wall = time.perf_counter() - t0
        assert report is not None
        if command.get("durable", True):
            publisher.wait_durable()
        sent = {s.name: digests.digest(t) for s, t in zip(source.table(), source.tensors, strict=True)}
        out = {**report.to_json(), "wall": wall, "digests": sent, "durable_errors": publisher.durable_errors}
        print(json.dumps(out), flush=True)
    publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
