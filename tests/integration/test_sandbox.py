"""`weightsync sandbox` end to end, as the README runs it: a verified report, on both CPU channels, for dense and
mixture-of-experts models, from a model folder without tokenizer files, and a JSON report when it fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import support

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _sandbox(*args: str) -> tuple[int, dict[str, object], str]:
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli.main", "sandbox", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return out.returncode, json.loads(out.stdout), out.stderr  # stdout holds the JSON alone; vLLM logs to stderr


ALL = os.environ.get("WEIGHTSYNC_SERVING") == "all"
FULL = pytest.mark.skipif(not ALL, reason="a longer sandbox run: make serving (WEIGHTSYNC_SERVING=all)")


@pytest.mark.parametrize(
    ("preset", "channel"),
    [("tiny-qwen2", "cpu"), pytest.param("tiny-mixtral", "cpu", marks=FULL)],
)
def test_sandbox_prints_a_verified_report(preset: str, channel: str) -> None:
    code, report, stderr = _sandbox("--preset", preset, "--channel", channel)
    assert code == 0, stderr[-3000:]
    assert report["channel"] == channel and report["verified"] is True, report
    assert report["digests_verified"] and report["generation_changed"] and not report["mismatches"]
    assert report["bytes"] > 0 and report["total_seconds"] > 0


@FULL
def test_sandbox_needs_no_tokenizer_files(tmp_path: Path) -> None:
    """Prompts are token ids: a folder with the weights and the config alone syncs and verifies. The second MoE
    layout (Qwen2-MoE) over the volume, in the same run: one vLLM start fewer for CI."""
    folder = tmp_path / "weights-only"
    shutil.copytree(support.tiny_model("tiny-qwen2-moe"), folder, ignore=shutil.ignore_patterns("tokenizer*"))
    code, report, stderr = _sandbox("--model", str(folder), "--channel", "volume")
    assert code == 0 and report["verified"] is True, (report, stderr[-3000:])
    assert report["channel"] == "volume" and report["digests_verified"] and report["generation_changed"], report


def test_a_failed_sandbox_still_prints_its_json_report() -> None:
    code, report, _ = _sandbox("--channel", "nccl")
    assert code == 1 and report["verified"] is False
    assert "channel 'nccl' moves GPU tensors" in str(report["error"])
