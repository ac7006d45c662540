"""One fleet, every process on its own host: the setup the multi-host tests and the fault suite share.

Each process runs in its own network namespace (``tests.netns``): the coordinator, the trainer
(``tests/fleet_trainer.py``: ``Publisher.from_env`` as the README shows) and four replicas, each a
real vLLM CPU server bound to 127.0.0.1 of its own host with its ``weightsync agent`` and the
OpenAI-only proxy on the host's address, as in a pod. Names resolve through each host's
/etc/hosts (``fleet-coordinator.test.svc``), nothing is reachable on another host's loopback, and
every process sees the checkpoint volume under its own path (a symlink per host), so a channel
that assumed one hostname, one bind address or one path would fail here. The volume is a tmpfs of
``VOLUME_BYTES`` (a volume has a size; the fault suite fills it).

The job offers ``nccl, cpu, volume`` in that order and its NCCL domain; the NCCL channel runs over
gloo with CPU tensors (``WEIGHTSYNC_NCCL_TRANSPORT=gloo``: its own code path, rendezvous from the
plan, generations, in-band table, in-place destinations into vLLM's parameters):

- ``replica-nccl`` and ``replica-nccl-2`` declare the NCCL domain and share one ``nccl`` group (a fault
  of one must not cost the other its version);
- ``replica-cpu`` declares none and gets the CPU stream;
- ``replica-volume`` receives only the volume and gets each version once it is durable.

The job's join deadline is the default (``jobconfig.DEFAULT_JOIN_TIMEOUT_S``), below its 15 s transfer
timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests import netns, support
from weightsync.coordinator.client import CoordinatorClient
from weightsync.jobconfig import JobConfig
from weightsync.vocabulary import Channel
from weightsync_inference.http_engine import greedy

ROOT = Path(__file__).resolve().parents[1]
JOB = "fleet"
COORDINATOR = "fleet-coordinator.test.svc"
PORT = 50051
VLLM_PORT, PROXY_PORT = 8001, 8000
REPLICAS = ("replica-nccl", "replica-nccl-2", "replica-cpu", "replica-volume")
CHANNELS = {"replica-nccl": "nccl", "replica-nccl-2": "nccl", "replica-cpu": "cpu", "replica-volume": "volume"}
"""The channel each replica is planned on when nothing failed."""
HOSTS = ("coordinator", "trainer", *REPLICAS)
UPDATE_TIMEOUT_S = 15
LEASE_TTL_S = 5.0
VOLUME_BYTES = 64 << 20


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _weightsync(*args: str) -> list[str]:
    return _py("-m", "weightsync.cli.main", *args)


def vllm_server(model: Path, backend: Channel, *, tensor_parallel: int = 1) -> list[str]:
    """A replica's vLLM as a pod runs it (docs/serving.md): the OpenAI server on its host's loopback
    (``VLLM_PORT``), the weightsync engine of ``backend`` and the worker extension; run it with
    ``VLLM_SERVER_DEV_MODE=1`` (the agent's routes)."""
    return _py(
        "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
        "--port", str(VLLM_PORT), "--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.06",
        "--max-model-len", "256", "--seed", "0", "--tensor-parallel-size", str(tensor_parallel),
        "--weight-transfer-config", json.dumps({"backend": backend.engine_name}),
        "--worker-extension-cls", "weightsync_inference.worker.WorkerExtension",
    )  # fmt: skip


@dataclass
class Fleet:
    hosts: netns.Hosts
    work: Path
    model: Path
    procs: dict[str, list[subprocess.Popen[Any]]] = field(default_factory=dict)
    named: dict[str, subprocess.Popen[Any]] = field(default_factory=dict)
    trainer: subprocess.Popen[str] | None = None
    step: int = 0
    """The last step published: each publish takes the next (a trainer's steps never go back)."""
    seeds: dict[int, int] = field(default_factory=dict)
    """The seed of the weights each version reported published carries (``generates_like`` of what it serves)."""
    _seed: int = 0
    tmpfs: bool = False

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

    @property
    def volume(self) -> Path:
        return self.work / "volume"

    def mount(self, host: str) -> Path:
        """The checkpoint volume as ``host`` mounts it: its own path to the same files."""
        link = self.work / f"mnt-{host}"
        if not link.exists():
            link.symlink_to(self.volume)
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
        self.named[name] = proc
        return proc

    def client(self, timeout_s: float = 10.0) -> CoordinatorClient:
        """A client from the test's own host (over the bridge), for status reads."""
        return CoordinatorClient(f"{self.hosts.address('coordinator')}:{PORT}", insecure=True, timeout_s=timeout_s)

    # ---- the volume --------------------------------------------------------------------------------------------

    def make_volume(self) -> None:
        """A tmpfs of ``VOLUME_BYTES`` where mounting is allowed (root), else a plain folder."""
        self.volume.mkdir()
        if os.geteuid() == 0:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME_BYTES}", "tmpfs", str(self.volume)])
            self.tmpfs = done.returncode == 0

    def release_volume(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.volume)], check=False)
            self.tmpfs = False

    # ---- processes ---------------------------------------------------------------------------------------------

    def start_coordinator(self) -> None:
        (self.work / "job.json").write_text(json.dumps(self.config.to_json()))
        self.spawn(
            "coordinator",
            _weightsync(
                "coordinator", "--insecure", "--host", self.hosts.address("coordinator"), "--port", str(PORT),
                "--volume", str(self.mount("coordinator")), "--lease-ttl", str(LEASE_TTL_S),
            ),
            "coordinator",
        )  # fmt: skip

    def start_replica(self, host: str) -> None:
        self.spawn(host, vllm_server(self.model, Channel.NCCL), f"{host}-vllm", VLLM_SERVER_DEV_MODE="1")
        self.start_agent(host)
        listen = f"{self.hosts.address(host)}:{PROXY_PORT}"
        proxy = _weightsync("proxy", "--listen", listen, "--upstream", f"http://127.0.0.1:{VLLM_PORT}")
        self.spawn(host, proxy, f"{host}-proxy")

    def start_agent(self, host: str) -> None:
        channels = {"volume": ["--channels", "volume"], "cpu": ["--nccl-domain", ""], "nccl": []}[CHANNELS[host]]
        self.spawn(
            host,
            _weightsync(
                "agent", "--vllm-url", f"http://127.0.0.1:{VLLM_PORT}", "--coordinator", f"{COORDINATOR}:{PORT}",
                "--insecure", "--replica-id", host, "--checkpoint-dir", str(self.mount(host)), "--host", f"node-{host}",
                *channels,
            ),
            f"{host}-agent",
        )  # fmt: skip

    def cut(self, host: str, peer: str) -> Callable[[], None]:
        """Drop every packet between ``host`` and ``peer`` only, silently (each side's INPUT drops the other's: no
        reset, no error; connections time out, open ones stall); both still reach every other host. Returns the
        repair."""
        rules = [(host, peer), (peer, host)]
        for on, src in rules:
            rule = ["iptables", "-I", "INPUT", "-s", self.hosts.address(src), "-j", "DROP"]
            assert self.hosts.run(on, rule).returncode == 0, f"iptables in {on} failed"

        def repair() -> None:
            for on, src in rules:
                self.hosts.run(on, ["iptables", "-D", "INPUT", "-s", self.hosts.address(src), "-j", "DROP"])

        return repair

    def refuse(self, host: str, peer: str) -> Callable[[], None]:
        """``host``'s connections to ``peer`` fail at once (an unreachable route: "No route to host"). Returns the
        repair."""
        route = ["unreachable", f"{self.hosts.address(peer)}/32"]
        assert self.hosts.run(host, ["ip", "route", "add", *route]).returncode == 0

        def repair() -> None:
            self.hosts.run(host, ["ip", "route", "del", *route])

        return repair

    def freeze_host(self, host: str, sig: int = signal.SIGSTOP) -> None:
        """Stop (or, with SIGCONT, continue) every process on ``host`` at once: a frozen VM or pod."""
        pids = subprocess.run(["ip", "netns", "pids", self.hosts.namespace(host)], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one named process (``coordinator``, ``<replica>-agent``, ...); SIGKILL also reaps it."""
        proc = self.named[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait(30)
            for procs in self.procs.values():
                if proc in procs:
                    procs.remove(proc)

    def dump_stacks(self) -> None:
        """For a failure's record: every live agent and coordinator writes its threads' stacks to its log (their
        SIGUSR1); those that exited are named with their exit codes."""
        for name, proc in self.named.items():
            if name != "coordinator" and not name.endswith("-agent"):
                continue
            if proc.poll() is not None:
                print(f"{name} exited with code {proc.returncode}")
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)

    def stop_host(self, host: str) -> None:
        """Kill every process on ``host`` at once (vLLM's engine and workers included), like a pod deleted."""
        pids = subprocess.run(["ip", "netns", "pids", self.hosts.namespace(host)], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for proc in self.procs.pop(host, []):
            proc.wait(30)

    # ---- the trainer -------------------------------------------------------------------------------------------

    def start_trainer(self, pod_ip: bool = True) -> None:
        """The trainer on its host, as a pod runs it; ``pod_ip=False`` leaves ``POD_IP`` out (a misconfigured pod)."""
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
        if not pod_ip:
            del trainer_env["POD_IP"]
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

    def kill_trainer(self) -> None:
        assert self.trainer is not None
        self.trainer.kill()
        self.trainer.wait(30)
        self.trainer = None

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

    def send(self, seed: int, lie: bool = False, stall_s: float = 0.0) -> None:
        """Ask the trainer to publish the weights of ``seed`` at the next step, without waiting for it
        (``stall_s``: its gather stalls that long after the first group, so a fault can land mid-publish)."""
        assert self.trainer is not None and self.trainer.stdin is not None
        self.step, self._seed = self.step + 1, seed
        command = {"seed": seed, "step": self.step, "lie": lie, "stall": stall_s}
        self.trainer.stdin.write(json.dumps(command) + "\n")
        self.trainer.stdin.flush()

    def report(self) -> dict[str, Any]:
        """The trainer's report of the publish ``send`` asked for."""
        report: dict[str, Any] = json.loads(self._line(600))
        if "version" in report:
            self.seeds[int(report["version"])] = self._seed
        return report

    def publish(self, seed: int, lie: bool = False) -> dict[str, Any]:
        self.send(seed, lie)
        return self.report()

    # ---- what the replicas serve -------------------------------------------------------------------------------

    def proxy(self, host: str) -> httpx.Client:
        return httpx.Client(base_url=f"http://{self.hosts.address(host)}:{PROXY_PORT}", trust_env=False)

    def engine(self, host: str) -> tuple[int, bool]:
        """The version the replica's engine says it serves, and whether it is paused (read on its own host)."""
        code = (
            "import json; from weightsync_inference.http_engine import HttpEngine; "
            f"e = HttpEngine('http://127.0.0.1:{VLLM_PORT}'); print(json.dumps([e.weight_version(), e.is_paused()]))"
        )
        done = self.hosts.run(host, _py("-c", code), capture_output=True, text=True, env=self.env(), timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        version, paused = json.loads(done.stdout.strip().splitlines()[-1])
        return (int(version) if str(version).isdigit() else 0), bool(paused)

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


@contextlib.contextmanager
def running(work: Path) -> Iterator[Fleet]:
    """The whole fleet up (every replica serving, the trainer registered); everything stopped and removed after."""
    netns.require()
    with netns.Hosts(HOSTS) as hosts:
        hosts.resolve({COORDINATOR: "coordinator"})
        fleet = Fleet(hosts, work, support.tiny_model())
        try:
            fleet.make_volume()
            fleet.start_coordinator()
            for host in REPLICAS:
                fleet.start_replica(host)
            fleet.wait_serving(REPLICAS, timeout_s=900)  # four vLLM servers starting at once on 2 cores
            fleet.start_trainer()
            yield fleet
        finally:
            if fleet.trainer is not None:
                fleet.trainer.kill()
            for name in ("trainer", "coordinator", *(f"{r}-agent" for r in REPLICAS)):
                print(f"----- {name}.log\n{fleet.tail(name)}")
            hosts.close()
            fleet.release_volume()
