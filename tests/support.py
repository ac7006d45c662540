"""Shared helpers for the unit and integration tiers: tiny models, trainers, references."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from weightsync_trainer.tiny_models import ModelPreset

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


def tiny_model(preset: str | ModelPreset = "tiny-qwen2") -> Path:
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


Output = tuple[list[int], list[float]]
"""A greedy completion: its token ids and their log-probabilities."""


def disagreements(model: torch.nn.Module, prompts: list[list[int]], outputs: list[Output]) -> list[str]:
    """How ``outputs`` (one per prompt) differ from what ``model`` generates, teacher-forced (``reference.agreement``):
    a near-tie that bf16 rounding in another batch flips is no mismatch. Empty when they agree."""
    from weightsync_trainer import reference

    return reference.agreement(model, prompts, outputs, LOGPROB_TOLERANCE).mismatches


def assert_generates_like(engine: Any, model: torch.nn.Module) -> None:
    """The engine's greedy continuation is what transformers predicts for the model's weights."""
    mismatches = disagreements(model, PROMPTS, engine.greedy(PROMPTS, TOKENS))
    assert not mismatches, "\n".join(mismatches)


def assert_attributed(
    models: Mapping[str, torch.nn.Module], prompt: list[int], made: Iterable[tuple[str, Output]], minimum: int
) -> None:
    """Completions of ``prompt`` with the proxy's versions label: each labelled with one version is what that
    version's model generates (``disagreements``); a label naming two versions names known versions in order; at least
    ``minimum`` ran within one version; and the check bites: for most versions, the version before it (in
    ``models``' order) generates something else.

    Never token for token against a reference the engine generated beside them: batches of other sizes round
    differently, and a CI run had a completion equal to transformers' output for its version while the reference
    flipped a near-tie (top-two margin 0.016)."""
    single: dict[str, list[Output]] = {}
    within = 0
    for label, output in made:
        if "," in label:
            first, last = label.split(",")
            assert int(first) < int(last) and first in models and last in models, label
            continue
        assert label in models, f"a completion names version {label}, which never loaded"
        within += 1
        outputs = single.setdefault(label, [])
        if output not in outputs:  # each distinct output once: most repeat exactly
            outputs.append(output)
    assert within >= minimum, f"only {within} completions ran within one version"
    order = list(models)
    bites = []
    for label, outputs in single.items():
        mismatches = disagreements(models[label], [prompt] * len(outputs), outputs)
        assert not mismatches, f"a completion attributed to version {label} is not what it generates: {mismatches}"
        if order.index(label) > 0:
            bites.append(bool(disagreements(models[order[order.index(label) - 1]], [prompt] * len(outputs), outputs)))
    assert sum(bites) * 2 > len(bites), f"only {sum(bites)} of {len(bites)} versions generate unlike the one before"


def env_without_proxies() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}


def stop(proc: subprocess.Popen[Any], grace_s: float) -> int:
    """SIGTERM, as an orchestrator stops a process; SIGKILL after ``grace_s``. Its exit status."""
    proc.terminate()
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)
