"""The sharded path end to end: a 2-rank FSDP2 trainer publishes through ``Publisher`` to a TP=2 vLLM CPU replica
driven by its agent, every rank sending only its own regions, every worker receiving only its own.

Each trainer rank runs on a host of its own (network namespaces; gloo between them over the bridge), the
coordinator serves real gRPC with TLS and a bearer token on the bridge, and the replica (a real vLLM CPU engine at
tensor-parallel size 2, ``OfflineEngine``, with its ``Agent`` on a thread) runs on the test's own host, beside a
second TP=2 replica whose engine cannot take regions (``WholeOnly``). The first version reaches both whole (no
engine layout is registered yet); the first replica's agent then records the layout of that table and registers
it, so the next version is planned on regions for it and on the gathered path for the other, in one publish: the
region group forms on trainer rank 0's CPU-stream store (the rendezvous the coordinator put in the plan), each
rank sends from its local shards, and the replica acks the combined digest its workers computed of what arrived.
A byte flipped on one rank's link fails the version, naming the tensor and the rank.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from tests import netns, pki, support

pytestmark = pytest.mark.integration
full = pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_SHARDED") != "all",
    reason="make sharded (WEIGHTSYNC_SHARDED=all); make test publishes regions to the TP=2 replica",
)
ROOT = Path(__file__).resolve().parents[2]
JOB, REPLICA, WHOLE, TOKEN = "job", "replica-tp2", "replica-whole", "sharded-publish-token"
TIMEOUT_S = 60.0


@dataclass
class Fleet:
    hosts: netns.Hosts
    target: str
    ca: Path
    engine: Any
    agent: Any
    whole_engine: Any
    """The replica that cannot take regions (``WholeOnly``): it gets the gathered path in the same versions."""
    whole_agent: Any
    work: Path


class WholeOnly:
    """An engine without the sharded path's calls (``lifecycle.RegionControl``): its agent registers no engine
    layout, so the coordinator plans it on the gathered path, the plan saying why."""

    REGION_CALLS = frozenset({"last_table", "engine_layout", "receive_regions"})

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        if name in self.REGION_CALLS:
            raise AttributeError(name)
        return getattr(self.engine, name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mint(folder: Path, address: str) -> None:
    """A CA and the coordinator's certificate for ``address``."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    pki.write(folder / "ca", pki.cert("sharded-ca", ca_key, "sharded-ca", ca_key, ca=True))
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(address))]
    pki.write(folder / "server", pki.cert("coordinator", key, "sharded-ca", ca_key, sans=sans), key)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from prometheus_client import CollectorRegistry

    from weightsync.coordinator import server
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.coordinator.tls import ServerTls, TlsConfig
    from weightsync.vocabulary import Channel
    from weightsync_inference.agent import Agent, AgentConfig
    from weightsync_inference.offline import OfflineEngine

    netns.require()
    work = tmp_path_factory.mktemp("sharded-publish")
    # two CPU workers on one NUMA node (as in test_tensor_parallel): no OpenMP binding per worker
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    mp.setenv("OMP_NUM_THREADS", "1")
    with netns.Hosts(["rank-0", "rank-1"]) as hosts:
        _mint(work, hosts.bridge_address)
        tls = ServerTls(str(work / "server.crt"), str(work / "server.key"))
        config = server.ServerConfig(host=hosts.bridge_address, port=0, token=TOKEN, tls=tls, metrics_port=0)
        coordinator = server.CoordinatorServer(config, registry=CollectorRegistry()).start()
        engines = [OfflineEngine(support.tiny_model(), Channel.CPU, tensor_parallel_size=2) for _ in range(2)]
        agents, threads = [], []
        for rid, control in ((REPLICA, engines[0]), (WHOLE, WholeOnly(engines[1]))):
            client = CoordinatorClient(coordinator.target, token=TOKEN, tls=TlsConfig(ca_file=str(work / "ca.crt")))
            config = AgentConfig(JOB, rid, (Channel.CPU,), host=f"node-{rid}", update_timeout_s=TIMEOUT_S)
            agents.append(Agent(control, client, config))
            threads.append(threading.Thread(target=agents[-1].run, name=f"agent-{rid}", daemon=True))
            threads[-1].start()
        try:
            deadline = time.monotonic() + 60
            while not all(_registered(a.client) for a in agents) and time.monotonic() < deadline:
                time.sleep(0.1)  # each watches from its registration on
            yield Fleet(hosts, coordinator.target, work / "ca.crt", engines[0], agents[0], engines[1], agents[1], work)
        finally:
            for agent in agents:
                agent.stop()
            for thread in threads:
                thread.join(30)
            for engine in engines:
                engine.close()
            coordinator.stop(0.5)
            mp.undo()


def _registered(client: Any) -> bool:
    from weightsync.errors import PermanentError

    try:
        return bool(client.lease)
    except PermanentError:
        return False


def _publish(fleet: Fleet, name: str, steps: list[int], *extra: str) -> list[dict[str, Any]]:
    """Run the 2 trainer ranks, each on its host, publishing ``steps``; rank 0's reports."""
    out = fleet.work / name
    out.mkdir()
    port = _free_port()
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "tests.integration.sharded_publish_ranks", "--coordinator", fleet.target]
        cmd += ["--ca", str(fleet.ca), "--model", str(support.tiny_model()), "--port", str(port)]
        cmd += ["--master", fleet.hosts.address("rank-0"), "--host", fleet.hosts.address(f"rank-{rank}")]
        cmd += ["--steps", *map(str, steps), "--timeout", str(TIMEOUT_S), "--out", str(out), *extra]
        env = {**support.env_without_proxies(), "RANK": str(rank), "WORLD_SIZE": "2", "WEIGHTSYNC_TOKEN": TOKEN}
        procs.append(fleet.hosts.popen(f"rank-{rank}", cmd, cwd=ROOT, env=env))
    try:
        assert [p.wait(timeout=600) for p in procs] == [0, 0]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the trainer ranks did not finish publishing {steps} within 600s")
    finally:
        for p in procs:
            p.kill()
    reports: list[dict[str, Any]] = json.loads((out / "rank0.json").read_text())
    return reports


def test_a_fsdp2_trainer_sends_a_tp2_replica_only_its_regions_through_the_publisher_and_agent(fleet: Fleet) -> None:
    import transformers

    first, second = _publish(fleet, "run", [1, 2])
    assert first["state"] == "READY" and first["channels"] == {REPLICA: "cpu", WHOLE: "cpu"}, first
    assert "regions" not in first["seconds"], "no engine layout was registered yet: the first version goes whole"
    assert second["state"] == "READY" and second["channels"] == {REPLICA: "cpu", WHOLE: "cpu"}, second
    assert "regions" in second["seconds"] and "stream" in second["seconds"] and second["failed"] == {}, second
    # the replica that cannot take regions got the same version the gathered way, in the same publish
    assert fleet.whole_agent.engine_layout is None and fleet.whole_agent.last_regions is None
    assert [e for e in fleet.whole_agent.events if e[0] == "assign"][-2:] == [
        ("assign", first["version"], "ok"),
        ("assign", second["version"], "ok"),
    ]

    received = fleet.agent.last_regions
    assert received is not None and received.version == second["version"]
    table = fleet.engine.last_table()  # the table the first version brought in band
    assert table is not None
    layout = fleet.engine.engine_layout(table)
    for worker, nbytes in received.nbytes.items():
        assert nbytes == layout.workers[worker].bytes_needed(table) < table.total_bytes, (worker, nbytes)
    assert sorted(received.nbytes) == [0, 1]

    trained = transformers.AutoModelForCausalLM.from_pretrained(fleet.work / "run" / "reference-2", dtype=torch.float32)
    support.assert_generates_like(fleet.engine, trained)
    support.assert_generates_like(fleet.whole_engine, trained)


@full
def test_a_byte_flipped_on_one_ranks_link_fails_the_version_naming_tensor_and_rank(fleet: Fleet) -> None:
    # a version reaches the replica whole first when it has registered no layout yet (this test run alone)
    steps = [3] if fleet.agent.engine_layout is not None else [2, 3]
    report = _publish(fleet, "flip", steps, "--flip", "1")[-1]
    assert "regions" in report["seconds"] and report["state"] == "FAILED", report
    assert "from trainer rank 1 arrived with digest" in report["reason"], report["reason"]
    assert "of tensor '" in report["reason"], report["reason"]
