"""The framework integrations as their users run them: TRL, Atropos, vLLM's trainer-side API, verl.

Each test runs an example of ``examples/integrations/`` on the trainer host of a multi-host fleet
(``frameworks_fleet``: coordinator, vLLM CPU replicas behind one OpenAI URL, each process in its
own network namespace) with real frameworks at their pinned versions, and checks what the issue
asks of it: every step publishes a version, every sample says which version generated it, every
replica serves the trainer's final weights (its greedy tokens through its own proxy equal
transformers' on the saved final state), and the reward rises only with syncing on.

``make test`` runs the representative set, TRL's GRPOTrainer and Atropos, on the smallest fleet
that crosses hosts (one replica; CI's 2 cores pay for every vLLM server). ``make frameworks``
(``WEIGHTSYNC_FRAMEWORKS=all``) runs every test on two replicas on two channels: those two, vLLM's
factory, AsyncGRPOTrainer, the rise-vs-flat comparison for both TRL trainers and Atropos, and verl,
which lives in a virtualenv of its own (verl 0.9.1 pins transformers below what vLLM 0.32 needs),
where also a framework outside its range is refused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration import frameworks_fleet
from tests.integration.frameworks_fleet import EXAMPLES, ROOT, FrameworkFleet
from tests.integration.test_extras import CACHE, COMPLETE, _locked

pytestmark = [pytest.mark.integration, pytest.mark.timeout(3600)]
ALL = os.environ.get("WEIGHTSYNC_FRAMEWORKS") == "all"
FULL = pytest.mark.skipif(not ALL, reason="a longer framework run: make frameworks (WEIGHTSYNC_FRAMEWORKS=all)")
VERL_PINS = ("torch==2.13.0", "trl==0.27.0")
"""The verl virtualenv's torch is the test environment's (uv links it from its cache); trl 0.27.0 (verl's own pin)
is a TRL outside the integration's range, for the refusal test."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrameworkFleet]:
    """One fleet for the module: two replicas on two channels for ``make frameworks``, else the smallest."""
    replicas = frameworks_fleet.REPLICAS if ALL else frameworks_fleet.SMALL
    with frameworks_fleet.running(tmp_path_factory.mktemp("frameworks"), replicas) as f:
        yield f


def _quarters(rewards: list[float]) -> tuple[float, float]:
    q = max(1, len(rewards) // 4)
    return statistics.fmean(rewards[:q]), statistics.fmean(rewards[-q:])


def _rises_only_with_sync(what: str, rising: list[float], flat: list[float]) -> None:
    """The reward's last quarter is clearly above its first with syncing, and above the last quarter without; without,
    it stays where it started (the thresholds every framework's comparison shares)."""
    first, last = _quarters(rising)
    flat_first, flat_last = _quarters(flat)
    print(f"{what}: reward with sync {first:.3f} -> {last:.3f}; without {flat_first:.3f} -> {flat_last:.3f}")
    assert last > first + 0.15 and last > flat_last + 0.15, (rising, flat)
    assert abs(flat_last - flat_first) < 0.1, flat


# ---- TRL -------------------------------------------------------------------------------------------------------------


def test_trl_grpo_trainer_publishes_every_step_and_its_samples_carry_the_version(fleet: FrameworkFleet) -> None:
    report, final = fleet.example("trl_grpo.py", "--steps", "3")
    steps = report["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    published = [s["published"] for s in steps]
    assert all(published) and published == sorted(set(published)), published
    for s in steps:  # a version per step, made READY before generating: every sample came from exactly it
        assert set(s["served"]) == {str(s["published"])} and len(s["served"]) == 32 and s["off_policy"] == 0, s
    assert report["reward_funcs_saw"] == [s["served"] for s in steps]  # TRL handed them to the reward functions
    assert report["final_version"] > published[-1]
    fleet.serves(final, report["final_version"])


@FULL
def test_trl_grpo_reward_rises_with_sync_and_stays_flat_without(fleet: FrameworkFleet) -> None:
    start = fleet.reset_weights()  # the baseline samples the initial policy, whatever ran before
    flat, _ = fleet.example("trl_grpo.py", "--no-sync", name="trl-grpo-no-sync")
    # never published: every sample came from the initial weights, none provably from the trainer's current ones
    assert all(
        set(s["served"]) == {str(start)} and s["published"] is None and s["off_policy"] == 32 for s in flat["steps"]
    )
    rising, final = fleet.example("trl_grpo.py", name="trl-grpo-sync")
    _rises_only_with_sync("trl.GRPOTrainer", rising["rewards"], flat["rewards"])
    fleet.serves(final, rising["final_version"])


@FULL
def test_trl_async_grpo_trainer_publishes_every_sync_and_logs_served_versions(fleet: FrameworkFleet) -> None:
    report, final = fleet.example("trl_async_grpo.py", "--steps", "6", timeout_s=2400)
    published = report["published"]
    assert len(published) == 7 and all(published) and published == sorted(set(published)), published  # start + 6
    lows, highs = report["served_min"], report["served_max"]
    assert len(lows) == 6 and None not in lows and None not in highs, report
    # every trained sample came from a version this run published, never a newer one than the trainer had sent
    assert all(published[0] <= lo <= hi <= published[-1] for lo, hi in zip(lows, highs, strict=True)), report
    assert highs[-1] > highs[0], report  # samples follow the versions as they are published
    fleet.serves(final, report["final_version"])


@FULL
def test_trl_async_grpo_reward_rises_with_sync_and_stays_flat_without(fleet: FrameworkFleet) -> None:
    start = fleet.reset_weights()
    flat, _ = fleet.example("trl_async_grpo.py", "--no-sync", name="trl-async-grpo-no-sync", timeout_s=2400)
    assert not any(flat["published"]) and flat["final_version"] == 0, flat  # every sync drained, none published
    assert set(flat["served_min"]) | set(flat["served_max"]) == {start}, flat  # every sample: the initial weights
    rising, final = fleet.example("trl_async_grpo.py", name="trl-async-grpo-sync", timeout_s=2400)
    assert all(rising["published"]), rising
    _rises_only_with_sync("trl.AsyncGRPOTrainer", rising["rewards"], flat["rewards"])
    fleet.serves(final, rising["final_version"])


# ---- Atropos ---------------------------------------------------------------------------------------------------------


def test_atropos_trainer_publishes_instead_of_restarting_and_batches_carry_versions(fleet: FrameworkFleet) -> None:
    steps = 3
    with fleet.atropos(steps) as url:
        report, final = fleet.example("atropos_trainer.py", "--steps", str(steps), "--atropos-url", url)
    records = report["steps"]
    versions = [r["version"] for r in records]
    assert len(records) == steps and all(versions) and versions == sorted(set(versions)), records
    for r in records:  # samples generated before this step's version: by the initial publish or a later one
        served = [int(v.split(",")[-1]) for v in r["served"]]
        assert r["served"] and all(served) and max(served) < r["version"], r
    fleet.serves(final, report["final_version"])


@FULL
def test_atropos_reward_rises_with_sync_and_stays_flat_without(fleet: FrameworkFleet) -> None:
    steps = 16
    start = fleet.reset_weights()
    with fleet.atropos(steps) as url:
        flat, _ = fleet.example(
            "atropos_trainer.py", "--steps", str(steps), "--atropos-url", url, "--no-sync", name="atropos-no-sync"
        )
    # never published: every sample came from the initial weights, none provably from the trainer's current ones
    assert all(r["version"] == 0 and set(r["served"]) == {str(start)} and r["off_policy"] == 32 for r in flat["steps"])
    with fleet.atropos(steps) as url:
        rising, final = fleet.example(
            "atropos_trainer.py", "--steps", str(steps), "--atropos-url", url, name="atropos-sync"
        )
    assert all(r["version"] for r in rising["steps"]), rising["steps"]
    _rises_only_with_sync("atropos", rising["rewards"], flat["rewards"])
    fleet.serves(final, rising["final_version"])


# ---- vLLM's trainer-side API -----------------------------------------------------------------------------------------


@FULL
def test_vllms_trainer_factory_builds_weightsync_by_name_and_its_versions_reach_the_replicas(
    fleet: FrameworkFleet,
) -> None:
    report, final = fleet.example("vllm_trainer.py", "--steps", "2")
    assert report["engine"] == "WeightsyncTrainerEngine"
    versions = [r["version"] for r in report["rounds"]]
    assert all(r["state"] == "READY" for r in report["rounds"]) and versions == sorted(set(versions)), report
    fleet.serves(final, report["final_version"])


# ---- verl, in a virtualenv of its own --------------------------------------------------------------------------------


def _verl_python() -> str:
    """A virtualenv with weightsync[trainer,verl] (editable, from this tree) and the pins above, cached per
    pyproject.toml and tree; packages are hard links into uv's cache, so a second one costs no copy of torch."""
    # keyed by this tree's path too: the install is editable, so a virtualenv made from another checkout (a removed
    # worktree) would import that checkout's code, or nothing
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + str(ROOT).encode()).hexdigest()[:12]
    root = CACHE / f"verl-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with _locked(CACHE / f"verl-{key}.lock"):
        if not (root / COMPLETE).exists():
            shutil.rmtree(root, ignore_errors=True)
            uv = [sys.executable, "-m", "uv"]
            subprocess.run([*uv, "venv", "--quiet", "--python", "3.11", str(root)], check=True, timeout=600)
            python = str(root / "bin" / "python")
            install = ["pip", "install", "--quiet", "--python", python, "-e", f"{ROOT}[trainer,verl]", *VERL_PINS]
            env = {**os.environ, "UV_LINK_MODE": "hardlink"}
            subprocess.run([*uv, *install], check=True, timeout=1800, env=env)
            (root / COMPLETE).write_text(f"weightsync[trainer,verl] for pyproject.toml {key}\n")
    return str(root / "bin" / "python")


@FULL
def test_verl_drives_the_weightsync_checkpoint_engine_in_its_order(fleet: FrameworkFleet) -> None:
    report, final = fleet.example("verl_engine.py", "--steps", "2", python=_verl_python())
    assert report["engine"] == "WeightsyncCheckpointEngine"
    rounds: list[dict[str, Any]] = report["rounds"]
    versions = [int(r["weightsync/version"]) for r in rounds]
    assert all(r["weightsync/ready"] == 1.0 for r in rounds) and versions == sorted(set(versions)), rounds
    fleet.serves(final, report["final_version"])


@FULL
@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("trl_grpo.py", "weightsync's TRL integration supports trl >=1.16.0,<1.17; installed: 0.27.0"),
        (
            "atropos_trainer.py",
            "weightsync's Atropos integration needs atroposlib >=0.4.0,<0.5, which is not installed",
        ),
    ],
)
def test_a_framework_outside_its_range_or_missing_is_refused_with_the_fix(script: str, message: str) -> None:
    done = subprocess.run(
        [_verl_python(), str(EXAMPLES / script)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "pip install 'weightsync[" in done.stderr
