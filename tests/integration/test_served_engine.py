"""A served vLLM (its OpenAI server, dev mode, on 127.0.0.1) updated over HTTP, and fenced by the proxy.

One real server and one real ``weightsync proxy`` process (``served_server``, shared with
test_served_caches: starting vLLM costs 30-60 s here) serve the whole module; the tests run
in order and each leaves the server serving a whole, known version. The agent's side is
``Replica(HttpEngine(url))``; the client's side is plain HTTP to the proxy.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from tests import support
from tests.integration import servers
from weightsync.channels import manifests
from weightsync.channels.base import Offer, Rendezvous, UpdateTicket
from weightsync.coordinator import server
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import Capabilities, JobPolicy, summarize
from weightsync.vocabulary import Channel, EngineState, PauseMode, ReplicaState, VersionState
from weightsync_inference import proxy
from weightsync_inference import served as served_mod
from weightsync_inference.agent import Agent, AgentConfig
from weightsync_inference.http_engine import HttpEngine
from weightsync_inference.lifecycle import Replica, UpdateFailed, UpdateOutcome
from weightsync_inference.staging import StagingUnavailable, staging_bytes
from weightsync_trainer.sources import ModuleSource

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
DEV_ROUTES = [
    "/pause",
    "/resume",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_checker",
    "/weight_info",
    "/collective_rpc",
    "/sleep",
    "/inference/v1/generate",
]


@dataclass
class Served:
    root: Path
    folder: Path
    url: str
    proxy_url: str
    engine: HttpEngine
    replica: Replica
    log: Path
    board: served_mod.Board
    version: int = 0
    serving: torch.nn.Module | None = None

    def publish(self, seed: int) -> tuple[UpdateTicket, torch.nn.Module]:
        """Write a new version to the volume; the ticket a replica gets for it (layout digest, manifest checksum)."""
        self.version += 1
        ticket, trainer, _ = servers.publish(self.root, self.folder, self.version, seed)
        return ticket, trainer


@pytest.fixture(scope="module")
def served(served_server: servers.Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    server = served_server
    engine = HttpEngine(server.url)
    replica = Replica(engine, board=server.board)
    replica.adopt()  # what an agent does first: the proxy reads the board from here on
    root = tmp_path_factory.mktemp("served-engine") / "volume"
    replica.init_transfer(Rendezvous(Channel.VOLUME, root=str(root)).to_dict())
    yield Served(root, support.tiny_model(), server.url, server.proxy_url, engine, replica, server.log, server.board)
    engine.close()


def test_replica_loads_a_volume_version_over_http(served: Served) -> None:
    assert served.engine.healthy()
    before = served.engine.greedy(support.PROMPTS, support.TOKENS)
    ticket, trainer = served.publish(seed=1)
    t0 = time.perf_counter()
    outcome = served.replica.apply(ticket)
    print(f"served update: {time.perf_counter() - t0:.3f}s {outcome.seconds}")
    assert served.replica.state is EngineState.SERVING and not served.engine.is_paused()
    # the agent acks what the server's engine computed, read back over /collective_rpc
    assert outcome.receipt == served.engine.receipt() and outcome.receipt.version == served.version
    assert [i.device for i in served.engine.identity()] == ["cpu"]
    info = httpx.get(f"{served.url}/weight_info", timeout=10, trust_env=False).json()
    assert info == {"weight_version": str(served.version)} and served.engine.weight_version() == str(served.version)
    assert served.engine.greedy(support.PROMPTS, support.TOKENS) != before
    support.assert_generates_like(served.engine, trainer)
    served.serving = trainer


def test_corrupt_shard_is_refused_and_previous_version_keeps_serving(served: Served) -> None:
    assert served.serving is not None, "needs the version loaded by the previous test"
    serving_version = served.engine.weight_version()
    ticket, _ = served.publish(seed=2)
    shard = served.root / f"v{served.version:08d}" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    # each worker records the refusal in its receipt (raising it would desync vLLM's executor at TP >= 2), read back
    # over /collective_rpc with whether any parameter changed
    refused = r"receipt is for version \d+ \(.*shard-00000.safetensors of version \d+: sha256 .* has changed"
    with pytest.raises(UpdateFailed, match=refused) as err:
        served.replica.apply(ticket)
    receipt = served.engine.receipt()
    assert not receipt.ok and not receipt.torn and err.value.state is EngineState.SERVING
    assert served.replica.state is EngineState.SERVING and not served.engine.is_paused()
    assert served.engine.weight_version() == serving_version
    support.assert_generates_like(served.engine, served.serving)


def test_proxy_forwards_completions(served: Served) -> None:
    direct = served.engine.greedy(support.PROMPTS, support.TOKENS)
    with HttpEngine(served.proxy_url) as through_proxy:
        assert through_proxy.greedy(support.PROMPTS, support.TOKENS) == direct
    body = {"prompt": support.PROMPTS[0], "max_tokens": 2, "temperature": 0.0}
    answer = httpx.post(f"{served.proxy_url}/v1/completions", json=body, timeout=60, trust_env=False)
    assert answer.headers[proxy.VERSIONS_HEADER] == served.engine.weight_version()  # the weights that made it
    models = httpx.get(f"{served.proxy_url}/v1/models", timeout=10, trust_env=False)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == str(served.folder)
    assert httpx.get(f"{served.proxy_url}/health", timeout=10, trust_env=False).json() == {"status": "ok"}


def test_proxy_streams_server_sent_events(served: Served) -> None:
    direct_ids = served.engine.greedy(support.PROMPTS[:1], support.TOKENS)[0][0]
    body = {"prompt": support.PROMPTS[0], "max_tokens": support.TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}  # fmt: skip
    events: list[str] = []
    with httpx.stream("POST", f"{served.proxy_url}/v1/completions", json=body, timeout=60, trust_env=False) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2, events
    streamed = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
    assert streamed == direct_ids


def test_proxy_hides_dev_routes(served: Served) -> None:
    for route in DEV_ROUTES:
        for method in ("GET", "POST"):
            r = httpx.request(method, f"{served.proxy_url}{route}", json={}, timeout=10, trust_env=False)
            assert r.status_code == 404, (method, route, r.text)
            assert "is not exposed by the weightsync proxy" in r.json()["error"]["message"]
    assert not served.engine.is_paused()
    # the same routes answer on vLLM's own (loopback) port: the proxy is what hides them
    assert httpx.get(f"{served.url}/weight_info", timeout=10, trust_env=False).status_code == 200


@contextlib.contextmanager
def _mid_generation(
    served: Served, body: dict[str, object], freeze: bool = True
) -> Iterator[tuple[httpx.Response, str, Iterator[str]]]:
    """A completion streamed through the proxy, once its first event arrived: the response, that event and the rest
    of its lines. ``freeze``: vLLM is paused (keep) while it is still generating it. On busy cores the API server can
    relay a stream far behind the engine, so a first token read here does not mean the generation still runs (CI
    saw all 2000 tokens finished by then); vLLM's gauge of running requests says, and the stream is tried again (up
    to 10 times) when it ran out."""
    for _ in range(10):
        with httpx.stream("POST", f"{served.proxy_url}/v1/completions", json=body, timeout=120, trust_env=False) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            if not freeze:
                yield r, first, lines
                return
            served.engine.pause()
            if servers.metric(served.url, "vllm:num_requests_running") > 0:
                yield r, first, lines
                return
            served.engine.resume()
            for _ in lines:  # it ended before the freeze: read it out and try again
                pass
    pytest.fail("no streamed generation was still running when it was frozen, in 10 tries")


def test_a_request_in_flight_survives_an_update(served: Served) -> None:
    """``/pause?mode=keep`` freezes a running generation instead of aborting it; it finishes after resume.

    The generation is frozen as soon as its first token arrived, then the update pauses the
    same way, loads and resumes. With ``mode=abort`` the stream would end early with
    ``finish_reason`` "abort".
    """
    tokens = 1500
    body = {"prompt": support.PROMPTS[0], "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}  # fmt: skip
    ticket, trainer = served.publish(seed=3)
    before = served.engine.weight_version()
    with _mid_generation(served, body) as (r, first, lines):
        served.replica.apply(ticket)  # pauses the same way, loads, resumes
        rest = list(lines)
        events = [first] + [line for line in rest if line.startswith("data: ")]
    # the rollout says it was generated partly by the old weights and partly by the new
    assert r.headers[proxy.START_HEADER] == before
    assert f"{proxy.SSE_VERSIONS}{before},{served.version}" in rest, rest[-3:]
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-1]]
    assert events[-1] == "data: [DONE]" and chunks[-1]["finish_reason"] == "length"
    assert sum(len(c["token_ids"]) for c in chunks) == tokens
    assert served.engine.weight_version() == str(served.version)
    support.assert_generates_like(served.engine, trainer)
    served.serving = trainer


def _stream_through_an_update(served: Served, mode: PauseMode, tokens: int) -> tuple[list[int], str, list[str]]:
    """Stream one greedy completion through the proxy and load a new version (pausing with ``mode``) while it is
    generated; its token ids, its finish reason and the stream's last lines."""
    body = {"prompt": support.PROMPTS[0], "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}  # fmt: skip
    ticket, trainer = served.publish(seed=10 + served.version)
    engine = HttpEngine(served.url, pause_mode=mode)
    replica = Replica(engine, version=int(served.engine.weight_version()), board=served.board)
    # abort: frozen first, so the generation surely runs when the update pauses; wait: never frozen (it would wait
    # for a generation that cannot finish)
    with _mid_generation(served, body, freeze=mode is not PauseMode.WAIT) as (_, first, lines):
        replica.apply(ticket)
        rest = list(lines)
    events = [first] + [line for line in rest if line.startswith("data: ") and line != "data: [DONE]"]
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events]
    assert served.engine.weight_version() == str(served.version) and not served.engine.is_paused()
    served.serving = trainer
    return [t for c in chunks for t in c["token_ids"]], chunks[-1]["finish_reason"], rest[-3:]


def test_pause_wait_finishes_a_generation_on_the_old_weights_and_abort_ends_it(served: Served) -> None:
    """``wait``: the update starts only once the generation in flight finished, so every token comes from the
    weights it started on (a job that needs single-version rollouts); ``abort``: the generation ends at once."""
    tokens = 600
    old = served.engine.greedy(support.PROMPTS[:1], tokens)[0][0]
    ids, reason, _ = _stream_through_an_update(served, PauseMode.WAIT, tokens)
    assert reason == "length" and ids == old  # all of it generated by the version it started on
    ids, reason, last = _stream_through_an_update(served, PauseMode.ABORT, 2000)
    assert reason == "abort" and len(ids) < 2000, (reason, len(ids), last)
    support.assert_generates_like(served.engine, served.serving)


def _updates_under_load(served: Served, count: int, update: Callable[[UpdateTicket], UpdateOutcome]) -> None:
    """A steady stream of completions through the proxy while ``count`` versions load with ``update``: every
    completion the proxy attributes to one version is what that version generates; completions across an update name
    two versions, in order (``support.assert_attributed``)."""
    body = {"prompt": support.PROMPTS[1], "max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 0}  # fmt: skip
    made: list[tuple[str, support.Output]] = []
    stop = threading.Event()

    failed: list[str] = []

    def load() -> None:
        with httpx.Client(trust_env=False, timeout=60) as client:
            while not stop.is_set():
                r = client.post(f"{served.proxy_url}/v1/completions", json=body)
                if r.status_code != 200:
                    failed.append(f"{r.status_code}: {r.text}")
                    return
                choice = r.json()["choices"][0]
                made.append(
                    (r.headers[proxy.VERSIONS_HEADER], (choice["token_ids"], choice["logprobs"]["token_logprobs"]))
                )

    serving = served.engine.weight_version()
    assert served.serving is not None, "needs the version loaded by the previous tests"
    models = {serving: served.serving}
    # every version is trained and written before the load starts: the updates under load are what is tested, and
    # a trainer competing with the server for 2 cores made one run take more than ten times as long as another
    published = [served.publish(seed=100 + served.version) for _ in range(count)]
    client = threading.Thread(target=load, daemon=True)
    client.start()
    try:
        for ticket, served.serving in published:
            update(ticket)
            models[str(ticket.version)] = served.serving
            # the second completion to end after the update started after it: one that ran within this version
            after = len(made) + 2
            deadline = time.monotonic() + 60
            while len(made) < after and client.is_alive() and time.monotonic() < deadline:
                time.sleep(0.005)
    finally:
        stop.set()
        client.join(60)
    assert not failed, f"a completion through the proxy failed: {failed[0]}"
    support.assert_attributed(models, support.PROMPTS[1], made, count)


def test_no_completion_is_attributed_to_the_wrong_version_through_20_updates(served: Served) -> None:
    _updates_under_load(served, 20, served.replica.apply)


def test_staged_versions_load_beside_generation_and_switch_in(served: Served) -> None:
    """Staged mode: the version is received into the engine's stage while the server goes on serving the one it
    has (not paused, same tokens), then switched in; through 20 staged updates under load no completion is
    attributed to the wrong version."""
    replica = served.replica
    serving = served.engine.weight_version()
    before = served.engine.greedy([support.PROMPTS[1]], 24)[0][0]
    ticket, trainer = served.publish(seed=900)
    # a stage the worker cannot allocate is refused before anything happens, saying why (the agent then loads
    # that version in place)
    with pytest.raises(StagingUnavailable, match=r"cannot allocate 1125899\.91 GB on cpu to stage version"):
        replica.stage(ticket, 1 << 50)
    assert served.engine.weight_version() == serving and served.engine.stage_status().version != ticket.version
    summary = summarize(ModuleSource(trainer).table())
    nbytes = staging_bytes(summary.total_bytes, summary.tensor_count)
    replica.stage(ticket, nbytes)
    deadline = time.monotonic() + 60
    while served.engine.stage_status().state == "receiving" and time.monotonic() < deadline:
        assert not served.engine.is_paused()
        time.sleep(0.01)
    status = served.engine.stage_status()
    assert (status.version, status.state, status.error) == (ticket.version, "staged", ""), status
    assert served.engine.weight_version() == serving and not served.engine.is_paused()
    assert served.engine.greedy([support.PROMPTS[1]], 24)[0][0] == before  # still the previous weights
    outcome = replica.switch(ticket)
    assert served.engine.weight_version() == str(ticket.version) and outcome.receipt.ok
    support.assert_generates_like(served.engine, trainer)
    served.serving = trainer

    def staged(t: UpdateTicket) -> UpdateOutcome:
        replica.stage(t, nbytes)
        return replica.switch(t)

    _updates_under_load(served, 20, staged)


def test_trainer_killed_mid_stream_leaves_the_server_paused_until_a_whole_version(served: Served) -> None:
    """A torn update over HTTP: the engine's receipt says torn, so the replica stays paused.

    The same served engine (started for the volume) builds a CPU-stream receiver from the
    trainer's rendezvous; the trainer process dies after two groups.
    """
    served.version += 1
    out = served.root.parent / "rendezvous.json"
    cmd = [sys.executable, "-m", "tests.integration.procs", "stream", "--model", str(served.folder),
           "--rendezvous-out", str(out), "--version", str(served.version), "--seed", "12", "--die-after", "2",
           "--bucket-bytes", str(256 << 10)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=support.env_without_proxies())
    try:
        deadline = time.monotonic() + 120
        while not out.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the trainer never planned its replica"
            time.sleep(0.1)
        served.replica.init_transfer(json.loads(out.read_text()))
        table = ModuleSource(support.hf_trainer(served.folder, seed=12)).table()
        ticket = UpdateTicket(served.version, Channel.CPU, layout_digest=table.layout_digest(), timeout_s=60)
        torn = r"failed after bytes reached the parameters: the engine's receipt is for version \d+ \("
        with pytest.raises(UpdateFailed, match=torn):
            served.replica.apply(ticket)
        assert (served.replica.state, served.engine.is_paused()) == (EngineState.TORN, True)
        assert served.engine.receipt().torn
        # an agent restarted now finds the engine torn by its receipt, and keeps it paused
        assert Replica(served.engine).adopt() is EngineState.TORN and served.engine.is_paused()
        assert proc.wait(timeout=60) == 17
    finally:
        proc.kill()
        proc.wait(10)

    recovery, trainer = served.publish(seed=13)
    served.replica.apply(recovery)
    assert served.replica.state is EngineState.SERVING and not served.engine.is_paused()
    assert served.engine.weight_version() == str(served.version)
    support.assert_generates_like(served.engine, trainer)
    served.serving = trainer


def test_a_refused_catch_up_is_acked_backs_off_and_leaves_the_serving_engine_alone(served: Served) -> None:
    """A restarted replica's agent catches up to a durable READY version whose shard is damaged on the volume.

    The engine refuses it untouched (and keeps serving); the agent acks the failure with the reason, which the
    version's status shows, and retries with backoff, checking the files itself first, so the serving engine is
    not paused again while they stay damaged. Once the shard is repaired the next retry loads the version.
    """
    coordinator = server.CoordinatorServer(server.ServerConfig(port=0, insecure=True)).start()
    trainer = CoordinatorClient(coordinator.target, insecure=True)
    agent: Agent | None = None
    try:
        caps = Capabilities(host="trainer-host", channels=(Channel.VOLUME,), volume_id="vol")
        policy = JobPolicy(ready_without_acks=True)  # the versions below have no replica to ack them
        trainer.register_trainer("catch-up", "trainer", caps, policy=policy, offers=[Offer(Channel.VOLUME)])
        summary = summarize(ModuleSource(support.hf_trainer(served.folder, seed=21)).table())
        version = 0
        while version <= served.version:  # numbers at the coordinator up to the volume's next version
            version = trainer.open_version(version + 1, summary).version
            assert trainer.report_sent(version, "", {}).state is VersionState.READY
        served.version = version - 1
        ticket, model = served.publish(seed=21)
        path = manifests.manifest_path(served.root, version)
        assert trainer.mark_durable(version, str(path), ticket.manifest_checksum).durable
        shard = max(path.parent.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        good = shard.read_bytes()
        shard.write_bytes(good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 1]) + good[len(good) // 2 + 1 :])
        serving = served.engine.weight_version()

        config = AgentConfig(
            "catch-up", "replica-0", (Channel.VOLUME,), "replica-host", volume=served.root, volume_id="vol",
            lag_check_s=0.2, retry_s=0.5, retry_max_s=4.0,
        )  # fmt: skip
        served.engine.pause()  # as an agent that died between pause and the first byte leaves it
        client = CoordinatorClient(coordinator.target, insecure=True)
        agent = Agent(HttpEngine(served.url), client, config, board=served.board)
        assert not served.engine.is_paused(), "the new agent did not resume an engine paused with whole weights"
        threading.Thread(target=agent.run, name="agent", daemon=True).start()

        def replica_status() -> tuple[ReplicaState | None, str]:
            info = trainer.version_info(version)
            return next(((r.state, r.error) for r in info.replicas if r.replica_id == "replica-0"), (None, ""))

        deadline = time.monotonic() + 60
        while replica_status()[0] is not ReplicaState.FAILED:
            assert time.monotonic() < deadline, "the refused catch-up never reached the coordinator"
            time.sleep(0.2)
        error = replica_status()[1]
        assert "catch-up from the volume" in error and "does not match the manifest's" in error, error
        assert trainer.version_info(version).state is VersionState.READY  # a catch-up never changes the verdict
        time.sleep(4.0)
        outcomes = [outcome for kind, v, outcome in list(agent.events) if (kind, v) == ("catch-up", version)]
        # the engine was asked once; every retry since stopped at the agent's own check of the files
        assert [o.split(":")[0] for o in outcomes][:1] == ["failed"] and len(outcomes) >= 3, outcomes
        assert all(o.startswith("not loaded: its files are refused") for o in outcomes[1:]), outcomes
        assert len(outcomes) <= 6, f"no backoff: {len(outcomes)} tries in about 5 s"
        assert served.engine.weight_version() == serving and not served.engine.is_paused()

        shard.write_bytes(good)  # repaired: the next retry passes the check and loads the version
        deadline = time.monotonic() + 60
        while served.engine.weight_version() != str(version):
            assert time.monotonic() < deadline, f"not loaded after the repair: {agent.events[-3:]}"
            time.sleep(0.2)
        while replica_status() != (ReplicaState.LOADED, ""):
            assert time.monotonic() < deadline, replica_status()
            time.sleep(0.2)
        assert not served.engine.is_paused()
        support.assert_generates_like(served.engine, model)
        served.version, served.serving, served.replica.version = version, model, version
    finally:
        if agent is not None:
            agent.stop()
        trainer.close()
        coordinator.stop(0.5)


def test_a_staged_switch_that_tears_stops_the_engine_from_stepping(served: Served) -> None:
    """A stage that goes bad after it was verified (one bit flipped by the test's worker extension) tears a switch
    between steps: the switch's check catches the bit after the bytes reached the parameters.

    Idle, the replica is paused before any step, TORN, and a whole version brings it back (its worker steps again).
    Should a step come before the pause (here vLLM is resumed by hand, as if a request raced it), the worker
    refuses it: vLLM's engine fails and the completion gets no token from the mix. Runs last: it stops the server.
    """
    replica = served.replica
    summary = summarize(ModuleSource(support.hf_trainer(served.folder, seed=31)).table())
    nbytes = staging_bytes(summary.total_bytes, summary.tensor_count)

    def torn_switch(seed: int) -> None:
        ticket, _ = served.publish(seed=seed)
        replica.stage(ticket, nbytes)
        staged = replica.wait_staged(ticket)
        served.engine._workers("weightsync_test_flip_staged_bit", "model.norm.weight")
        with pytest.raises(UpdateFailed, match="failed after bytes reached the parameters") as err:
            replica.switch(ticket, staged)
        assert err.value.state is EngineState.TORN and replica.state is EngineState.TORN
        assert served.engine.is_paused() and served.engine.receipt().torn

    torn_switch(seed=31)
    recovery, trainer = served.publish(seed=32)
    replica.apply(recovery)
    assert replica.state is EngineState.SERVING and not served.engine.is_paused()
    support.assert_generates_like(served.engine, trainer)
    served.serving = trainer

    torn_switch(seed=33)
    body = {"prompt": support.PROMPTS[1], "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    # clients get 503 from the proxy at once (the replica is torn), not a wait on a paused engine
    r = httpx.post(f"{served.proxy_url}/v1/completions", json=body, timeout=120, trust_env=False)
    assert r.status_code == 503 and r.headers["retry-after"] == str(proxy.RETRY_TORN_S), r.text
    health = httpx.get(f"{served.proxy_url}/health", timeout=10, trust_env=False)
    assert (health.status_code == 503 and "torn" not in health.json()["reason"]) or "failed after bytes" in health.text
    served.engine.resume()  # a step that raced the pause, straight to vLLM
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120, trust_env=False)
    assert r.status_code != 200, r.text
    assert "refuses to step until a whole version loads" in served.log.read_text()
