"""Parameter sets for the GPU benchmark: trainer tables, engine layouts and their direct plans.

Shapes are the real ones (Qwen3-1.7B, Qwen3-8B); values are random. The trainer
holds Hugging Face names (q/k/v, gate/up apart), grouped one decoder layer per
group. The engine layout is what vLLM's Qwen3ForCausalLM holds at tensor-parallel
size 1 (fused qkv_proj and gate_up_proj, everything else one to one); the direct plan
is ``weightsync.channels.placement.direct_plan`` over the two, kept to whole modules
(``placement.whole_modules``) as the engine keeps it, written to
``bench/data/<model>.plan.json`` where vLLM runs (``python bench/gpu_models.py``)
and read on the GPU host, which has no vLLM.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from weightsync.channels import placement
from weightsync.tensors import TensorTable

MODELS = {
    # hidden, intermediate, layers, vocab, head_dim, heads, kv_heads, tied embeddings
    "qwen3-1.7b": (2048, 6144, 28, 151936, 128, 16, 8, True),
    "qwen3-8b": (4096, 12288, 36, 151936, 128, 32, 8, False),
    "qwen3-tiny": (256, 512, 2, 512, 64, 4, 2, True),  # the CPU tests' in-place check (tests/integration)
}
DATA = Path(__file__).parent / "data"


def trainer_table(model: str, dtype: str = "bfloat16") -> TensorTable:
    h, inter, layers, vocab, hd, nh, nkv, tied = MODELS[model]
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[("model.embed_tokens.weight", dtype, (vocab, h))]]
    for i in range(layers):
        p = f"model.layers.{i}."
        groups.append(
            [
                (p + "self_attn.q_proj.weight", dtype, (nh * hd, h)),
                (p + "self_attn.k_proj.weight", dtype, (nkv * hd, h)),
                (p + "self_attn.v_proj.weight", dtype, (nkv * hd, h)),
                (p + "self_attn.o_proj.weight", dtype, (h, nh * hd)),
                (p + "self_attn.q_norm.weight", dtype, (hd,)),
                (p + "self_attn.k_norm.weight", dtype, (hd,)),
                (p + "mlp.gate_proj.weight", dtype, (inter, h)),
                (p + "mlp.up_proj.weight", dtype, (inter, h)),
                (p + "mlp.down_proj.weight", dtype, (h, inter)),
                (p + "input_layernorm.weight", dtype, (h,)),
                (p + "post_attention_layernorm.weight", dtype, (h,)),
            ]
        )
    groups.append([("model.norm.weight", dtype, (h,))] + ([] if tied else [("lm_head.weight", dtype, (vocab, h))]))
    return TensorTable.build(groups)


def engine_layout(model: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """vLLM's parameter layout for the model (fused qkv/gate_up), bf16, tensor-parallel size 1."""
    h, inter, _, _, hd, nh, nkv, _ = MODELS[model]
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for spec in trainer_table(model):
        name = spec.name
        for part, (fused, _) in placement.FUSED_LLAMA_QWEN.items():
            if part + "." in name:
                name = name.replace(part + ".", fused + ".")
                shape = ((nh + 2 * nkv) * hd, h) if fused == ".qkv_proj" else (2 * inter, h)
                layout[name] = ("bfloat16", shape)
                break
        else:
            layout[name] = (spec.dtype, spec.shape)
    return layout


def load_plan(model: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], placement.Plan]:
    raw = json.loads((DATA / f"{model}.plan.json").read_text())
    layout = {k: (v[0], tuple(v[1])) for k, v in raw["layout"].items()}
    return layout, placement.plan_from_json(raw["plan"])


def main() -> None:
    DATA.mkdir(exist_ok=True)
    for model in MODELS:
        layout = engine_layout(model)
        # what the engine writes in place: the direct plan, whole modules only
        plan = placement.whole_modules(placement.direct_plan(trainer_table(model), layout), layout)
        out = {
            "model": model,
            "layout": {k: [d, list(s)] for k, (d, s) in layout.items()},
            "plan": placement.plan_to_json(plan),
        }
        (DATA / f"{model}.plan.json").write_text(json.dumps(out, indent=0))
        print(
            f"{model}: {len(layout)} engine parameters, {len(plan)} of {len(trainer_table(model))} tensors direct",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
