"""One rank of a real gloo trainer that reads its layout: ``python -m tests.integration.layout_ranks``.

``RANK`` and ``WORLD_SIZE`` come from the environment. The rank shards a tiny model (``--model``; a real
optimizer step first) and a small odd-shaped ``extra`` module beside it, reads the trainer's layout
(``weightsync_trainer.layouts``), and checks it against what the gathered path publishes of every tensor: the
box the layout gives this rank must hold exactly what this rank sends from (``local_shards``: its local shard,
or for an expert transformers fuses into one parameter, the expert's box cut from it). It writes
what it found as JSON to ``--out/rank<N>.json`` (nothing pickled).

Modes: ``fsdp`` (FSDP2 on a 1-D mesh of every rank), ``fsdp-tp`` (a 2 x 2 mesh: tensor parallel
column/row-wise on the attention and MLP projections and on ``extra``, FSDP2 over it). ``extra``'s 5 rows
divide by no mesh: uneven chunks, and on 4 ranks an empty one.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def _shard(model: Any, mode: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh2["tp"], plan)
    parallelize_module(model, mesh2["tp"], {"extra.0": ColwiseParallel(), "extra.1": RowwiseParallel()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh2["dp"])
    fully_shard(model, mesh=mesh2["dp"])


def main() -> None:
    import torch
    import torch.distributed as dist

    from tests import support
    from weightsync.sharding import shards
    from weightsync.sharding.boxes import Box
    from weightsync_trainer import reference
    from weightsync_trainer.layouts import agreed, local_shards, trainer_layout
    from weightsync_trainer.sources import ModuleSource

    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fsdp", "fsdp-tp"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = support.hf_trainer(Path(args.model), seed=0, steps=0)
    model.extra = torch.nn.Sequential(torch.nn.Linear(6, 5, bias=False), torch.nn.Linear(5, 6, bias=False))
    _shard(model, args.mode, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference.train_step(model, opt, model.config.vocab_size, seed=7)  # the layout of a trained model

    source = ModuleSource(model)
    layout = trainer_layout(source)
    full: dict[str, Any] = {}
    for specs, tensors in zip(layout.table.groups(), source.groups(), strict=True):  # collective: every rank
        full.update({s.name: t for s, t in zip(specs, tensors, strict=True)})
    shards_held = local_shards(source, layout, rank) if not layout.unsupported else []
    checked, held, placements = 0, 0, set()
    for t, spec in enumerate(layout.table):
        if layout.unsupported:
            continue
        box, local = layout.shard(t, rank), shards_held[t]
        if box is None:
            assert local is None or local.numel() == 0, f"{spec.name}: rank {rank} holds {local.shape}, layout none"
        else:
            assert local is not None, f"{spec.name}: the layout gives rank {rank} {box}, it holds nothing"
            region = full[spec.name][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))]
            assert torch.equal(region, local), f"{spec.name}: rank {rank}'s shard is not the layout's {box}"
            held += 1
        cells = layout.holders(t)
        assert sum(b.numel for b, _ in cells) == full[spec.name].numel() == Box.whole(spec.shape).numel
        placements.add(str(layout.placements[t]).split(" ", 2)[-1])
        checked += 1
    sent_from = sum(1 for t in shards_held if t is not None)
    ours = agreed(layout)  # collective: every rank
    odd = agreed(shards.TrainerLayout(layout.table, world, unsupported=f"rank {rank} sees it otherwise"))
    report = {
        "rank": rank,
        "agreed": ours.digest() == layout.digest(),
        "disagreed": odd.unsupported,
        "local_shards": sent_from,
        "digest": layout.digest(),
        "unsupported": layout.unsupported,
        "checked": checked,
        "held": held,
        "tensors": len(layout.table),
        "meshes": [[list(m.shape), list(m.ranks)] for m in layout.meshes],
        "placements": sorted(placements),
        "extra_rows": [
            b.lengths[0] for b, _ in layout.holders(layout.table.tensors.index(layout.table["extra.0.weight"]))
        ]
        if not layout.unsupported
        else [],
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
