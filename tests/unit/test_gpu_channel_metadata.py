"""CPU-side metadata of the GPU channels: the direct plan, IPC exports as plain data, wire checks."""

from __future__ import annotations

import json
import time

import pytest
import torch

from weightsync.channels import gpu, placement
from weightsync.channels.ipc import Export
from weightsync.errors import ModelMismatchError, PermanentError, TransferTimeoutError
from weightsync.tensors import TensorTable

pytestmark = pytest.mark.unit

H, Q, KV, FF = 64, 128, 32, 96
TABLE = TensorTable.build(
    [
        [("model.embed_tokens.weight", "bfloat16", (100, H))],
        [
            ("model.layers.0.self_attn.q_proj.weight", "bfloat16", (Q, H)),
            ("model.layers.0.self_attn.k_proj.weight", "bfloat16", (KV, H)),
            ("model.layers.0.self_attn.v_proj.weight", "bfloat16", (KV, H)),
            ("model.layers.0.mlp.gate_proj.weight", "bfloat16", (FF, H)),
            ("model.layers.0.mlp.up_proj.weight", "bfloat16", (FF, H)),
            ("model.layers.0.mlp.down_proj.weight", "bfloat16", (H, FF)),
            ("model.norm.weight", "bfloat16", (H,)),
        ],
    ]
)
LAYOUT = {
    "model.embed_tokens.weight": ("bfloat16", (100, H)),
    "model.layers.0.self_attn.qkv_proj.weight": ("bfloat16", (Q + 2 * KV, H)),
    "model.layers.0.mlp.gate_up_proj.weight": ("bfloat16", (2 * FF, H)),
    "model.layers.0.mlp.down_proj.weight": ("float32", (H, FF)),  # another dtype: the loader casts
    "model.norm.weight": ("bfloat16", (H,)),
}


def test_plan_stacks_fused_rows_in_shard_order_and_maps_the_rest_one_to_one() -> None:
    plan = placement.direct_plan(TABLE, LAYOUT)
    qkv, gate_up = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
    assert plan["model.layers.0.self_attn.q_proj.weight"] == (qkv, 0, Q)
    assert plan["model.layers.0.self_attn.k_proj.weight"] == (qkv, Q, KV)
    assert plan["model.layers.0.self_attn.v_proj.weight"] == (qkv, Q + KV, KV)
    assert plan["model.layers.0.mlp.gate_proj.weight"] == (gate_up, 0, FF)
    assert plan["model.layers.0.mlp.up_proj.weight"] == (gate_up, FF, FF)
    assert plan["model.embed_tokens.weight"] == ("model.embed_tokens.weight", 0, 100)
    assert "model.layers.0.mlp.down_proj.weight" not in plan  # dtype differs: staged, not in place


def test_plan_leaves_tensor_parallel_shards_to_the_loader() -> None:
    sharded = dict(LAYOUT)
    sharded["model.layers.0.self_attn.qkv_proj.weight"] = ("bfloat16", ((Q + 2 * KV) // 2, H))
    plan = placement.direct_plan(TABLE, sharded)
    assert not any(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for n in plan)
    assert "model.layers.0.mlp.up_proj.weight" in plan


def test_resolved_views_write_into_the_engine_parameters() -> None:
    params = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (d, s) in LAYOUT.items()}
    views = placement.resolve(placement.direct_plan(TABLE, LAYOUT), params)
    views["model.layers.0.self_attn.k_proj.weight"].fill_(1)
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv[Q : Q + KV].eq(1).all() and qkv[:Q].eq(0).all() and qkv[Q + KV :].eq(0).all()
    assert all(v.is_contiguous() for v in views.values())


def test_plan_survives_json_and_a_wrong_plan_is_refused_naming_the_tensor() -> None:
    plan = placement.direct_plan(TABLE, LAYOUT)
    assert placement.plan_from_json(json.loads(json.dumps(placement.plan_to_json(plan)))) == plan
    with pytest.raises(ModelMismatchError, match=r"'model\.norm\.weight'"):
        placement.plan_from_json({"model.norm.weight": ["model.norm.weight"]})
    with pytest.raises(ModelMismatchError, match=r"'q'.*lacks"):
        placement.resolve({"q": ("model.missing", 0, 1)}, {})
    with pytest.raises(ModelMismatchError, match=r"rows \[0, 999\)"):
        placement.resolve({"q": ("p", 0, 999)}, {"p": torch.zeros(4, 2)})


def test_vllm_qwen3_and_llama_use_the_mapping_the_plan_assumes() -> None:
    qwen3 = pytest.importorskip("vllm.model_executor.models.qwen3")
    llama = pytest.importorskip("vllm.model_executor.models.llama")
    for cls in (qwen3.Qwen3ForCausalLM, llama.LlamaForCausalLM):
        assert placement.fused_mapping(cls.__new__(cls)) == placement.FUSED_LLAMA_QWEN


def test_ipc_export_is_plain_data_and_a_malformed_one_is_refused() -> None:
    export = Export(0, "ab" * 32, 4096, 512, "cd" * 8, 3, "ef" * 32, True)
    assert Export.from_dict(json.loads(json.dumps(export.to_dict()))) == export
    with pytest.raises(PermanentError, match="malformed buffer export"):
        Export.from_dict({"device": 0})


def test_wire_casts_floats_and_refuses_a_wrong_shape_naming_the_tensor() -> None:
    spec = TABLE["model.norm.weight"]
    (wire,) = gpu.wire_group([spec], [torch.ones(H, dtype=torch.float32)], torch.device("cpu"))
    assert wire.dtype == torch.bfloat16
    with pytest.raises(PermanentError, match=r"'model.norm.weight'.*shape \[3\]"):
        gpu.check_wire(spec, torch.ones(3))


class _Polled:
    """Work that completes ``after_s`` from now, counting how often it was polled (a stand-in for CUDA work)."""

    def __init__(self, after_s: float) -> None:
        self.due, self.polls = time.monotonic() + after_s, 0

    def is_completed(self) -> bool:
        self.polls += 1
        return time.monotonic() >= self.due


def test_a_wait_beside_generation_polls_rarely_and_a_paused_one_spins() -> None:
    paused = _Polled(0.05)
    gpu.wait(paused, 5.0, "paused", lambda: None)
    with gpu.in_background():
        staged = _Polled(0.05)
        gpu.wait(staged, 5.0, "staged", lambda: None)
    assert staged.polls <= 15 < 100 < paused.polls, (staged.polls, paused.polls)  # 5 ms polls vs a spin, 0.2 ms polls
    with gpu.in_background(), pytest.raises(TransferTimeoutError, match=r"stuck did not complete within 0\.0s"):
        gpu.wait(_Polled(10.0), 0.02, "stuck", lambda: None)  # still bounded
