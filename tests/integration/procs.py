"""Trainer processes the integration tests start for real: ``python -m tests.integration.procs CMD ...``.

They talk to the test only through the channel under test and JSON files or arguments
(a ``Rendezvous`` as ``to_dict`` writes it; nothing pickled): a CPU-stream sender that
can die mid-stream, a receiver (CPU stream or NCCL over gloo) that can die mid-stream,
and an FSDP2 trainer on two gloo ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def write_json(path: Path, data: object) -> None:
    """Write ``data`` so a reader polling for ``path`` never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def stream(args: argparse.Namespace) -> None:
    """Publish one version over the CPU stream to one replica; with --die-after N, exit hard after N groups; with
    --stall-after N, stop for --stall-s seconds after N groups (a slow or stuck trainer), then go on.

    The trainer binds its sender on 127.0.0.1, plans one replica on it without a
    coordinator and writes that replica's rendezvous to --rendezvous-out, where the
    test picks it up to start the engine's receiver.
    """
    from tests import support
    from weightsync.channels.base import UpdateTicket, direct_rendezvous
    from weightsync.channels.cpu import CpuSender
    from weightsync.vocabulary import Channel
    from weightsync_trainer.publisher import send
    from weightsync_trainer.sources import ModuleSource

    model = support.hf_trainer(Path(args.model), seed=args.seed)
    source = ModuleSource(model)
    table = source.table()
    sender = CpuSender("127.0.0.1", timeout_s=60, bucket_bytes=args.bucket_bytes)
    rendezvous = direct_rendezvous(sender.offer(), join_timeout_s=50).with_timeout(60)  # the engine joins after
    sender.take_plan({args.replica: rendezvous})
    write_json(Path(args.rendezvous_out), rendezvous.to_dict())
    groups = source.groups
    if args.die_after is not None:

        def dying() -> Iterator[Any]:
            for i, group in enumerate(groups()):
                if i == args.die_after:
                    os._exit(17)  # a trainer killed mid-publish: no cleanup, sockets just close
                yield group

        source.groups = dying  # type: ignore[method-assign]
    elif args.stall_after is not None:

        def stalling() -> Iterator[Any]:
            for i, group in enumerate(groups()):
                if i == args.stall_after:
                    time.sleep(args.stall_s)
                yield group

        source.groups = stalling  # type: ignore[method-assign]
    ticket = UpdateTicket(args.version, Channel.CPU, table, table.layout_digest(), step=args.version, timeout_s=60)
    report = send(source, sender, ticket)
    sender.close()
    if report.failed:
        sys.exit(f"the stream lost its replica: {report.failed}")


def receive(args: argparse.Namespace) -> None:
    """One receiver of the rendezvous' channel (the CPU stream, or NCCL over gloo); with --die-after N it exits hard
    after N groups (a replica that crashes). With --go FILE it starts joining only once FILE exists (after writing
    --ready), so a test can start its processes first and count the join deadline from its plan. A receiver left
    out of its group, or cut off from its sender, writes ``{"error": ...}`` to --out and exits 3."""
    import time

    from weightsync import channels
    from weightsync.channels.base import Rendezvous, UpdateTicket, WorkerContext
    from weightsync.errors import TransferTimeoutError

    rendezvous = Rendezvous.from_dict(json.loads(args.rendezvous))
    if args.go:
        import torch

        from weightsync.channels import batched

        channels.receiver_class(rendezvous.channel)  # imported, and the digest kernels warm, before the clock runs
        batched.warm(torch.device("cpu"))
        write_json(Path(args.ready), {})
        while not Path(args.go).exists():
            time.sleep(0.01)
    try:
        receiver = channels.receiver_class(rendezvous.channel).start(rendezvous, WorkerContext())
        if args.joined:
            write_json(Path(args.joined), {"group": rendezvous.group})
        # no table: the channel carries it (the stream's header, the NCCL store), checked against the layout digest
        ticket = UpdateTicket(args.version, rendezvous.channel, layout_digest=args.layout_digest)
        for i, _ in enumerate(receiver.receive(ticket)):
            if i + 1 == args.die_after:
                os._exit(17)
    except TransferTimeoutError as e:
        write_json(Path(args.out), {"error": str(e)})
        sys.exit(3)
    write_json(Path(args.out), receiver.verified)
    receiver.close()


def fsdp(args: argparse.Namespace) -> None:
    """Two gloo ranks train an FSDP2-sharded model one step and publish it to the volume.

    Every rank calls ``send`` (the gather is collective); rank 0 writes the version.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests import support
    from weightsync.channels import digests
    from weightsync.channels.base import UpdateTicket
    from weightsync.channels.volume import VolumeSender
    from weightsync.vocabulary import Channel
    from weightsync_trainer import reference
    from weightsync_trainer.publisher import send
    from weightsync_trainer.sources import ModuleSource

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    model = support.hf_trainer(Path(args.model), seed=0, steps=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference.train_step(model, opt, model.config.vocab_size, seed=7)
    source = ModuleSource(model)
    ticket = UpdateTicket(args.version, Channel.VOLUME, source.table(), step=1)
    report = send(source, VolumeSender(args.volume), ticket, rank=rank)
    # An independent view of the same weights, gathered by torch's own checkpoint API.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        expected = {k: digests.digest(v.to(torch.bfloat16)) for k, v in full.items() if k != "lm_head.weight"}
        if report.digests != expected:
            sys.exit("rank 0's send report disagrees with torch's full state dict")
        write_json(Path(args.expected), expected)
        from safetensors.torch import save_file

        weights = {k: v.contiguous() for k, v in full.items() if k != "lm_head.weight"}
        save_file(weights, str(Path(args.expected).with_suffix(".safetensors")))
    elif report.digests or report.failed:
        sys.exit("rank 1 sent nothing, yet its report is not empty")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stream")
    s.add_argument("--model", required=True)
    s.add_argument("--rendezvous-out", required=True, help="where to write the replica's rendezvous (JSON)")
    s.add_argument("--replica", default="replica-0")
    s.add_argument("--version", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--bucket-bytes", type=int, default=256 << 10)
    s.add_argument("--die-after", type=int, default=None)
    s.add_argument("--stall-after", type=int, default=None)
    s.add_argument("--stall-s", type=float, default=0.0)
    r = sub.add_parser("receive")
    r.add_argument("--rendezvous", required=True, help="the replica's rendezvous (JSON, as Rendezvous.to_dict)")
    r.add_argument("--version", type=int, required=True)
    r.add_argument("--layout-digest", default="")
    r.add_argument("--die-after", type=int, default=None)
    r.add_argument("--out", required=True)
    r.add_argument("--joined", default="", help="a file to write once the receiver joined its group")
    r.add_argument("--ready", default="", help="with --go: a file to write once started, before joining")
    r.add_argument("--go", default="", help="join only once this file exists")
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
