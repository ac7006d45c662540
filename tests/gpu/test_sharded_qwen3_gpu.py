"""The sharded path on 4 GPUs with Qwen3-1.7B's real shapes and the engine layout vLLM's loaders recorded: a 2-rank
FSDP2 trainer on GPUs 0-1 sends its regions over NCCL to a TP=2 replica's workers on GPUs 2-3; every parameter box
bit-exact against the trainer's tensors, each worker received exactly the bytes its layout needs.

It drives ``bench/sharded_gpu.py`` (one process per GPU, ``regions.send``/``regions.receive``, the layouts from
``bench/data/layouts``) for one round and asserts on its JSON, never on its times. Run on the GPU host:
``bash tools/gpu-host.sh python3 -m pytest -m gpu -v tests/gpu/test_sharded_qwen3_gpu.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.test_gpu_channels import _need_gpus

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
RANKS, TP = 2, 2


def test_qwen3_regions_land_bit_exact_and_each_worker_gets_only_its_own(tmp_path: Path) -> None:
    _need_gpus(RANKS + TP)
    out = tmp_path / "run.json"
    job = ["--model", "qwen3-1.7b", "--ranks", str(RANKS), "--tp", str(TP), "--reps", "1", "--probe-mb", "64"]
    subprocess.run(
        [sys.executable, "bench/sharded_gpu.py", *job, "--json", str(out)], cwd=ROOT, check=True, timeout=600
    )
    (row,) = json.loads(out.read_text())["rows"]
    workers = [r for r in row["reports"] if r["role"] == "worker"]
    ranks = [r for r in row["reports"] if r["role"] == "trainer"]
    assert len(workers) == TP and len(ranks) == RANKS
    for w in workers:
        assert w["wrong"] == {"sharded": [], "gathered": []}, w["wrong"]
        # only its slice: what its parameters hold, less than the model (the vocabulary and the MLP halve at TP=2)
        assert 0 < w["nbytes"]["sharded"] == w["needed"] < 0.6 * row["table_bytes"], w
        assert w["nbytes"]["gathered"] == row["table_bytes"]
    assert all(r["nbytes"]["sharded"] > 0 for r in ranks)  # every rank sent from its own shard
    assert sum(r["nbytes"]["sharded"] for r in ranks) == sum(w["nbytes"]["sharded"] for w in workers)
