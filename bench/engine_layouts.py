"""Engine layouts of real model sizes, recorded on the CPU without weights or GPUs.

For each worker of a tensor-parallel (and expert-parallel) replica, vLLM's own model
class is built from the model's config on the meta device
(``weightsync_inference.offline_layouts``) and ``weightsync_inference.recording``
runs its ``load_weights`` against recording tensors named like the checkpoint: what
a live worker records (same loaders, same recorder); only the construction differs.
Layouts are cached under ``$WEIGHTSYNC_CACHE/layouts``.

The trainer's table is the checkpoint's tensor names and shapes, in the published
order (one decoder layer per group), from the model's config.

    python bench/engine_layouts.py qwen3-8b --tp 2     # record and print each worker's bytes
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from weightsync.sharding.fills import EngineLayout, WorkerLayout
from weightsync.tensors import TensorTable

QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "rms_norm_eps": 1e-6}
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-tiny": {**QWEN3, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
                   "tie_word_embeddings": True},
    "qwen3-1.7b": {**QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 151936,
                   "tie_word_embeddings": True},
    "qwen3-8b": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 151936,
                 "tie_word_embeddings": False},
    "qwen3-235b-a22b": {**QWEN3, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                        "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                        "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
                        "tie_word_embeddings": False},
    "kimi-k2": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
                "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
                "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                "v_head_dim": 128, "vocab_size": 163840, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
                "scoring_func": "sigmoid", "routed_scaling_factor": 2.827, "norm_topk_prob": True,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}  # fmt: skip
CACHE = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync")) / "layouts"


def checkpoint_table(model: str, dtype: str = "bfloat16") -> TensorTable:
    """The checkpoint's tensors (Hugging Face names and shapes), one decoder layer per group."""
    c = CONFIGS[model]
    h, vocab = c["hidden_size"], c["vocab_size"]
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[("model.embed_tokens.weight", dtype, (vocab, h))]]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        group = [(p + n, dtype, s) for n, s in _attention(c)]
        group += [(p + "input_layernorm.weight", dtype, (h,)), (p + "post_attention_layernorm.weight", dtype, (h,))]
        group += [(p + n, dtype, s) for n, s in _mlp(c, i)]
        groups.append(group)
    groups.append([("model.norm.weight", dtype, (h,))])
    if not c["tie_word_embeddings"]:
        groups[-1].append(("lm_head.weight", dtype, (vocab, h)))
    return TensorTable.build(groups)


def _attention(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if c["model_type"] == "deepseek_v3":  # multi-head latent attention
        nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q_rank, kv_rank = c["q_lora_rank"], c["kv_lora_rank"]
        return [
            ("self_attn.q_a_proj.weight", (q_rank, h)),
            ("self_attn.q_a_layernorm.weight", (q_rank,)),
            ("self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank)),
            ("self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, h)),
            ("self_attn.kv_a_layernorm.weight", (kv_rank,)),
            ("self_attn.kv_b_proj.weight", (heads * (nope + v), kv_rank)),
            ("self_attn.o_proj.weight", (h, heads * v)),
        ]
    hd, kv = c["head_dim"], c["num_key_value_heads"]
    return [
        ("self_attn.q_proj.weight", (heads * hd, h)),
        ("self_attn.k_proj.weight", (kv * hd, h)),
        ("self_attn.v_proj.weight", (kv * hd, h)),
        ("self_attn.o_proj.weight", (h, heads * hd)),
        ("self_attn.q_norm.weight", (hd,)),
        ("self_attn.k_norm.weight", (hd,)),
    ]


def _mlp(c: dict[str, Any], layer: int) -> list[tuple[str, tuple[int, ...]]]:
    h = c["hidden_size"]

    def dense(prefix: str, inter: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(f"{prefix}gate_proj.weight", (inter, h)), (f"{prefix}up_proj.weight", (inter, h)),
                (f"{prefix}down_proj.weight", (h, inter))]  # fmt: skip

    experts = c.get("num_experts") or c.get("n_routed_experts")
    if not experts or layer < c.get("first_k_dense_replace", 0):
        return dense("mlp.", c["intermediate_size"])
    out = [("mlp.gate.weight", (experts, h))]
    if c["model_type"] == "deepseek_v3":
        out.append(("mlp.gate.e_score_correction_bias", (experts,)))
        out += dense("mlp.shared_experts.", c["moe_intermediate_size"] * c["n_shared_experts"])
    for e in range(experts):
        out += dense(f"mlp.experts.{e}.", c["moe_intermediate_size"])
    return out


def engine_layout(model: str, tp: int, expert_parallel: bool = False) -> EngineLayout:
    """The layout of a replica of ``tp`` workers (experts spread over them with ``expert_parallel``), cached."""
    from weightsync_inference import offline_layouts

    table = checkpoint_table(model)
    key = hashlib.sha256(json.dumps([CONFIGS[model], tp, expert_parallel, table.layout_digest()]).encode())
    path = CACHE / f"{model}-tp{tp}{'-ep' if expert_parallel else ''}-{key.hexdigest()[:12]}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return EngineLayout(data["table_digest"], tuple(WorkerLayout.from_dict(w) for w in data["workers"]))
    layout = offline_layouts.engine_layout(CONFIGS[model], table, tp, expert_parallel)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"table_digest": layout.table_digest, "workers": [w.to_dict() for w in layout.workers]}))
    return layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", choices=sorted(CONFIGS))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", action="store_true", help="expert parallel over the tensor-parallel workers")
    args = p.parse_args()
    table = checkpoint_table(args.model)
    start = time.perf_counter()
    layout = engine_layout(args.model, args.tp, args.ep)
    took = time.perf_counter() - start
    what = f"{args.model} tp={args.tp}{' ep' if args.ep else ''}"
    print(f"{what}: {len(table)} tensors, {table.total_bytes / 1e9:.2f} GB, recorded in {took:.1f} s", file=sys.stderr)
    for w in layout.workers:
        whole = sum(1 for f in w.fills if f.param < 0)
        print(f"  worker {w.rank}: {len(w.fills)} fills ({whole} whole), {w.bytes_needed(table) / 1e9:.3f} GB")
        if w.why_whole:
            print(f"    whole: {w.why_whole[:300]}")


if __name__ == "__main__":
    main()
