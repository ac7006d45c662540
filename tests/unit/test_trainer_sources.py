from __future__ import annotations

import pytest
import torch

from weightsync.errors import PermanentError
from weightsync_trainer import naming, tiny_models
from weightsync_trainer.sources import ModuleSource

pytestmark = pytest.mark.unit


def test_checkpoint_names_strip_only_wrappers() -> None:
    assert (
        naming.to_checkpoint_name("_orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    )
    assert (
        naming.to_checkpoint_name("base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight")
        == "model.layers.1.self_attn.q_proj.weight"
    )
    assert naming.is_skipped("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert not naming.is_skipped("model.norm.weight")


def test_layer_groups_keep_embeddings_first_and_head_last() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.1.a",
        "model.layers.0.a",
        "model.layers.0.b",
        "model.norm.weight",
    ]
    assert naming.layer_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.a", "model.layers.0.b"],
        ["model.layers.1.a"],
        ["model.norm.weight"],
    ]


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied: must travel once
        self.register_buffer("counter", torch.zeros(1))  # buffers never travel


def test_module_source_casts_dedups_ties_and_skips_buffers() -> None:
    src = ModuleSource(_Tied())
    table = src.table()
    assert [s.name for s in table] == [
        "embed.weight",
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ]
    assert {s.dtype for s in table} == {"bfloat16"}
    groups = list(src.groups())
    assert [len(g) for g in groups] == [len(g) for g in table.groups()]
    assert all(t.dtype == torch.bfloat16 for g in groups for t in g)


def test_fixture_generator_rejects_impossible_configs() -> None:
    with pytest.raises(PermanentError, match="hidden_size 250 is not divisible by num_heads 4"):
        tiny_models.ModelPreset("qwen2", 250, 2, 4, 2, 512, 512)
    with pytest.raises(PermanentError, match=r"head_dim 16 .* must be a multiple of 32"):
        tiny_models.ModelPreset("qwen2", 64, 2, 4, 2, 512, 512)
    with pytest.raises(PermanentError, match="arch 'gpt2' is not supported"):
        tiny_models.ModelPreset("gpt2", 256, 2, 4, 2, 512, 512)
    with pytest.raises(PermanentError, match="num_layers must be positive"):
        tiny_models.ModelPreset("llama", 256, 0, 4, 2, 512, 512)
    with pytest.raises(PermanentError, match="unknown model preset 'huge'"):
        tiny_models.generate("huge")


def test_preset_key_changes_with_config() -> None:
    a = tiny_models.PRESETS["tiny-qwen2"]
    assert a.key() == tiny_models.PRESETS["tiny-qwen2"].key()
    assert a.key() != tiny_models.PRESETS["tiny-llama"].key()
    assert a.key() == "6611c069b10a"  # dense presets keep their cached folders across the MoE fields' addition


def test_moe_presets_need_experts() -> None:
    with pytest.raises(PermanentError, match=r"arch 'mixtral' with num_experts 0: .* need experts"):
        tiny_models.ModelPreset("mixtral", 256, 2, 4, 2, 256, 512)
    with pytest.raises(PermanentError, match="experts_per_token 5 must be between 1 and num_experts 4"):
        tiny_models.ModelPreset("mixtral", 256, 2, 4, 2, 256, 512, num_experts=4, experts_per_token=5)


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-mixtral"])
def test_moe_models_publish_the_checkpoints_names_and_tensors(preset: str) -> None:
    """transformers holds the experts fused (``mlp.experts.gate_up_proj``) and Mixtral's ``block_sparse_moe`` as
    ``mlp``; the source publishes what ``save_pretrained`` wrote, name for name, shape for shape, byte for byte."""
    import transformers
    from safetensors.torch import load_file

    folder = tiny_models.generate(preset)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n, _ in model.named_parameters())
    checkpoint = load_file(str(folder / "model.safetensors"))
    source = ModuleSource(model)
    table = source.table()
    assert {s.name: s.shape for s in table} == {n: tuple(t.shape) for n, t in checkpoint.items()}
    sent = {
        s.name: t
        for specs, group in zip(table.groups(), source.groups(), strict=True)
        for s, t in zip(specs, group, strict=True)
    }
    assert all(torch.equal(sent[n], t) for n, t in checkpoint.items())
    assert len(table.groups()) == 2 + model.config.num_hidden_layers  # one group per layer, as for dense models


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-mixtral"])
def test_each_published_expert_is_a_box_of_its_fused_parameter(preset: str) -> None:
    """What the sharded path sends an expert from: its box of the fused parameter (``naming.View``), probed through
    transformers' own conversion, cuts exactly the tensor the gathered path publishes."""
    model = _pretrained(preset)
    source = ModuleSource(model)
    table = source.table()
    sent = {
        s.name: t
        for specs, g in zip(table.groups(), source.groups(), strict=True)
        for s, t in zip(specs, g, strict=True)
    }
    experts = [s for s in table if ".experts." in s.name]
    assert len(experts) == 3 * model.config.num_hidden_layers * tiny_models.PRESETS[preset].num_experts
    for spec in experts:
        view = source.view(spec.name)
        assert view is not None and view.param.endswith(("gate_up_proj", "down_proj")), (spec.name, view)
        assert torch.equal(view.cut(source.parameter(view.param).detach(), (0, 0, 0), spec.shape), sent[spec.name])


def test_coordinates_that_are_no_box_give_no_view() -> None:
    rows, columns = torch.arange(4).view(4, 1).expand(4, 3), torch.arange(3).view(1, 3).expand(4, 3)
    assert naming._box("p", [rows.int(), columns.int()]) == naming.View("p", (0, 0), (0, 1))
    assert naming._box("p", [rows.t().int(), columns.t().int()]) == naming.View("p", (0, 0), (1, 0))  # transposed
    assert naming._box("p", [rows.flip(0).int(), columns.int()]) is None  # reversed
    assert naming._box("p", [(rows * 2).int(), columns.int()]) is None  # every other row


def test_dense_models_need_no_conversion() -> None:
    assert naming.Conversion.of(_pretrained("tiny-qwen2")) is None


def _pretrained(preset: str) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_models.generate(preset), dtype=torch.bfloat16)
