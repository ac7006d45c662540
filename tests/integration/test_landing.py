"""Pieces landed in a worker's parameters equal what vLLM's own loader writes (``landing_check``).

In a process of its own, for Qwen2 (tied head, q/k/v biases, a vocabulary vLLM pads) at tensor-parallel size 1
and 2: the plan's pieces of a 2-rank FSDP2 trainer, landed in shuffled groups inside vLLM's layerwise reload
(every other group written into the boxes ``Landing.place`` gives, as a CUDA IPC link copies regions itself),
leave every parameter (in the kernel form the CPU backend repacks into) equal to a reload of the same checkpoint
through vLLM's loader, and changed from the version before; one module's tensors go whole to the loader,
assembled from their pieces. Each worker lands exactly the bytes its layout needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import support

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
WHOLE = "model.layers.0.mlp.down_proj"


@pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_SHARDED") != "all",
    reason="make sharded (WEIGHTSYNC_SHARDED=all); make test lands regions in a live engine (test_sharded_engine)",
)
def test_landed_pieces_equal_vllms_loader(tmp_path: Path) -> None:
    out = tmp_path / "landing.json"
    cmd = [sys.executable, "-m", "tests.integration.landing_check", "--tp", "1", "2", "--whole", WHOLE]
    subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=support.env_without_proxies(), check=True, timeout=900)
    result = json.loads(out.read_text())
    for tp in ("1", "2"):
        assert len(result[tp]) == int(tp)
        for worker in result[tp]:
            assert worker["differ"] == [] and worker["unchanged"] == [], worker
            assert worker["nbytes"] == worker["needed"] and worker["pieces"] > 0 and worker["placed"] > 0, worker
            assert worker["whole"] == [f"{WHOLE}.weight"], worker
    halves = [w["nbytes"] for w in result["2"]]
    assert all(n < 0.6 * result["1"][0]["nbytes"] for n in halves), halves  # each TP=2 worker lands about half
