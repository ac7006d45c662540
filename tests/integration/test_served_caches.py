"""What a served replica answers after a switch of weights is what the new weights compute, and it says so.

One real served vLLM (tiny Qwen2, prefix caching at vLLM's default: on; the CPU backend caches
KV per full block of 128 tokens) behind the real proxy (``served_server``, shared with
test_served_engine), driven through every sync mode x pause
mode. GRPO sends the same prompts many times per step and across steps, so each mode's test
sends one 300-token prompt twice under the serving version (the second hits its two cached
blocks), switches a new version in, and then checks that the repeated prompt hits no block from
before the switch (vLLM's own prefix-cache counters), gives exactly what a request that bypasses
the cache gives (``prompt_logprobs``: vLLM reads no cached block for it) and what transformers
computes for the new weights, and that the proxy attributes it to the new version alone.

Then an update whose trainer stalls mid-stream, longer than the 5 s the proxy once waited on
vLLM's ``/weight_info`` (which an update holds): no 504, ``/health`` unavailable while paused
and answered at once, and a completion sent during the stall served after it, attributed to
the new version.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests import support
from tests.integration import servers
from weightsync.channels.base import Rendezvous, UpdateTicket
from weightsync.coordinator.models import summarize
from weightsync.vocabulary import Channel, EngineState, PauseMode, SyncMode
from weightsync_inference import proxy, served
from weightsync_inference.http_engine import HttpEngine
from weightsync_inference.lifecycle import Replica
from weightsync_inference.staging import staging_bytes
from weightsync_trainer import reference
from weightsync_trainer.sources import ModuleSource

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
PROMPT_TOKENS = 300
"""Two full 128-token blocks of the CPU backend's prefix cache, and a partial one."""
CACHED = 256
TOKENS = 16
TOLERANCE = 0.25
"""|Δlogprob| against transformers over a 300-token prompt: bf16 rounding adds up over long prompts (0.11 seen); KV
from the old weights moved them by 4.6 on average (and no greedy token agreed)."""
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
MODES = [(sync, pause) for sync in (SyncMode.IN_PLACE, SyncMode.STAGED) for pause in PauseMode]


@dataclass
class Live:
    server: servers.Server
    root: Path
    folder: Path
    prompt: list[int]
    version: int = 0

    def publish(self, seed: int) -> tuple[UpdateTicket, torch.nn.Module, int]:
        """A new version on the volume: its ticket, the trainer's model, and the bytes its stage needs."""
        self.version += 1
        ticket, trainer, table = servers.publish(self.root, self.folder, self.version, seed)
        summary = summarize(table)
        return ticket, trainer, staging_bytes(summary.total_bytes, summary.tensor_count)

    def replica(self, pause: PauseMode = PauseMode.KEEP) -> Replica:
        """The agent's side for one update, on the board the proxy reads."""
        return Replica(HttpEngine(self.server.url, pause_mode=pause), version=self.version, board=self.server.board)


@dataclass
class Answer:
    tokens: list[int]
    logprobs: list[float]
    versions: str
    hits: float
    """Prompt tokens vLLM's prefix cache supplied for it."""


@pytest.fixture(scope="module")
def live(served_server: servers.Server, tmp_path_factory: pytest.TempPathFactory) -> Live:
    root = tmp_path_factory.mktemp("caches") / "volume"
    replica = Replica(HttpEngine(served_server.url), board=served_server.board)
    replica.adopt()
    replica.init_transfer(Rendezvous(Channel.VOLUME, root=str(root)).to_dict())
    generator = torch.Generator().manual_seed(23)
    prompt = [1, *torch.randint(3, 500, (PROMPT_TOKENS - 1,), generator=generator).tolist()]
    return Live(served_server, root, support.tiny_model(), prompt)


def _settled(url: str) -> tuple[float, float]:
    """vLLM's prefix-cache counters once they stopped moving (its stats reach /metrics shortly after the answer)."""
    last = (-1.0, -1.0)
    for _ in range(40):
        now = (servers.metric(url, HITS), servers.metric(url, QUERIES))
        if now == last:
            return now
        last = now
        time.sleep(0.25)
    raise AssertionError(f"vLLM's prefix-cache counters kept moving: {last}")


def _complete(live: Live, bypass: bool = False) -> Answer:
    """The long prompt, greedy, through the proxy; ``bypass``: with prompt log-probabilities (vLLM computes the whole
    prompt for those, reading no cached block)."""
    body: dict[str, Any] = {"prompt": live.prompt, "max_tokens": TOKENS, "temperature": 0.0, "logprobs": 0,
                            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    if bypass:
        body["prompt_logprobs"] = 1
    hits = _settled(live.server.url)[0]
    r = httpx.post(f"{live.server.proxy_url}/v1/completions", json=body, timeout=120, trust_env=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
    return Answer(choice["token_ids"], logprobs, r.headers[proxy.VERSIONS_HEADER], _settled(live.server.url)[0] - hits)


@pytest.mark.parametrize(("sync", "pause"), MODES, ids=[f"{s.value}-{p.value}" for s, p in MODES])
def test_a_switch_leaves_no_kv_computed_under_the_old_weights(live: Live, sync: SyncMode, pause: PauseMode) -> None:
    _complete(live)
    assert _complete(live).hits >= CACHED, "the repeated prompt did not hit its cached blocks: the test cannot bite"
    ticket, trainer, nbytes = live.publish(seed=40 + live.version)
    replica = live.replica(pause)
    if sync is SyncMode.STAGED:
        replica.stage(ticket, nbytes)
        replica.switch(ticket)
    else:
        replica.apply(ticket)
    assert live.server.board.get() == served.Served.one(ticket.version)

    after = _complete(live)
    assert after.hits == 0, f"{after.hits:.0f} prompt tokens came from KV cached before the switch"
    bypassed = _complete(live, bypass=True)
    assert after.tokens == bypassed.tokens, "the repeated prompt is answered unlike a request that reads no cache"
    agreement = reference.agreement(trainer, [live.prompt], [(after.tokens, after.logprobs)], TOLERANCE)
    assert agreement.ok, "\n".join(agreement.mismatches)
    assert after.versions == bypassed.versions == str(ticket.version)
    again = _complete(live)  # the cache works again, on blocks computed under the new weights
    assert again.hits >= CACHED and again.tokens == after.tokens


def test_an_update_that_stalls_is_waited_out_with_no_504_and_no_false_health(live: Live) -> None:
    """A trainer stops for 8 s after two groups of an in-place update over the CPU stream. vLLM's engine loop is
    inside ``update_weights`` all that time; the proxy never asks it anything but ``/health``."""
    live.version += 1
    out = live.root.parent / "stall-rendezvous.json"
    cmd = [sys.executable, "-m", "tests.integration.procs", "stream", "--model", str(live.folder),
           "--rendezvous-out", str(out), "--version", str(live.version), "--seed", "61", "--stall-after", "2",
           "--stall-s", "8", "--bucket-bytes", str(256 << 10)]  # fmt: skip
    trainer_proc = subprocess.Popen(cmd, cwd=servers.ROOT, env=support.env_without_proxies())
    errors: list[BaseException] = []
    try:
        deadline = time.monotonic() + 120
        while not out.exists():
            assert trainer_proc.poll() is None and time.monotonic() < deadline, "the trainer never planned its replica"
            time.sleep(0.1)
        replica = live.replica()
        replica.init_transfer(json.loads(out.read_text()))
        trainer = support.hf_trainer(live.folder, seed=61)
        ticket = UpdateTicket(
            live.version, Channel.CPU, layout_digest=ModuleSource(trainer).table().layout_digest(), timeout_s=60
        )

        def update() -> None:
            try:
                replica.apply(ticket)
            except BaseException as e:  # noqa: BLE001 - re-raised below, on the test's thread
                errors.append(e)

        updating = threading.Thread(target=update, daemon=True)
        updating.start()
        while (board := live.server.board.get()) is None or board.state is not EngineState.PAUSED:
            time.sleep(0.05)
        time.sleep(2)  # into the stall
        t0 = time.monotonic()
        health = httpx.get(f"{live.server.proxy_url}/health", timeout=10, trust_env=False)
        assert health.status_code == 503 and health.json()["reason"] == proxy.PAUSED_REASON, health.text
        assert time.monotonic() - t0 < 1, "/health waited on the engine"
        body = {"prompt": support.PROMPTS[0], "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
        t0 = time.monotonic()
        answer = httpx.post(f"{live.server.proxy_url}/v1/completions", json=body, timeout=120, trust_env=False)
        waited = time.monotonic() - t0
        updating.join(120)
        assert not errors, errors
        assert answer.status_code == 200, answer.text  # held while the replica was paused, never a 504
        assert answer.headers[proxy.VERSIONS_HEADER] == str(ticket.version) and waited > 3, waited
        assert trainer_proc.wait(timeout=60) == 0
    finally:
        trainer_proc.kill()
        trainer_proc.wait(10)
    assert httpx.get(f"{live.server.proxy_url}/health", timeout=10, trust_env=False).status_code == 200
    support.assert_generates_like(HttpEngine(live.server.url), trainer)
