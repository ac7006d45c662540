"""The embedded demo end to end: real coordinator, two real vLLM replicas with agents and proxies, a GRPO trainer.

With syncing the reward rises (weights reach the replicas); without it, it stays flat. The
sync run also kills the coordinator (SIGKILL) after step 3's publish and one replica midway,
and checks that the fleet restarted the coordinator, trainer and agents rode through it, and
the replica came back and caught up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
# The staged switch has its own fleet tests in make test (test_all_or_nothing_fleet, test_served_engine), and the
# control run without sync its own in make frameworks (TRL's reward flat without sync): both demo runs are among
# the longer serving runs (CI's hour).
SERVING = os.environ.get("WEIGHTSYNC_SERVING") == "all"
STAGED = pytest.mark.skipif(not SERVING, reason="the staged demo: make serving (WEIGHTSYNC_SERVING=all)")


def _demo(tmp_path: Path, *flags: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "weightsync.cli.main", "demo", "--json", "--workdir", str(tmp_path), *flags]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.timeout(1300)
@pytest.mark.parametrize("mode", ["in-place", pytest.param("staged", marks=STAGED)])
def test_reward_rises_with_sync_through_a_coordinator_crash_and_a_killed_replica_catches_up(
    tmp_path: Path, mode: str
) -> None:
    result = _demo(tmp_path, "--kill-coordinator-at", "3", "--sync-mode", mode)
    assert result["reward_gain"] >= 0.2, result["rewards"]
    assert result["coordinator_starts"] == 2
    states = [s["state"] for s in result["steps"]]
    # the publish right after the restart may find the agents not registered again yet (planned for no replica:
    # FAILED); every other one is READY, and version numbers never went back
    assert states[:4] == ["READY"] * 4 and states[4:].count("READY") >= len(states) - 5, states
    versions = [s["version"] for s in result["steps"] if s["version"]]
    assert versions == sorted(set(versions)), versions
    assert "timed_out" not in result["catch_up"], result["catch_up"]
    newest = result["catch_up"]["newest_durable_ready"]
    assert newest == result["steps"][-1]["version"]
    assert result["catch_up"]["served"] == {"replica-0": newest, "replica-1": newest}
    killed_at = len(result["steps"]) // 2
    assert result["steps"][killed_at]["replicas_sampled"] == ["replica-0"]
    # where the time went: the trainer's wait by phase (which add up to at most the whole), the replicas' phases
    phases = result["publish_phases_p50"]
    assert {"open", "joined", "stream", "verdict", "release", "total"} <= phases.keys(), phases
    ready = [s["sync_phases"] for s in result["steps"] if s["state"] == "READY"]
    assert all(sum(v for k, v in p.items() if k != "total") <= p["total"] for p in ready), ready
    # every sample says which weights made it; with a sync each step nearly all are on-policy (the exceptions:
    # the step after a publish the coordinator's crash failed, a restarted replica sampled before it caught up)
    assert all(label.replace(",", "").isdigit() for s in result["steps"] for label in s["made_by"]), result["steps"]
    assert result["off_policy_samples"] <= result["samples"] // 4, [s["made_by"] for s in result["steps"]]
    replicas = result["sync_latency_by_phase"]
    assert {"pause/cpu", "transfer/cpu", "load/cpu", "resume/cpu", "total/cpu"} <= replicas.keys(), replicas


@pytest.mark.timeout(1300)
@pytest.mark.skipif(not SERVING, reason="the demo without sync: make serving (WEIGHTSYNC_SERVING=all)")
def test_reward_stays_flat_without_sync(tmp_path: Path) -> None:
    result = _demo(tmp_path, "--no-sync")
    assert abs(result["reward_gain"]) < 0.05, result["rewards"]
    # the replicas serve the initial weights throughout: on-policy for the first step only
    assert all(s["made_by"] == {"0": s["samples"]} for s in result["steps"]), [s["made_by"] for s in result["steps"]]
    assert result["off_policy_samples"] == result["samples"] - result["steps"][0]["samples"]
