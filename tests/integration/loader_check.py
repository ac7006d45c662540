"""Recorded layouts against vLLM's loaders with real data: ``python -m tests.integration.loader_check``.

In a process of its own (vLLM keeps process-wide state), for a tiny model of ``--arch`` saved the way
transformers saves checkpoints (or the model in ``--model``), and for every worker of a replica of each
``--tp`` size (experts spread over the workers with ``--ep``): record the worker's layout on a meta model
(``offline_layouts`` + ``recording``), then build the same worker's model on the CPU with zeroed
parameters, load the real checkpoint through vLLM's own loaders, and compare every parameter with what the
layout's fills put there. The table is the checkpoint's, or ``--table`` (``TensorTable.to_dict`` JSON).
Writes JSON to ``--out``: per size, per worker, the layout and what disagreed (nothing, when it is exact).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

ARCHS: dict[str, dict[str, Any]] = {
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False},
    "qwen2_moe": {
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
    },
    "mixtral": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "tie_word_embeddings": False,
    },
}  # fmt: skip
SIZES = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 500, "rms_norm_eps": 1e-6, "hidden_act": "silu",
}  # fmt: skip
"""A vocabulary of 500 rows: vLLM pads it to a multiple of 64 per worker, so the padding is exercised."""


def checkpoint(arch: str, folder: Path) -> tuple[dict[str, Any], Any]:
    """A random tiny model of ``arch`` saved by transformers; its config and its tensors, by checkpoint name."""
    import torch
    import transformers
    from safetensors.torch import load_file

    config = {**SIZES, **ARCHS[arch]}
    hf = transformers.AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items() if k != "model_type"}
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16).save_pretrained(folder)
    return config, load_file(str(folder / "model.safetensors"))


def main() -> None:
    from safetensors.torch import load_file

    from weightsync.tensors import TensorTable
    from weightsync_trainer import naming

    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=sorted(ARCHS))
    p.add_argument("--model", help="a model folder (config.json, model.safetensors) instead of --arch")
    p.add_argument("--table", help="the table to record against (JSON); default: the checkpoint's")
    p.add_argument("--tp", type=int, nargs="+", required=True)
    p.add_argument("--ep", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.model:
        config = json.loads(Path(args.model, "config.json").read_text())
        tensors = load_file(str(Path(args.model, "model.safetensors")))
    else:
        config, tensors = checkpoint(args.arch, Path(tempfile.mkdtemp(prefix="loader-check-")))
    groups = naming.layer_groups(sorted(tensors))
    table = (
        TensorTable.from_dict(json.loads(Path(args.table).read_text()))
        if args.table
        else TensorTable.build([[(n, "bfloat16", tuple(tensors[n].shape)) for n in g] for g in groups])
    )
    out = {"table": table.to_dict()}
    for tp in args.tp:
        out[str(tp)] = check(config, table, tensors, tp, args.ep)
    Path(args.out).write_text(json.dumps(out))


def check(config: dict[str, Any], table: Any, tensors: dict[str, Any], tp: int, ep: bool) -> list[dict[str, Any]]:
    import torch
    from vllm.config import set_current_vllm_config

    from weightsync_inference import offline_layouts, recording

    report = []
    for rank in range(tp):
        meta, meta_config = offline_layouts.worker_model(config, tp, rank, ep)
        with set_current_vllm_config(meta_config):
            layout = recording.record(meta, table, rank)
        real, real_config = offline_layouts.worker_model(config, tp, rank, ep, device="cpu")
        params = dict(real.named_parameters())
        with torch.no_grad():
            for param in params.values():
                param.zero_()
            with set_current_vllm_config(real_config):
                real.load_weights((spec.name, tensors[spec.name]) for spec in table)
        expected = {p.name: torch.zeros(p.shape, dtype=params[p.name].dtype) for p in layout.params}
        for f in layout.fills:
            if f.param >= 0:
                src = tensors[table.tensors[f.tensor].name][_slices(f.source)]
                expected[layout.params[f.param].name][_slices(f.dest)] = src.reshape(f.dest.lengths)
        mismatches = [n for n, value in expected.items() if not torch.equal(params[n].detach(), value)]
        unlisted = [n for n, param in params.items() if n not in expected and bool(param.detach().abs().sum() > 0)]
        report.append({"layout": layout.to_dict(), "mismatches": mismatches, "unlisted": unlisted})
    return report


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


if __name__ == "__main__":
    main()
