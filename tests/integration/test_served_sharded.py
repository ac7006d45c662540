"""The sharded path as a user runs it: a served vLLM replica (its OpenAI server at tensor-parallel size 2, with the
weightsync worker extension, ``weightsync agent`` and ``weightsync proxy`` beside it, as docs/serving.md says) on a
host of its own takes only its regions from a 2-rank FSDP2 trainer whose ranks each run on their own host.

The coordinator serves real gRPC with TLS and a bearer token on the bridge (the test's host network); the trainer
ranks are ``sharded_publish_ranks`` through ``test_sharded_publish.publish``; the replica's vLLM listens on its
host's loopback only, so everything the test knows of it comes from outside the agent, as an operator would see it:
the agent's ``/metrics`` (bytes each worker received as regions), the coordinator's version info, the proxy's
completions, and one ``HttpEngine`` run on the replica's host (the layout its workers record, the parameters they
hold). The first version arrives whole (the agent then records its engine layout through ``/collective_rpc`` and
registers it), the second as regions: each worker received exactly its layout's bytes, less than the table; the
replica generates what transformers generates for the trained weights; and each worker holds, bit for bit, what
vLLM's own loader makes of the trained weights for that worker (the model for that worker built on the CPU, no
second engine).

Then a trainer rank is killed inside its sends (``--die``): the version fails, the replica, left torn, reloads the
previous version from the ranks' sharded volume copy by region (``HttpEngine.read_regions``: the agent's metrics
show each worker landing exactly its layout's bytes from the volume), serves it again, and the next version moves
as regions, READY, bit for bit as vLLM's loader makes it.

``make sharded`` only (WEIGHTSYNC_SHARDED=all): one more vLLM start, which make test's hour has no room for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import hostfleet, netns, support
from tests.integration import test_sharded_publish as sharded_publish
from weightsync.vocabulary import Channel

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        not sharded_publish.ALL,
        reason="make sharded (WEIGHTSYNC_SHARDED=all): a served TP=2 vLLM is one more engine start than make test has",
    ),
]
ROOT = Path(__file__).resolve().parents[2]
JOB, TOKEN, TIMEOUT_S = sharded_publish.JOB, sharded_publish.TOKEN, sharded_publish.TIMEOUT_S
REPLICA = "replica-served"
TP = 2
METRICS_PORT = 9400
START_TIMEOUT_S = 600.0


@dataclass
class Served:
    fleet: sharded_publish.Fleet
    """What ``publish`` needs (hosts, the coordinator's target and CA, the model, the work folder); no engine."""
    client: Any
    """The coordinator, as the test's host reaches it."""
    procs: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)
    """vLLM's server, the agent and the proxy, on the replica's host."""
    logs: dict[str, Path] = field(default_factory=dict)
    agent_argv: list[str] = field(default_factory=list)

    @property
    def hosts(self) -> netns.Hosts:
        return self.fleet.hosts

    def env(self, **extra: str) -> dict[str, str]:
        # the caller's PYTHONPATH kept: the worktree's packages, not an editable install elsewhere
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        # two CPU workers on one NUMA node (as in test_tensor_parallel): no OpenMP binding per worker
        return {
            **support.env_without_proxies(),
            "PYTHONPATH": path,
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            **extra,
        }

    def restart_agent(self) -> None:
        """The agent stopped (SIGTERM, as a sidecar's restart) and started again beside the running vLLM; returns once
        it registered its engine layout again (its log says so), with no version received since."""
        support.stop(self.procs["agent"], 30)
        log = self.logs["agent"]
        before = log.read_text(errors="replace").count("registered its engine layout")
        self.procs["agent"] = _spawn(self, self.agent_argv, log, WEIGHTSYNC_TOKEN=TOKEN)
        deadline = time.monotonic() + START_TIMEOUT_S
        while log.read_text(errors="replace").count("registered its engine layout") == before:
            assert self.procs["agent"].poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the restarted agent registered no engine layout"
            time.sleep(1)

    def metrics(self) -> dict[str, float]:
        """The agent's Prometheus samples (name{labels} -> value), read over the bridge."""
        url = f"http://{self.hosts.address(REPLICA)}:{METRICS_PORT}/metrics"
        text = httpx.get(url, timeout=10, trust_env=False).text
        samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, value in samples}

    def on_replica(self, code: str) -> Any:
        """JSON printed by ``code`` run on the replica's host, beside vLLM (``engine`` is an ``HttpEngine`` on it)."""
        prelude = (
            "import json; from weightsync_inference.http_engine import HttpEngine; "
            f"engine = HttpEngine('http://127.0.0.1:{hostfleet.VLLM_PORT}', transfer_timeout_s=300); "
        )
        argv = [sys.executable, "-c", prelude + code]
        done = self.hosts.run(REPLICA, argv, capture_output=True, text=True, env=self.env(), timeout=600, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from prometheus_client import CollectorRegistry

    from weightsync.coordinator import server
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.coordinator.tls import ServerTls, TlsConfig

    netns.require()
    work, model = tmp_path_factory.mktemp("served-sharded"), support.tiny_model()
    with netns.Hosts(["rank-0", "rank-1", REPLICA]) as hosts:
        sharded_publish._mint(work, hosts.bridge_address)
        tls = ServerTls(str(work / "server.crt"), str(work / "server.key"))
        config = server.ServerConfig(host=hosts.bridge_address, port=0, token=TOKEN, tls=tls, metrics_port=0)
        coordinator = server.CoordinatorServer(config, registry=CollectorRegistry()).start()
        ca = work / "ca.crt"
        volume = work / "volume"  # the ranks' sharded copies: the replica reads one by region after a rank died
        volume.mkdir()
        fleet = sharded_publish.Fleet(hosts, coordinator.target, ca, None, None, {}, None, None, work, model, volume)
        client = CoordinatorClient(coordinator.target, token=TOKEN, tls=TlsConfig(ca_file=str(work / "ca.crt")))
        s = Served(fleet, client, logs={name: work / f"{name}.log" for name in ("vllm", "agent", "proxy")})
        try:
            vllm = hostfleet.vllm_server(model, Channel.CPU, tensor_parallel=TP)
            s.procs["vllm"] = _spawn(s, vllm, s.logs["vllm"], VLLM_SERVER_DEV_MODE="1")
            s.agent_argv = _weightsync(
                "agent", "--vllm-url", f"http://127.0.0.1:{hostfleet.VLLM_PORT}", "--coordinator", coordinator.target,
                "--tls-ca", str(work / "ca.crt"), "--job", JOB, "--replica-id", REPLICA, "--channels", "cpu,volume",
                "--host", f"node-{REPLICA}", "--update-timeout", str(TIMEOUT_S), "--checkpoint-dir", str(volume),
                "--metrics-port", str(METRICS_PORT), "--metrics-host", hosts.address(REPLICA),
            )  # fmt: skip
            s.procs["agent"] = _spawn(s, s.agent_argv, s.logs["agent"], WEIGHTSYNC_TOKEN=TOKEN)
            listen = f"{hosts.address(REPLICA)}:{hostfleet.PROXY_PORT}"
            proxy = ["proxy", "--listen", listen, "--upstream", f"http://127.0.0.1:{hostfleet.VLLM_PORT}"]
            s.procs["proxy"] = _spawn(s, _weightsync(*proxy), s.logs["proxy"])
            _wait_registered(s)
            yield s
        finally:
            for name, log in s.logs.items():
                text = log.read_text(errors="replace") if log.exists() else "(no log)"
                print(f"----- {name}.log\n{text[-4000:]}")
            hosts.close()  # every process on the hosts, vLLM's workers included
            client.close()
            coordinator.stop(0.5)


def _weightsync(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightsync.cli.main", *args]


def _spawn(s: Served, argv: list[str], log: Path, **extra: str) -> subprocess.Popen[Any]:
    with log.open("ab") as out:
        return s.hosts.popen(REPLICA, argv, stdout=out, stderr=subprocess.STDOUT, env=s.env(**extra), cwd=ROOT)


def _wait_registered(s: Served) -> None:
    """Until the proxy serves (vLLM up, the agent attached) and the agent registered the replica."""
    deadline = time.monotonic() + START_TIMEOUT_S
    url = f"http://{s.hosts.address(REPLICA)}:{hostfleet.PROXY_PORT}/health"
    while time.monotonic() < deadline:
        for name, proc in s.procs.items():
            log = s.logs[name]
            assert proc.poll() is None, (
                f"{name} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            up = httpx.get(url, timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            up = False
        if up and any(m.member_id == REPLICA for m in s.client.get_job(JOB).members):
            return
        time.sleep(1)
    raise AssertionError(f"the served replica did not register within {START_TIMEOUT_S:.0f}s")


def test_a_served_tp2_replica_on_its_own_host_takes_only_its_regions(served: Served) -> None:
    import torch
    import transformers

    from weightsync.vocabulary import ReplicaState

    first, second = sharded_publish.publish(served.fleet, "run", [1, 2])
    assert first["state"] == "READY" and first["channels"] == {REPLICA: "cpu"}, first
    assert "regions" not in first["seconds"], "no engine layout was registered yet: the first version goes whole"
    assert second["state"] == "READY" and second["channels"] == {REPLICA: "cpu"}, second
    assert "regions" in second["seconds"] and second["failed"] == {}, second
    info = served.client.version_info(second["version"], job=JOB)
    assert [(r.replica_id, r.state) for r in info.replicas] == [(REPLICA, ReplicaState.LOADED)], info.replicas

    # what each worker received, by the agent's metrics, against what its layout needs (recorded on the replica)
    metrics = served.metrics()
    received = {w: metrics.get(f'weightsync_agent_region_received_bytes_total{{worker="{w}"}}') for w in range(TP)}
    needs = served.on_replica(
        "table = engine.last_table(); layout = engine.engine_layout(table); "
        "print(json.dumps([table.total_bytes, [w.bytes_needed(table) for w in layout.workers]]))"
    )
    total, needed = needs[0], needs[1]
    assert received == dict(enumerate(needed)), (received, needed)
    assert all(0 < n < total for n in needed), (needed, total)

    reference = served.fleet.work / "run" / "reference-2"
    trained = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    with httpx.Client(base_url=f"http://{served.hosts.address(REPLICA)}:{hostfleet.PROXY_PORT}", trust_env=False) as c:
        support.assert_generates_like(_Proxy(c), trained)

    held = served.on_replica("print(json.dumps(engine.parameter_digests()))")
    assert_held_like_vllms_loader(served, reference, held)


def test_a_torn_served_replica_recovers_from_the_sharded_volume_by_region(served: Served) -> None:
    """The agent restarts beside the running vLLM and registers its engine layout at once (no version received
    since). Then a trainer rank killed inside its sends fails the version and leaves the replica torn; the replica
    reloads the newest durable version from the ranks' sharded copy, each worker reading only its regions (counted by
    the agent's metrics), serves it again, and takes the next version as regions."""
    if served.on_replica("print(json.dumps(engine.last_table() is None))"):  # run alone: a first version whole
        assert sharded_publish.publish(served.fleet, "first", [1, 2])[-1]["state"] == "READY"
    served.restart_agent()  # its layout, recorded at start, is what the region read below needs
    names = {w: f'weightsync_agent_volume_region_landed_bytes_total{{worker="{w}"}}' for w in range(TP)}
    before = served.metrics()
    previous = served.on_replica("print(json.dumps(engine.weight_version()))")
    results = sharded_publish.publish(served.fleet, "die", [3], "--die", "1", codes={1: -9})
    assert len(results) == 1 and results[0].get("state", "FAILED") == "FAILED", results

    deadline, landed = time.monotonic() + 300, {}
    while time.monotonic() < deadline:  # torn, then recovered by itself (its agent's lag check)
        m = served.metrics()
        landed = {w: m.get(name, 0.0) - before.get(name, 0.0) for w, name in names.items()}
        if all(landed.values()) and served.on_replica("print(json.dumps(engine.weight_version()))") == previous:
            break
        time.sleep(2)
    needed = served.on_replica(
        "table = engine.last_table(); layout = engine.engine_layout(table); "
        "print(json.dumps([w.bytes_needed(table) for w in layout.workers]))"
    )
    assert landed == dict(enumerate(needed)), (landed, needed, "the replica did not recover by region from the volume")

    report = sharded_publish.publish(served.fleet, "after-die", [4])[-1]
    assert report["state"] == "READY" and "regions" in report["seconds"] and report["failed"] == {}, report
    held = served.on_replica("print(json.dumps(engine.parameter_digests()))")
    assert_held_like_vllms_loader(served, served.fleet.work / "after-die" / "reference-4", held)


class _Proxy:
    """The replica's completions through its proxy, as ``support.assert_generates_like`` asks an engine for them."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        from weightsync_inference.http_engine import greedy

        return greedy(self.client, prompts, max_tokens)


def assert_held_like_vllms_loader(served: Served, reference: Path, held: list[dict[str, str]]) -> None:
    """Each worker holds, bit for bit, what vLLM's loader makes of the trained weights for that worker: the worker's
    model built on the CPU from the config (``offline_layouts.worker_model``), the full tensors loaded and
    post-processed as an engine does (``served_reference``), digested the same way (``held``)."""
    out = served.fleet.work / "loaded.json"
    cmd = [sys.executable, "-m", "tests.integration.served_reference", str(reference), str(TP), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=served.env(), cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: list[dict[str, str]] = json.loads(out.read_text())
    assert any(name.endswith("qkv_proj.weight") for name in loaded[0]), "the packed linear weights are compared"
    assert len(held) == len(loaded) == TP
    for worker, (mine, theirs) in enumerate(zip(held, loaded, strict=True)):
        differ = sorted(n for n in theirs if mine.get(n) != theirs[n])
        assert differ == [] and mine.keys() == theirs.keys(), (worker, differ)
