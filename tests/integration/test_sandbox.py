"""`weightsync sandbox` end to end, as the README runs it: a verified report, on both CPU channels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("channel", ["cpu", "volume"])
def test_sandbox_prints_a_verified_report(channel: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weightsync.cli.main", "sandbox", "--channel", channel, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)  # stdout holds the JSON document alone; vLLM's logs went to stderr
    assert report["channel"] == channel and report["verified"] is True
    assert report["digests_verified"] and report["generation_changed"] and not report["mismatches"]
    assert report["bytes"] > 0 and report["total_seconds"] > 0
