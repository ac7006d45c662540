"""One fleet, every process on its own host: weights reach replicas planned on different channels.

Each process runs in its own network namespace (``tests.netns``): the coordinator, the trainer
(``tests/fleet_trainer.py``: ``Publisher.from_env`` as the README shows) and three replicas, each a
real vLLM CPU server bound to 127.0.0.1 of its own host with its ``weightsync agent`` and the
OpenAI-only proxy on the host's address, as in a pod. Names resolve through each host's
/etc/hosts (``fleet-coordinator.test.svc``), nothing is reachable on another host's loopback, and
every process sees the checkpoint volume under its own path (a symlink per host), so a channel
that assumed one hostname, one bind address or one path would fail here.

The job offers ``nccl, cpu, volume`` in that order and its NCCL domain; the NCCL channel runs over
gloo with CPU tensors (``WEIGHTSYNC_NCCL_TRANSPORT=gloo``: its own code path, rendezvous from the
plan, generations, in-band table, in-place destinations into vLLM's parameters):

- ``replica-nccl`` declares the NCCL domain and gets ``nccl``;
- ``replica-cpu`` declares none and gets the CPU stream;
- ``replica-volume`` receives only the volume and gets each version once it is durable.

Then, one at a time: the NCCL replica's route to the trainer is made unreachable (a partition
between those two hosts only) and it takes the same version from the volume; the volume replica is
killed and started again and catches up; a trainer that reports another content digest than it
sent gets every replica's ack refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import netns, support
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import VersionInfo
from weightsync.jobconfig import JobConfig
from weightsync.vocabulary import Channel, ReplicaState, VersionState
from weightsync_inference.http_engine import greedy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
JOB = "fleet"
COORDINATOR = "fleet-coordinator.test.svc"
PORT = 50051
VLLM_PORT, PROXY_PORT = 8001, 8000
REPLICAS = ("replica-nccl", "replica-cpu", "replica-volume")
HOSTS = ("coordinator", "trainer", *REPLICAS)
UPDATE_TIMEOUT_S = 15


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _weightsync(*args: str) -> list[str]:
    return _py("-m", "weightsync.cli.main", *args)


@dataclass
class Fleet:
    hosts: netns.Hosts
    work: Path
    model: Path
    procs: dict[str, list[subprocess.Popen[Any]]] = field(default_factory=dict)
    trainer: subprocess.Popen[str] | None = None

    @property
    def config(self) -> JobConfig:
        return JobConfig(
            JOB,
            (Channel.NCCL, Channel.CPU, Channel.VOLUME),
            timeout_s=240,
            transfer_timeout_s=UPDATE_TIMEOUT_S,
            retention=2,
            checkpoint_dir="/unused",
            nccl_domain="test-fabric",
        )

    def mount(self, host: str) -> Path:
        """The checkpoint volume as ``host`` mounts it: its own path to the same files."""
        link = self.work / f"mnt-{host}"
        if not link.exists():
            link.symlink_to(self.work / "volume")
        return link

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **support.env_without_proxies(),
            "PYTHONPATH": str(ROOT),
            "WEIGHTSYNC_CONFIG": str(self.work / "job.json"),
            "WEIGHTSYNC_NCCL_TRANSPORT": "gloo",
            **extra,
        }

    def spawn(self, host: str, argv: list[str], name: str, **extra: str) -> subprocess.Popen[Any]:
        log = (self.work / f"{name}.log").open("ab")
        proc = self.hosts.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(**extra), cwd=ROOT)
        self.procs.setdefault(host, []).append(proc)
        return proc

    def start_coordinator(self) -> None:
        (self.work / "volume").mkdir()
        (self.work / "job.json").write_text(json.dumps(self.config.to_json()))
        self.spawn(
            "coordinator",
            _weightsync(
                "coordinator", "--insecure", "--host", self.hosts.address("coordinator"), "--port", str(PORT),
                "--volume", str(self.mount("coordinator")), "--lease-ttl", "5",
            ),
            "coordinator",
        )  # fmt: skip

    def start_replica(self, host: str) -> None:
        channels = {"replica-volume": ["--channels", "volume"], "replica-cpu": ["--nccl-domain", ""]}.get(host, [])
        vllm = _py(
            "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model), "--host", "127.0.0.1",
            "--port", str(VLLM_PORT), "--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.06",
            "--max-model-len", "256", "--seed", "0", "--weight-transfer-config",
            json.dumps({"backend": Channel.NCCL.engine_name}),
            "--worker-extension-cls", "weightsync_inference.worker.WorkerExtension",
        )  # fmt: skip
        self.spawn(host, vllm, f"{host}-vllm", VLLM_SERVER_DEV_MODE="1")
        self.spawn(
            host,
            _weightsync(
                "agent", "--vllm-url", f"http://127.0.0.1:{VLLM_PORT}", "--coordinator", f"{COORDINATOR}:{PORT}",
                "--insecure", "--replica-id", host, "--checkpoint-dir", str(self.mount(host)), "--host", f"node-{host}",
                *channels,
            ),
            f"{host}-agent",
        )  # fmt: skip
        listen = f"{self.hosts.address(host)}:{PROXY_PORT}"
        proxy = _weightsync("proxy", "--listen", listen, "--upstream", f"http://127.0.0.1:{VLLM_PORT}")
        self.spawn(host, proxy, f"{host}-proxy")

    def stop_host(self, host: str) -> None:
        """Kill every process on ``host`` at once (vLLM's engine and workers included), like a pod deleted."""
        pids = subprocess.run(["ip", "netns", "pids", self.hosts.namespace(host)], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for proc in self.procs.pop(host, []):
            proc.wait(30)

    def start_trainer(self) -> None:
        trainer_env = self.env(
            TEST_MODEL=str(self.model),
            WEIGHTSYNC_COORDINATOR=f"{COORDINATOR}:{PORT}",
            WEIGHTSYNC_INSECURE="1",
            WEIGHTSYNC_CHECKPOINT_DIR=str(self.mount("trainer")),
            POD_NAME="trainer-0",
            POD_IP=self.hosts.address("trainer"),
            NODE_NAME="node-trainer",
            RANK="0",
        )
        self.trainer = self.hosts.popen(
            "trainer",
            _py("-m", "tests.fleet_trainer"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(self.work / "trainer.log").open("ab"),
            env=trainer_env,
            cwd=ROOT,
            text=True,
        )
        assert json.loads(self._line(300)) == {"ready": True}

    def _line(self, timeout_s: float) -> str:
        assert self.trainer is not None and self.trainer.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line:
            if self.trainer.poll() is not None:
                raise AssertionError(f"the trainer exited {self.trainer.returncode}: {self.tail('trainer')}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer from the trainer in {timeout_s}s: {self.tail('trainer')}")
            line = self.trainer.stdout.readline()
        return line

    def publish(self, seed: int, step: int, lie: bool = False) -> dict[str, Any]:
        assert self.trainer is not None and self.trainer.stdin is not None
        self.trainer.stdin.write(json.dumps({"seed": seed, "step": step, "lie": lie}) + "\n")
        self.trainer.stdin.flush()
        report: dict[str, Any] = json.loads(self._line(600))
        return report

    def proxy(self, host: str) -> httpx.Client:
        return httpx.Client(base_url=f"http://{self.hosts.address(host)}:{PROXY_PORT}", trust_env=False)

    def wait_serving(self, hosts: tuple[str, ...], timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        for host in hosts:
            with self.proxy(host) as client:
                while True:
                    try:
                        if client.get("/health", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    dead = [p.args for p in self.procs.get(host, []) if p.poll() is not None]
                    if dead:
                        raise AssertionError(f"{host}: {dead[0]} exited: {self.tail(f'{host}-vllm')}")
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{host} not serving after {timeout_s}s: {self.tail(f'{host}-agent')}")
                    time.sleep(1)

    def tail(self, name: str) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def generates_like(self, host: str, seed: int) -> None:
        """The replica's greedy tokens through its proxy are what transformers gives for the trainer's weights."""
        from weightsync_trainer import reference

        model = support.hf_trainer(self.model, seed=seed)
        with self.proxy(host) as client:
            got = greedy(client, support.PROMPTS, support.TOKENS)
        result = reference.agreement(model, support.PROMPTS, got, support.LOGPROB_TOLERANCE)
        assert result.ok, f"{host}: " + "\n".join(result.mismatches)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    netns.require()
    work = tmp_path_factory.mktemp("fleet")
    with netns.Hosts(HOSTS) as hosts:
        hosts.resolve({COORDINATOR: "coordinator"})
        f = Fleet(hosts, work, support.tiny_model())
        try:
            f.start_coordinator()
            for host in REPLICAS:
                f.start_replica(host)
            f.wait_serving(REPLICAS)
            f.start_trainer()
            yield f
        finally:
            if f.trainer is not None:
                f.trainer.kill()
            for name in ("trainer", "coordinator", *(f"{r}-agent" for r in REPLICAS)):
                print(f"----- {name}.log\n{f.tail(name)}")


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> Iterator[CoordinatorClient]:
    with CoordinatorClient(f"{fleet.hosts.address('coordinator')}:{PORT}", insecure=True) as c:
        yield c


def _replicas(info: VersionInfo) -> dict[str, tuple[str, ReplicaState]]:
    return {r.replica_id: (r.channel.value if r.channel else "", r.state) for r in info.replicas}


def _served(client: CoordinatorClient) -> dict[str, int]:
    return {m.member_id: m.current_version for m in client.get_job(JOB).members if m.role.value == "replica"}


def test_one_version_reaches_replicas_on_three_channels_bit_exact(fleet: Fleet, client: CoordinatorClient) -> None:
    report = fleet.publish(seed=1, step=1)
    assert report["state"] == "READY", report
    info = client.version_info(report["version"], job=JOB)
    assert _replicas(info) == {
        "replica-nccl": ("nccl", ReplicaState.LOADED),
        "replica-cpu": ("cpu", ReplicaState.LOADED),
        "replica-volume": ("volume", ReplicaState.LOADED),
    }
    # every replica's engine computed, while loading, the digests the trainer sent
    assert info.content_digest == report["content_digest"] and info.content_digest.startswith("sha256:")
    assert {r.replica_id: r.content_digest for r in info.replicas} == dict.fromkeys(REPLICAS, info.content_digest)
    assert info.durable and info.manifest_checksum.startswith("sha256:")
    for host in REPLICAS:
        fleet.generates_like(host, seed=1)


def test_a_replica_whose_channel_fails_takes_the_same_version_from_the_volume(
    fleet: Fleet, client: CoordinatorClient
) -> None:
    trainer = fleet.hosts.address("trainer")
    partition = ["ip", "route", "add", "unreachable", f"{trainer}/32"]
    assert fleet.hosts.run("replica-nccl", partition).returncode == 0
    try:
        report = fleet.publish(seed=2, step=2)
    finally:
        fleet.hosts.run("replica-nccl", ["ip", "route", "del", "unreachable", f"{trainer}/32"])
    assert report["state"] == "READY", report
    assert "replica-nccl" in report["failed"], report
    info = client.version_info(report["version"], job=JOB)
    assert _replicas(info)["replica-nccl"] == ("volume", ReplicaState.LOADED)
    errors = {r.replica_id: r.error for r in info.replicas}
    assert "nccl failed, loading from the volume" in errors["replica-nccl"], errors
    assert {r.content_digest for r in info.replicas} == {info.content_digest}
    fleet.generates_like("replica-nccl", seed=2)


def test_a_restarted_replica_catches_up_from_the_volume(fleet: Fleet, client: CoordinatorClient) -> None:
    fleet.stop_host("replica-volume")
    deadline = time.monotonic() + 60
    while "replica-volume" in _served(client):  # its lease expires: the coordinator forgets it
        assert time.monotonic() < deadline
        time.sleep(0.5)
    report = fleet.publish(seed=3, step=3)
    assert report["state"] == "READY" and "replica-volume" not in report["channels"], report
    fleet.start_replica("replica-volume")
    fleet.wait_serving(("replica-volume",))
    deadline = time.monotonic() + 300
    while _served(client).get("replica-volume") != report["version"]:
        assert time.monotonic() < deadline, fleet.tail("replica-volume-agent")
        time.sleep(1)
    fleet.generates_like("replica-volume", seed=3)
    # the next version reaches it live again
    nxt = fleet.publish(seed=4, step=4)
    assert nxt["state"] == "READY" and nxt["channels"]["replica-volume"] == "volume", nxt
    fleet.generates_like("replica-volume", seed=4)


def test_acks_are_checked_against_what_the_trainer_sent(fleet: Fleet, client: CoordinatorClient) -> None:
    """A trainer that reports another content digest than it sent: each replica acks what its engine computed,
    which is not that, so every ack is refused and the version fails."""
    report = fleet.publish(seed=5, step=5, lie=True)
    assert report["state"] == "FAILED", report
    info = client.version_info(report["version"], job=JOB)
    assert all("not the sha256:0000" in r.error for r in info.replicas if r.state is ReplicaState.FAILED)
    assert info.state is VersionState.FAILED
