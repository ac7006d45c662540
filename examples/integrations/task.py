"""The task every integration example trains on: the demo's, with a verifiable reward.

A tiny random Qwen2 model (generated here, no hub) continues short text prompts; the reward
of a completion is the share of its tokens in a fixed target set (every 8th token id, 64 of
512), so a random policy scores about 0.13 and a policy that learned the pattern scores 1.
The reward can rise only if the weights the trainer learns reach the replicas that generate
the rollouts: with syncing off they keep sampling the initial policy and it stays flat.

Run an example against a fleet on this machine with ``weightsync run -- python
examples/integrations/<example>.py``; in an RLJob the operator provides the same environment.
Each example writes a JSON report (``--report``) and the trainer's final weights
(``--save``), which tests compare with what every replica serves.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

STRIDE = 8
WORDS = (
    "policy", "reward", "token", "weight", "sync", "trainer", "replica", "version",
    "step", "gradient", "value", "the", "a", "of", "and", "to",
)  # fmt: skip


def model_dir() -> Path:
    """The model the replicas serve: ``$WEIGHTSYNC_MODEL`` (``weightsync run`` sets it), else the tiny preset."""
    if os.environ.get("WEIGHTSYNC_MODEL"):
        return Path(os.environ["WEIGHTSYNC_MODEL"])
    from weightsync_trainer import tiny_models

    return tiny_models.generate("tiny-qwen2")


def targets(vocab_size: int = 512) -> frozenset[int]:
    return frozenset(range(3, vocab_size, STRIDE))


def reward_of(ids: list[int], target_set: frozenset[int] = targets()) -> float:
    return sum(t in target_set for t in ids) / len(ids) if ids else 0.0


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(n)]


def arguments(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=16, help="training steps (default 16)")
    p.add_argument("--no-sync", action="store_true", help="never publish: the replicas keep the initial weights")
    p.add_argument("--report", default=None, help="write the run's record (JSON) here")
    p.add_argument("--save", default=None, help="save the trainer's final weights here (a transformers folder)")
    p.add_argument("--seed", type=int, default=0)
    return p


def scratch_dir(prefix: str) -> str:
    """A folder for the framework's own output (these runs save nothing there), removed when the example exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def write_report(path: str | None, report: dict[str, Any]) -> None:
    text = json.dumps(report, indent=1)
    if path:
        Path(path).write_text(text)
    print(text)


def fail_clearly(error: Exception) -> None:
    """A framework missing or outside the tested range: its message, not a traceback."""
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)
