"""All-or-nothing fleet switches on the embedded fleet: the real coordinator, two real vLLM CPU replicas with their
agents and proxies (``LocalFleet``, staged mode, ``allOrNothing``), and the trainer's ``Publisher`` in this process.

A steady stream of greedy completions runs through both proxies the whole time. Through 20 versions every replica
stages each one and switches only on the coordinator's COMMIT; every completion that ran within one version is what
that version generates (``support.assert_attributed``). Then one replica's vLLM server is killed (its agent lives
on, so the replica stays planned and its staging fails for real): the version fails with no replica switched, the
other replica drops its stage and keeps serving the previous version (no completion names the failed one), and once
the replica is back and caught up the next version goes through on both.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from tests import support
from weightsync.cli._localfleet import LocalFleet
from weightsync.coordinator.client import CoordinatorClient
from weightsync.vocabulary import ReplicaState, SyncMode, VersionState
from weightsync_inference import proxy
from weightsync_trainer.publisher import PublishReport
from weightsync_trainer.sources import ModuleSource

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
REPLICAS = ("replica-0", "replica-1")
PROMPT = support.PROMPTS[1]
BODY = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "logprobs": 0}  # fmt: skip


@dataclass
class Load:
    """Steady greedy completions through each replica's proxy: (replica, versions header, output)."""

    fleet: LocalFleet
    made: list[tuple[str, str, support.Output]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, replica_id: str) -> None:
        with httpx.Client(trust_env=False, timeout=60) as client:
            while not self.stop.is_set():
                try:
                    r = client.post(f"{self.fleet.replicas[replica_id].url}/v1/completions", json=BODY)
                except httpx.HTTPError:
                    time.sleep(0.2)  # a replica being restarted
                    continue
                if r.status_code != 200:
                    time.sleep(0.2)
                    continue
                choice = r.json()["choices"][0]
                if choice.get("finish_reason") == "abort":
                    # the test kills replica-1's vLLM mid-request: its shutdown ends the request in flight and
                    # answers the tokens so far (OpenAI's finish_reason says so); not a whole generation to compare
                    self.aborted.append(replica_id)
                    continue
                output = (choice["token_ids"], choice["logprobs"]["token_logprobs"])
                self.made.append((replica_id, r.headers[proxy.VERSIONS_HEADER], output))


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[LocalFleet]:
    fleet = LocalFleet(tmp_path, support.tiny_model(), sync_mode=SyncMode.STAGED, all_or_nothing=True)
    try:
        fleet.start_coordinator()
        replicas = [fleet.start_replica(r) for r in REPLICAS]
        fleet.wait_healthy(replicas, timeout_s=600)
        yield fleet
    finally:
        fleet.stop()


def _greedy(url: str) -> support.Output:
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _served(client: CoordinatorClient, job: str) -> dict[str, int]:
    return {m.member_id: m.current_version for m in client.get_job(job).members if m.role.value == "replica"}


def test_replicas_switch_together_and_a_failed_stage_switches_none(fleet: LocalFleet) -> None:
    client = CoordinatorClient(fleet.coordinator_address, insecure=True, timeout_s=60.0)
    fleet.wait_registered(client, timeout_s=120)
    model = support.hf_trainer(fleet.model, seed=0, steps=0)
    base = copy.deepcopy(model)
    publisher = fleet.publisher(ModuleSource(model), timeout_s=30.0)
    generator = torch.Generator().manual_seed(0)

    def publish(step: int) -> PublishReport:
        # a new policy: every weight moves a little from the base model (a random walk would grow the logits until
        # bf16 rounding moves log-probabilities by more than the check's tolerance)
        with torch.no_grad():
            for p, b in zip(model.parameters(), base.parameters(), strict=True):
                p.copy_(b + torch.randn(p.shape, generator=generator) * 0.01)
        report = publisher.publish(step)
        assert report is not None
        return report

    load = Load(fleet)
    threads = [threading.Thread(target=load.run, args=(r,), daemon=True) for r in REPLICAS]
    for t in threads:
        t.start()
    models = {"0": base}  # vLLM's initial weights are version 0
    # what each replica generated right after a version (checked once the load stopped: it competes for the cores)
    generated: list[tuple[int, support.Output]] = []
    try:
        for step in range(20):
            report = publish(step)
            assert report.state is VersionState.READY, (step, report)
            info = client.version_info(report.version, job=fleet.job)
            assert {r.replica_id: r.state for r in info.replicas} == dict.fromkeys(REPLICAS, ReplicaState.LOADED)
            assert _served(client, fleet.job) == dict.fromkeys(REPLICAS, report.version)
            models[str(report.version)] = copy.deepcopy(model)
            generated += [(report.version, _greedy(fleet.replicas[r].url)) for r in REPLICAS]
            time.sleep(0.2)  # completions that run within this version
        serving = report.version

        # replica-1's vLLM server dies; its agent lives on, stays planned, and cannot stage what comes next
        fleet.replicas[REPLICAS[1]].procs[0].stop()
        before_fault = len(load.made)
        failed = publish(20)
        info = client.version_info(failed.version, job=fleet.job)
        assert failed.state is VersionState.FAILED, info
        assert "not committed, no replica switched it (all-or-nothing)" in info.reason, info.reason
        states = {r.replica_id: r.state for r in info.replicas}
        assert states[REPLICAS[1]] is ReplicaState.FAILED and states[REPLICAS[0]] is not ReplicaState.LOADED, states
        time.sleep(1.0)  # completions after the failed version settled
        assert _served(client, fleet.job)[REPLICAS[0]] == serving
        generated.append((serving, _greedy(fleet.replicas[REPLICAS[0]].url)))  # still the previous weights
        after_fault = [label for r, label, _ in load.made[before_fault:] if r == REPLICAS[0]]
        assert after_fault and all(label == str(serving) for label in after_fault), after_fault

        # back, caught up from the volume, and the next version goes through on both
        fleet.replicas[REPLICAS[1]].stop()
        fleet.start_replica(REPLICAS[1])
        fleet.wait_healthy([fleet.replicas[REPLICAS[1]]], timeout_s=600)
        deadline = time.monotonic() + 120
        while _served(client, fleet.job).get(REPLICAS[1]) != serving:
            assert time.monotonic() < deadline, f"{REPLICAS[1]} did not catch up to v{serving}"
            time.sleep(0.5)
        report = publish(21)
        assert report.state is VersionState.READY, client.version_info(report.version, job=fleet.job)
        assert _served(client, fleet.job) == dict.fromkeys(REPLICAS, report.version)
        models[str(report.version)] = copy.deepcopy(model)
    finally:
        load.stop.set()
        for t in threads:
            t.join(60)
        publisher.close()
        client.close()

    for version, output in generated:
        mismatches = support.disagreements(models[str(version)], [PROMPT], [output])
        assert not mismatches, f"a replica does not generate version {version}: {mismatches}"
    support.assert_attributed(models, PROMPT, [(label, output) for _, label, output in load.made], 20)
    labels = {v for _, label, _ in load.made for v in label.split(",")}
    assert str(failed.version) not in labels, "a completion names the version no replica switched in"
