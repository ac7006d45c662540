"""Pieces landed by ``weightsync_inference.landing`` against vLLM's own reload: ``python -m
tests.integration.landing_check``.

In a process of its own (vLLM keeps process-wide state), for a tiny model of ``--arch`` and every worker of a
replica of each ``--tp`` size: build the worker's model on the CPU, load checkpoint A and post-process it as an
engine does; record the worker's layout; plan a 2-rank FSDP2 trainer (``Shard(0)``) to it, so its needs are cut
at the trainer's shard boundaries as on the wire; then reload checkpoint B twice: once by landing the plan's
pieces for this worker (in a shuffled order, in groups, every other group written into the boxes ``place`` gives,
as a link that copies regions itself writes them) inside vLLM's layerwise reload, once through vLLM's
loader with every full tensor. ``--whole`` hands that module's tensors to the loader whole instead of as boxes
(what a layout does for a loader a box cannot describe). Writes JSON to ``--out``: per size, per worker, the
parameters whose landed values differ from the loader's, those A left unchanged, and bytes landed against the
layout's need.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="qwen2")
    p.add_argument("--tp", type=int, nargs="+", required=True)
    p.add_argument("--whole", default="", help="a module whose tensors go whole to vLLM's loader")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {str(tp): [check(args.arch, tp, rank, args.whole) for rank in range(tp)] for tp in args.tp}
    Path(args.out).write_text(json.dumps(out))


def check(arch: str, tp: int, rank: int, whole: str) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from tests.integration.loader_check import checkpoint
    from weightsync.sharding.fills import Fill
    from weightsync.tensors import TensorTable
    from weightsync_inference import offline_layouts, recording
    from weightsync_inference.landing import Landing
    from weightsync_trainer import naming

    config, first = checkpoint(arch, Path(tempfile.mkdtemp(prefix="landing-check-")))
    table = TensorTable.build([[(n, "bfloat16", tuple(first[n].shape)) for n in g] for g in naming.layer_groups(first)])
    torch.manual_seed(1)
    second = {n: torch.randn_like(t.float()).to(t.dtype) for n, t in first.items()}
    meta, meta_config = offline_layouts.worker_model(config, tp, rank)
    with set_current_vllm_config(meta_config):
        layout = _whole(recording.record(meta, table, rank), table, whole)
    model, vllm_config = offline_layouts.worker_model(config, tp, rank, device="cpu")
    regions = _plan(table, layout)

    def snapshot() -> dict[str, Any]:
        return {n: t.detach().clone() for n, t in model.named_parameters()}

    with set_current_vllm_config(vllm_config), torch.no_grad():
        model.load_weights(first.items())
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
        before = snapshot()
        initialize_layerwise_reload(model)
        landing = Landing(model, layout, table)
        pieces = [
            (Fill(r.tensor, r.source, r.param, r.dest), second[table.tensors[r.tensor].name][_slices(r.source)])
            for r in regions
        ]
        random.Random(rank).shuffle(pieces)
        placed = 0
        for i in range(0, len(pieces), 7):
            if i % 2:  # as a link that copies regions itself writes them: into the places the landing gives
                for fill, data in pieces[i : i + 7]:
                    into = landing.place(fill)
                    if into is None:
                        landing.land([(fill, data)])
                        continue
                    into.copy_(data)
                    landing.landed(fill)
                    placed += 1
            else:
                landing.land(pieces[i : i + 7])
        landing.finish()
        finalize_layerwise_reload(model, vllm_config.model_config)
        landed = snapshot()
        initialize_layerwise_reload(model)
        model.load_weights(second.items())
        finalize_layerwise_reload(model, vllm_config.model_config)
        loaded = snapshot()
    return {
        "differ": [n for n in loaded if not torch.equal(landed[n], loaded[n])],
        "unchanged": [n for n in loaded if torch.equal(before[n], landed[n]) and before[n].numel() > 1],
        "nbytes": landing.nbytes,
        "needed": layout.bytes_needed(table),
        "pieces": len(pieces),
        "placed": placed,
        "whole": sorted({table.tensors[f.tensor].name for f in layout.fills if f.param < 0}),
    }


def _whole(layout: Any, table: Any, module: str) -> Any:
    """``layout`` with every tensor feeding ``module`` handed whole to the loader (its parameters left unfilled)."""
    from weightsync.sharding.boxes import Box
    from weightsync.sharding.fills import WHOLE, Fill, WorkerLayout

    if not module:
        return layout
    mine = {i for i, p in enumerate(layout.params) if p.name.rpartition(".")[0] == module}
    tensors = sorted({f.tensor for f in layout.fills if f.param in mine})
    assert tensors, f"no fill lands in module {module!r}"
    kept = tuple(f for f in layout.fills if f.param not in mine)
    entire = tuple(
        Fill(t, Box.whole(table.tensors[t].shape), WHOLE, Box.whole(table.tensors[t].shape)) for t in tensors
    )
    return WorkerLayout(layout.rank, layout.params, kept + entire, f"{module}: handed whole by the check")


def _plan(table: Any, layout: Any) -> Any:
    """This worker's regions when a 2-rank FSDP2 trainer (every tensor ``Shard(0)``) sends to its replica."""
    from weightsync.sharding.fills import EngineLayout, WorkerLayout
    from weightsync.sharding.plans import Member, plan
    from weightsync.sharding.shards import Mesh, Placement, TrainerLayout

    trainer = TrainerLayout(table, 2, (Mesh((2,), (0, 1)),), tuple(Placement(0, (0,)) for _ in table))
    # the plan wants a replica's workers 0..n-1: this worker alone, as worker 0
    alone = WorkerLayout(0, layout.params, layout.fills, layout.why_whole)
    replica = plan(trainer, [Member("r", EngineLayout(table.layout_digest(), (alone,)))]).replica("r")
    assert replica.sharded, replica.gathered
    return replica.regions


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


if __name__ == "__main__":
    main()
