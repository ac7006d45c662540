"""A gloo FSDP2 rank writing the sharded volume: ``python -m tests.integration.sharded_volume_ranks``.

``RANK`` and ``WORLD_SIZE`` come from the environment. The rank shards the tiny Qwen2 model with FSDP2 (a real
optimizer step first), reads the trainer's layout, and writes versions with ``ShardedVolumeWriter`` under
``--root`` (``{rank}`` in it is replaced by the rank: each rank names its own mount of the shared volume).
Rank 0 also writes the gathered tensors to ``--reference`` (a model folder: config.json + model.safetensors),
what the readers are compared with. It writes what happened as JSON to ``--out/rank<N>.json``.

Modes: ``write`` (version 1 with ``--tile``, version 2 with the default tile), ``dies`` (rank 1 exits before the
write: rank 0 must fail the version after the writer's timeout), ``own-disk`` (rank 1's root is a directory
of its own, not the shared volume: every rank must fail the version naming rank 1), ``publish`` (the user's
path: a ``Publisher`` on every rank, rank 0 talking to the coordinator at ``--coordinator``, publishes two
steps; the volume copies are the sharded ones, written in the background).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from tests import support
    from tests.integration import layout_ranks
    from weightsync.channels.sharded_volume import ShardedVolumeWriter
    from weightsync.errors import PermanentError
    from weightsync_trainer import reference
    from weightsync_trainer.layouts import trainer_layout
    from weightsync_trainer.shard_copies import local_shards
    from weightsync_trainer.sources import ModuleSource

    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["write", "dies", "own-disk", "publish"], required=True)
    p.add_argument("--coordinator", default="")
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--master", default="127.0.0.1", help="rank 0's address (its host's, on separate hosts)")
    p.add_argument("--root", required=True)
    p.add_argument("--reference", required=True)
    p.add_argument("--tile", type=int, default=64)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = support.hf_trainer(Path(args.model), seed=0, steps=0)
    layout_ranks._shard(model, "fsdp", world)  # FSDP2 per layer and at the root, as the layout test shards
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference.train_step(model, opt, model.config.vocab_size, seed=7)  # the shards of a trained model

    source = ModuleSource(model)
    layout = trainer_layout(source)
    assert not layout.unsupported, layout.unsupported
    full: dict[str, torch.Tensor] = {}
    for specs, tensors in zip(layout.table.groups(), source.groups(), strict=True):  # collective: every rank
        full.update({s.name: t.contiguous() for s, t in zip(specs, tensors, strict=True)})
    if rank == 0:
        ref = Path(args.reference)
        ref.mkdir(parents=True)
        save_file(full, str(ref / "model.safetensors"))
        shutil.copy(Path(args.model, "config.json"), ref / "config.json")
    root = Path(args.root.format(rank=rank))
    if args.mode == "own-disk" and rank == 1:
        root = Path(args.out, "rank1-own-disk")
    report: dict[str, object] = {"rank": rank, "writes": []}
    if args.mode == "publish":
        report["published"] = publish(args, source, root, rank)
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()
        return
    writers = [ShardedVolumeWriter(root, timeout_s=args.timeout, tile=args.tile)]
    if args.mode == "write":
        writers.append(ShardedVolumeWriter(root, timeout_s=args.timeout))  # the default tile
    if args.mode == "dies" and rank == 1:
        Path(args.out, f"rank{rank}.json").write_text(json.dumps({**report, "died": True}))
        os._exit(0)  # before the write: rank 0 waits for it until the writer's timeout
    for version, writer in enumerate(writers, start=1):
        t0 = time.perf_counter()
        try:
            manifest = writer.write(version, 10 * version, layout, local_shards(source, layout, rank))
            assert manifest is not None
            entry: dict[str, object] = {"version": version, "files": sorted(manifest.shards), "tile": manifest.tile}
        except PermanentError as e:
            entry = {"version": version, "error": str(e)}
        entry["seconds"] = time.perf_counter() - t0
        report["writes"].append(entry)  # type: ignore[union-attr]
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    if args.mode != "dies":
        dist.destroy_process_group()


def publish(args: argparse.Namespace, source: object, root: Path, rank: int) -> list[dict[str, object]]:
    from weightsync import jobconfig
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.vocabulary import Channel
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    assert isinstance(source, ModuleSource)
    client = CoordinatorClient(args.coordinator, insecure=True, timeout_s=30) if rank == 0 else None
    # no replica here: the job's policy lets a version planned for none be READY (its copy is what late joiners load)
    config = jobconfig.JobConfig("job", (Channel.VOLUME,), transfer_timeout_s=args.timeout, ready_without_acks=True)
    publisher = Publisher(
        source,
        client,
        job="job",
        rank=rank,
        channels_=(Channel.VOLUME,),
        checkpoint_dir=root,
        config=config,
        timeout_s=args.timeout,
        version_timeout_s=args.timeout,
    )
    assert publisher.sharded is not None, "a 2-rank FSDP2 trainer writes the sharded volume"
    out = []
    for step in (5, 6):
        report = publisher.publish(step)
        publisher.wait_durable(args.timeout)
        out.append({"version": report.version, "state": report.state.value} if report else {})
    out.append({"errors": publisher.durable_errors})
    publisher.close()
    return out


if __name__ == "__main__":
    main()
