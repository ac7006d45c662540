"""Small random-initialised HF models of real architectures, made here, never downloaded.

The tests, the sandbox and the demo need real checkpoints (safetensors weights, a
config vLLM recognises, a tokenizer) without a model hub. ``generate`` builds one
from a named preset, trains a byte-level BPE tokenizer on a generated corpus with
the ``tokenizers`` library, and caches the folder under
``$WEIGHTSYNC_CACHE/models/<preset>-<config hash>`` so a second call is free and a
changed preset gets a new folder. Heads are 64 wide: vLLM's CPU attention kernel
rejects head_dim 16.

Dense (Qwen2, Llama) and mixture-of-experts (Qwen2-MoE, Mixtral) architectures: the
MoE ones are where a trainer's names differ from the checkpoint's (transformers 5 holds
each layer's experts fused, ``mlp.experts.gate_up_proj``, and saves them per expert,
``experts.N.gate_proj.weight``; Mixtral's ``block_sparse_moe`` is ``mlp`` in memory), and
where vLLM merges checkpoint tensors into one parameter per layer (``experts.w13_weight``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from weightsync.errors import PermanentError

GENERATOR_VERSION = 1


@dataclass(frozen=True)
class ModelPreset:
    arch: str  # "qwen2" | "llama" | "qwen2_moe" | "mixtral"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    # Wider than HF's 0.02 so the random model has clear next-token preferences: greedy
    # decoding is then stable across kernels (vLLM's vs transformers') instead of
    # flipping between near-tied logits.
    initializer_range: float = 0.08
    seed: int = 0
    # mixture of experts (0: a dense model); Mixtral's experts are ``intermediate_size`` wide, Qwen2-MoE's
    # ``moe_intermediate_size``, beside one shared expert ``shared_expert_intermediate_size`` wide
    num_experts: int = 0
    experts_per_token: int = 2
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.arch not in _ARCHS:
            raise PermanentError(f"arch {self.arch!r} is not supported; choose one of {', '.join(_ARCHS)}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise PermanentError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise PermanentError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}: "
                "head_dim must divide the hidden size"
            )
        if self.num_heads % self.num_kv_heads:
            raise PermanentError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 32:
            raise PermanentError(
                f"head_dim {self.head_dim} (hidden_size/num_heads) must be a multiple of 32; "
                "vLLM's CPU attention kernel rejects smaller heads"
            )
        if self.vocab_size < 300:
            raise PermanentError(f"vocab_size {self.vocab_size} must be >= 300 (256 byte tokens + merges + specials)")
        moe = self.arch in _MOE_ARCHS
        if moe != (self.num_experts > 0):
            raise PermanentError(
                f"arch {self.arch!r} with num_experts {self.num_experts}: {', '.join(_MOE_ARCHS)} need experts "
                "(num_experts >= 2), the dense architectures none"
            )
        if moe and not 1 <= self.experts_per_token <= self.num_experts:
            raise PermanentError(
                f"experts_per_token {self.experts_per_token} must be between 1 and num_experts {self.num_experts}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def key(self) -> str:
        fields = asdict(self)
        if not self.num_experts:  # a dense preset hashes as it did before MoE fields existed: its cache stays valid
            fields = {k: v for k, v in fields.items() if k not in _MOE_FIELDS}
        blob = json.dumps({"preset": fields, "generator": GENERATOR_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def hf_config(self) -> dict[str, Any]:
        common = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "initializer_range": self.initializer_range,
            "rope_theta": 10000.0,
            "torch_dtype": "bfloat16",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        }
        return {**_ARCHS[self.arch], **common, **self._moe_config()}

    def _moe_config(self) -> dict[str, Any]:
        if self.arch == "qwen2_moe":
            return {
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.experts_per_token,
                "moe_intermediate_size": self.moe_intermediate_size or self.intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size or self.intermediate_size,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "norm_topk_prob": False,
            }
        if self.arch == "mixtral":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token}
        return {}


_MOE_FIELDS = ("num_experts", "experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size")
_MOE_ARCHS = ("qwen2_moe", "mixtral")
_ARCHS: dict[str, dict[str, Any]] = {
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "head_dim": None},
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    "mixtral": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_act": "silu"},
}

PRESETS: dict[str, ModelPreset] = {
    # seconds to load; the tests' and the demo's model
    "tiny-qwen2": ModelPreset("qwen2", 256, 2, 4, 2, 512, 512),
    "tiny-llama": ModelPreset("llama", 256, 2, 4, 2, 512, 512, tie_word_embeddings=False),
    # mixtures of experts: 4 experts, 2 per token (Qwen2-MoE with its shared expert; Mixtral untied)
    "tiny-qwen2-moe": ModelPreset(
        "qwen2_moe",
        256,
        2,
        4,
        2,
        512,
        512,
        num_experts=4,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=256,
    ),
    "tiny-mixtral": ModelPreset("mixtral", 256, 2, 4, 2, 256, 512, tie_word_embeddings=False, num_experts=4),
    # ~0.4B parameters, for benchmarks
    "small-qwen2": ModelPreset("qwen2", 1024, 24, 16, 8, 4096, 32000),
    "small-llama": ModelPreset("llama", 1024, 24, 16, 8, 4096, 32000, tie_word_embeddings=False),
}


def cache_root() -> Path:
    return Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync"))


def _corpus(n: int = 4000) -> list[str]:
    words = ["policy", "reward", "token", "weight", "sync", "trainer", "replica", "version"]
    words += ["step", "gradient", "value", "the", "a", "of", "and", "to"]
    out = []
    for i in range(n):
        out.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 5)) + f" {i % 97}")
    return out


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "<pad>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 2048,
            }
        )
    )


def generate(preset: str | ModelPreset, root: Path | None = None, force: bool = False) -> Path:
    """Return the folder of the preset's model, building it on first use."""
    p = PRESETS[preset] if isinstance(preset, str) and preset in PRESETS else preset
    if isinstance(p, str):
        raise PermanentError(f"unknown model preset {p!r}; presets: {', '.join(PRESETS)}")
    name = next((k for k, v in PRESETS.items() if v == p), p.arch)
    folder = (root or cache_root() / "models") / f"{name}-{p.key()}"
    if folder.joinpath("model.safetensors").is_file() and not force:
        return folder

    import torch
    import transformers

    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in p.hf_config().items() if v is not None})
    torch.manual_seed(p.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    _write_tokenizer(tmp, p.vocab_size)
    (tmp / "weightsync-preset.json").write_text(json.dumps({"preset": name, **asdict(p)}, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder
