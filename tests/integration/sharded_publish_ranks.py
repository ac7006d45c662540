"""A gloo FSDP2 rank publishing through ``Publisher``: ``python -m tests.integration.sharded_publish_ranks``.

``RANK`` and ``WORLD_SIZE`` come from the environment; each rank runs on a host of its own (``--master`` is
rank 0's address, ``--host`` this rank's: its CPU stream listens there). The rank shards the tiny Qwen2 model
with FSDP2 and, for each of ``--steps``, takes a real optimizer step and publishes it (collective); rank 0 talks
to the coordinator at ``--coordinator`` (TLS with ``--ca``, the bearer token from ``$WEIGHTSYNC_TOKEN``) and,
before each publish, writes the gathered weights it publishes to ``--out/reference-<step>`` (config.json +
model.safetensors: what the replica must generate like). Rank 0 writes its reports to ``--out/rank0.json``.
``--checkpoint DIR``: the job's checkpoint volume; every rank writes its own shards of each version there.

``--flip R``: rank R's region sends corrupt the first byte of their first message on the way (the wire is
wrapped, as in ``region_ranks``: a flipped bit that TCP lets through cannot be caused for real). ``--die R``: rank
R kills itself (SIGKILL) once its first region message (of 4 KiB) has left, inside its sends to the first replica,
and its part in the gather is done; ``--die-in-gather R``: inside the gather, once its first group is gathered.
A publish that raises on rank 0 is written to its reports as ``{"error": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any


class Flipping:
    """A region group as one rank sees it: its first send leaves with its first byte flipped."""

    def __init__(self, pg: Any) -> None:
        self.pg, self.sends = pg, 0

    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        self.sends += 1
        if self.sends == 1:
            tensors = [tensors[0].clone()]
            tensors[0][0] ^= 0x10
        return self.pg.send(tensors, dst, tag)


GATHERED = threading.Event()
"""Set once this rank has taken its part in the publish's gather (the gathered replicas' stream needs no more of it)."""


class Dying(Flipping):
    """A region group as one rank sees it: the rank's process is killed once its first send has left and its part in
    the gather is done (a death inside the gather breaks rank 0's stream to the gathered replica too, which tears it:
    another fault, whose recovery at TP=2 vLLM's executor does not allow, docs/sharded.md)."""

    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        self.pg.send(tensors, dst, tag).wait()
        GATHERED.wait(60)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from tests import support
    from tests.integration import layout_ranks
    from weightsync import jobconfig
    from weightsync.channels import regions
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.coordinator.tls import TlsConfig
    from weightsync.vocabulary import Channel
    from weightsync_trainer import phases, reference
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--ca", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--steps", type=int, nargs="+", required=True)
    p.add_argument("--flip", type=int, default=-1)
    p.add_argument("--die", type=int, default=-1)
    p.add_argument("--die-in-gather", type=int, default=-1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint", default="", help="the checkpoint volume (every rank writes its shards there)")
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=world)
    if rank == args.flip:
        send = regions.send
        regions.send = lambda pg, *a, **kw: send(Flipping(pg), *a, **kw)  # type: ignore[assignment]
    if rank == args.die_in_gather:

        def dying(source: Any) -> None:  # once the first group is gathered: rank 0 is streaming it
            for _ in source.groups():
                os.kill(os.getpid(), signal.SIGKILL)

        phases.take_part = dying  # type: ignore[assignment]
    if rank == args.die:
        take_part = phases.take_part

        def gathered(source: Any) -> None:
            take_part(source)
            GATHERED.set()

        phases.take_part = gathered  # type: ignore[assignment]
        send = regions.send
        # in buckets of 4 KiB, so that the rank dies inside its sends to the first replica, not between replicas
        regions.send = lambda pg, *a, **kw: send(Dying(pg), *a, **{**kw, "bucket": 4096})  # type: ignore[assignment]
    torch.manual_seed(0)
    model = support.hf_trainer(Path(args.model), seed=0, steps=0)
    layout_ranks._shard(model, "fsdp", world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    source = ModuleSource(model)
    client = None
    if rank == 0:
        tls = TlsConfig(ca_file=args.ca)
        client = CoordinatorClient(args.coordinator, token=os.environ["WEIGHTSYNC_TOKEN"], tls=tls, timeout_s=30)
    verdict_s = 2 * args.timeout  # the version's timeout must exceed the transfer's
    # NCCL too (over gloo: WEIGHTSYNC_NCCL_TRANSPORT=gloo) and NIXL (host memory: WEIGHTSYNC_NIXL_MEMORY=host, else
    # not offered) for the replicas of make sharded that declare only them
    channels = (Channel.CPU, Channel.NCCL, Channel.NIXL, *((Channel.VOLUME,) if args.checkpoint else ()))
    config = jobconfig.JobConfig(
        "job", channels, transfer_timeout_s=args.timeout, timeout_s=verdict_s, nccl_domain="sharded"
    )
    publisher = Publisher(
        source,
        client,
        job="job",
        rank=rank,
        channels_=channels,
        host=args.host,
        checkpoint_dir=args.checkpoint or None,
        config=config,
        timeout_s=args.timeout,
        version_timeout_s=verdict_s,
    )
    assert publisher.regions is not None, "a 2-rank FSDP2 trainer sends regions"
    published: list[dict[str, Any]] = []
    for step in args.steps:
        reference.train_step(model, opt, model.config.vocab_size, seed=7 * step)
        full: dict[str, torch.Tensor] = {}
        for specs, tensors in zip(source.table().groups(), source.groups(), strict=True):  # collective: every rank
            full.update({s.name: t.contiguous() for s, t in zip(specs, tensors, strict=True)})
        if rank == 0:
            folder = Path(args.out, f"reference-{step}")
            folder.mkdir(parents=True)
            save_file(full, str(folder / "model.safetensors"))
            shutil.copy(Path(args.model, "config.json"), folder / "config.json")
        try:
            report = publisher.publish(step)
        except Exception as e:
            if args.die < 0 and args.die_in_gather < 0:
                raise
            published.append({"error": f"{type(e).__name__}: {e}"})
            break
        if report is not None:
            published.append(report.to_json())
    publisher.close()
    if rank == 0:
        Path(args.out, "rank0.json").write_text(json.dumps(published))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
