"""Trainer processes the integration tests start for real: ``python -m tests.integration.procs CMD ...``.

They talk to the test only through the channel under test and files (no pickled
arguments): a CPU-stream sender that can die mid-stream, and an FSDP2 trainer on two
gloo ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def stream(args: argparse.Namespace) -> None:
    """Publish one version over the CPU stream; with --die-after N, exit hard after N groups."""
    from tests import support
    from weightsync.channels.cpu import CpuSender
    from weightsync.vocabulary import Channel
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    model = support.hf_trainer(Path(args.model), seed=args.seed)
    sender = CpuSender(world_size=2, port=args.port, timeout_s=60, bucket_bytes=args.bucket_bytes)
    sender.connect()
    source = ModuleSource(model)
    groups = source.groups
    if args.die_after is not None:

        def dying() -> object:
            for i, group in enumerate(groups()):
                if i == args.die_after:
                    os._exit(17)  # a trainer killed mid-publish: no cleanup, sockets just close
                yield group

        source.groups = dying  # type: ignore[method-assign]
    publisher = Publisher(source, [sender])
    publisher.publish(args.version, args.version, [publisher.ticket(args.version, args.version, Channel.CPU)])
    sender.close()


def receive(args: argparse.Namespace) -> None:
    """One CPU-stream receiver; with --die-after N it exits hard after N groups (a replica that crashes)."""
    from weightsync.channels.base import UpdateTicket
    from weightsync.channels.cpu import CpuReceiver
    from weightsync.tensors import TensorTable
    from weightsync.vocabulary import Channel

    receiver = CpuReceiver(args.address, 2, 1, timeout_s=30, bucket_bytes=args.bucket_bytes, group_id=args.group_id)
    ticket = UpdateTicket(args.version, Channel.CPU, TensorTable(()))
    for i, _ in enumerate(receiver.receive(ticket)):
        if i + 1 == args.die_after:
            os._exit(17)
    Path(args.out).write_text(json.dumps(receiver.verified))


def fsdp(args: argparse.Namespace) -> None:
    """Two gloo ranks train an FSDP2-sharded model one step and publish it to the volume."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests import support
    from weightsync.channels import digests
    from weightsync.channels.volume import VolumeSender
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    model = support.hf_trainer(Path(args.model), seed=0, steps=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from weightsync_trainer import reference

    reference.train_step(model, opt, model.config.vocab_size, seed=7)
    senders = [VolumeSender(args.volume)] if rank == 0 else []
    Publisher(ModuleSource(model), senders, rank=rank).publish(args.version, step=1)
    # An independent view of the same weights, gathered by torch's own checkpoint API.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        expected = {k: digests.digest(v.to(torch.bfloat16)) for k, v in full.items() if k != "lm_head.weight"}
        Path(args.expected).write_text(json.dumps(expected))
        from safetensors.torch import save_file

        weights = {k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"}
        save_file(weights, str(Path(args.expected).with_suffix(".safetensors")))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stream")
    s.add_argument("--model", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--version", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--bucket-bytes", type=int, default=256 << 10)
    s.add_argument("--die-after", type=int, default=None)
    r = sub.add_parser("receive")
    r.add_argument("--address", required=True)
    r.add_argument("--group-id", required=True)
    r.add_argument("--version", type=int, required=True)
    r.add_argument("--bucket-bytes", type=int, default=1 << 20)
    r.add_argument("--die-after", type=int, default=None)
    r.add_argument("--out", required=True)
    f = sub.add_parser("fsdp")
    f.add_argument("--model", required=True)
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--volume", required=True)
    f.add_argument("--version", type=int, required=True)
    f.add_argument("--expected", required=True)
    args = p.parse_args()
    {"stream": stream, "receive": receive, "fsdp": fsdp}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
