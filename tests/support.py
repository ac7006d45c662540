"""Shared helpers for the unit and integration tiers: tiny models, trainers, references."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

PROMPTS = [[1, 5, 7, 9], [1, 42, 17, 300, 12]]
TOKENS = 6
LOGPROB_TOLERANCE = 0.1
CONTAINER_VLLM_ARGS = ["--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.06",
                       "--max-model-len", "256", "--seed", "0"]  # fmt: skip
"""An RLJob's ``vllmArgs`` for the CPU images' replicas on this machine (the tiny model, a small share of memory)."""

IMAGES_ENV = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync")) / "images" / "cpu.env"
IMAGES = os.environ.get("WEIGHTSYNC_IMAGES", "")
needs_images = pytest.mark.skipif(
    IMAGES not in ("1", "all"),
    reason="container test: set WEIGHTSYNC_IMAGES=1 (`make test` builds the images, then runs these; "
    "`make container-tests` runs all of them with WEIGHTSYNC_IMAGES=all)",
)
"""The container tests (each image as a container, the chart on the real node) run only when asked for: they need
the images and the real node built (``make images``, ``make node-tools``), root, and podman."""
all_images = pytest.mark.skipif(
    IMAGES != "all", reason="a longer container test: make container-tests (WEIGHTSYNC_IMAGES=all)"
)
"""A container test that ``make test`` leaves to ``make container-tests``: what the chart's e2e on the real node
(tests/e2e/test_containers.py, in ``make test``) covers too, at minutes of CI's hour."""


def built_images() -> dict[str, str]:
    """The CPU images `make images` built (images/build.sh writes their names to ``IMAGES_ENV``)."""
    if not IMAGES_ENV.exists():
        pytest.fail(f"WEIGHTSYNC_IMAGES=1 but there is no {IMAGES_ENV}: run `make images` first")
    return dict(line.split("=", 1) for line in IMAGES_ENV.read_text().splitlines() if "=" in line)


def tiny_model(preset: str = "tiny-qwen2") -> Path:
    from weightsync_trainer import tiny_models

    return tiny_models.generate(preset)


def hf_trainer(folder: Path, seed: int = 0, lr: float = 1e-2, steps: int = 1) -> torch.nn.Module:
    """The HF model in fp32 after ``steps`` real optimizer steps (a fresh delta per seed)."""
    import transformers

    from weightsync_trainer import reference

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for i in range(steps):
        reference.train_step(model, opt, model.config.vocab_size, seed=seed * 100 + i)
    return model


def assert_generates_like(engine: Any, model: torch.nn.Module) -> None:
    """The engine's greedy continuation is what transformers predicts for the model's weights."""
    from weightsync_trainer import reference

    result = reference.agreement(model, PROMPTS, engine.greedy(PROMPTS, TOKENS), LOGPROB_TOLERANCE)
    assert result.ok, "\n".join(result.mismatches)


def env_without_proxies() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
