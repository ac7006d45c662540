"""verl's checkpoint-engine calls, in verl's order, with ``backend=weightsync``: what verl does per sync.

verl's ``CheckpointEngineManager.update_weights`` runs, for every sync: ``prepare`` on every actor
and rollout worker, ``build_topology`` once, ``init_process_group`` on each, the actors'
``send_weights(per_tensor_generator, global_steps)`` while the rollouts' ``receive_weights``
feeds their server adapter, then ``finalize``. verl itself owns its vLLM servers inside Ray and
needs GPUs; this script makes the same calls on real verl classes (the registry, verl's
``import_external_libs`` loading ``custom_backend_module``) from two actor ranks that train an
FSDP2-sharded model (gloo, CPU) and hand over verl's kind of generator (``state_dict()`` with each
DTensor's ``full_tensor()``, a collective), and one rollout worker. The replicas are weightsync's.

    weightsync run -- python examples/integrations/verl_engine.py   # in a virtualenv with weightsync[trainer,verl]
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

import task

ACTORS = 2
BACKEND, MODULE = "weightsync", "weightsync_trainer.integrations.verl"
BUCKET = 64 << 20


def gather_json(obj: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Every rank's ``obj``, as JSON bytes over gloo (Ray carries verl's metadata; nothing is pickled here)."""
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode()
    sized = torch.zeros(4096, dtype=torch.uint8)
    sized[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.zeros_like(sized) for _ in range(world)]
    dist.all_gather(out, sized)
    return [json.loads(bytes(t.numpy()).rstrip(b"\0")) for t in out]


def per_tensor_param(model: Any) -> Iterator[tuple[str, Any]]:
    """verl's FSDP engine's ``get_per_tensor_param``: the state dict, each DTensor gathered as it is reached."""
    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


async def sync(actor: Any, rollout: Any, rank: int, step: int, model: Any) -> dict[str, float]:
    """One ``CheckpointEngineManager.update_weights`` round as this actor rank (and on rank 0 the rollout) sees it."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    # verl's driver collects every worker's metadata; the rollout worker lives in rank 0's process here
    actors = gather_json(actor.prepare(), ACTORS)
    rollouts = [rollout.prepare()] if rollout is not None else [{}]
    cls = CheckpointEngineRegistry.get(BACKEND)
    actor_kwargs, rollout_kwargs = cls.build_topology(ACTORS, 1, actors + rollouts)
    actor.init_process_group(**{k: v[rank] for k, v in actor_kwargs.items()})
    if rollout is not None:
        rollout.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})

    async def receive() -> int:
        return len([w async for w in rollout.receive_weights(global_steps=step)])

    sent = actor.send_weights(per_tensor_param(model), global_steps=step)
    results = await asyncio.gather(sent, receive()) if rollout else [await sent]
    actor.finalize()
    if rollout is not None:
        rollout.finalize()
        assert results[1] == 0, "the rollout side yields nothing: each replica's weightsync agent loads the version"
    metrics: dict[str, float] = results[0]
    return metrics


def rank_main(rank: int, args: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from weightsync_trainer import reference

    dist.init_process_group("gloo", rank=rank, world_size=ACTORS)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(task.model_dir(), dtype=torch.float32)
    mesh = init_device_mesh("cpu", (ACTORS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    import_external_libs(MODULE)  # verl's checkpoint_engine.custom_backend_module
    actor = CheckpointEngineRegistry.new(BACKEND, is_master=rank == 0, bucket_size=BUCKET)
    rollout = CheckpointEngineRegistry.new(BACKEND, bucket_size=BUCKET) if rank == 0 else None
    rounds = []
    for step in range(1, args.steps + 1):
        loss = reference.train_step(model, optimizer, model.config.vocab_size, seed=step)
        metrics = asyncio.run(sync(actor, rollout, rank, step, model)) if not args.no_sync else {}
        rounds.append({"step": step, "loss": loss, **metrics})
    full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in model.state_dict().items()}
    if rank == 0:
        if args.save:
            plain = AutoModelForCausalLM.from_pretrained(task.model_dir(), dtype=torch.float32)
            plain.load_state_dict(full)
            plain.save_pretrained(args.save)
        task.write_report(
            args.report,
            {
                "framework": "verl.CheckpointEngine",
                "engine": type(actor).__name__,
                "rounds": rounds,
                "final_version": int(rounds[-1].get("weightsync/version", 0)) if rounds else None,
            },
        )
    actor.close()
    dist.destroy_process_group()


def main() -> None:
    args = task.arguments(__doc__.splitlines()[0]).parse_args()
    from weightsync_trainer.integrations import frameworks

    try:
        frameworks.require("verl")
    except frameworks.UnsupportedFramework as e:
        task.fail_clearly(e)
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    mp.spawn(rank_main, args=(args,), nprocs=ACTORS, join=True)


if __name__ == "__main__":
    main()
