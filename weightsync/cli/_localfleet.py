"""A fleet on one machine, as real processes: the coordinator and vLLM replicas with their agents.

Each replica is what a Kubernetes pod would run: a vLLM OpenAI server on a loopback
port in development mode (its weight-transfer routes reachable only here), the
``weightsync agent`` attached to it, and the ``weightsync proxy`` that exposes only the
OpenAI routes to clients. Every process reads the job's settings from one ``job.json``
(``$WEIGHTSYNC_CONFIG``), as the pods of an RLJob do. Logs go to files under the work
directory.

The coordinator is supervised, as Kubernetes would restart its pod: when it exits
without being asked to, it is started again on the same port with the same volume
(its journal), after a backoff that grows while it keeps dying. Its clients ride
through: they retry, register again and carry on from the versions it recovers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import httpx

from weightsync import jobconfig
from weightsync.coordinator import faults
from weightsync.coordinator.client import CoordinatorClient
from weightsync.vocabulary import Channel, PauseMode, SyncMode

if TYPE_CHECKING:
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import WeightSource


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
                self.popen.wait(timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout_s)
        self.log.close()


def spawn(name: str, cmd: list[str], logs: Path, env: dict[str, str] | None = None) -> Proc:
    log = (logs / f"{name}.log").open("ab")
    popen = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    return Proc(name, popen, log)


VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
"""Dev mode for the weight-transfer routes; the engine in the server's process (with the ``uni`` executor). vLLM's
default puts the engine and its worker in two more processes talking over shared-memory queues whose readers spin
for a second after every message: on a small CPU machine, two replicas' spinning starved the transfer (publish ->
READY p50 0.55-0.95 s against 0.12 s in process, tiny model, 2 cores). One OpenMP thread per replica, not pinned:
vLLM's CPU worker otherwise binds as many OpenMP threads as the machine has cores to all of them, in every replica,
and with several replicas and a trainer on the same cores each OpenMP region of a load (the loaders' copies, the
oneDNN repacking) waited for threads that were not running (the load 72 ms against 22 ms, tiny model, 2 cores)."""
WORKER_EXTENSION = "weightsync_inference.worker.WorkerExtension"
"""What the agent asks vLLM's workers through ``/collective_rpc`` (``weightsync_inference.worker``)."""


def weightsync_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightsync.cli.main", *args]


def vllm_cmd(model: Path, port: int, channel: Channel) -> list[str]:
    """A small CPU vLLM OpenAI server on loopback with the weightsync engine of ``channel`` (run it with VLLM_ENV)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--gpu-memory-utilization",
        "0.05",
        "--max-model-len",
        "256",
        "--seed",
        "0",
        "--weight-transfer-config",
        json.dumps({"backend": channel.engine_name}),
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]


@dataclass
class Replica:
    replica_id: str
    vllm_port: int
    proxy_port: int
    metrics_port: int
    served_port: int
    procs: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        """What clients use: the proxy (OpenAI routes only)."""
        return f"http://127.0.0.1:{self.proxy_port}"

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2.0, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        for proc in reversed(self.procs):
            proc.stop(sig)
        self.procs = []


@dataclass
class LocalFleet:
    workdir: Path
    model: Path
    job: str = "demo"
    coordinator_port: int = field(default_factory=free_port)
    coordinator_metrics_port: int = field(default_factory=free_port)
    lease_ttl_s: float = 4.0
    channels: tuple[Channel, ...] = (Channel.CPU, Channel.VOLUME)
    pause_mode: PauseMode = PauseMode.KEEP
    sync_mode: SyncMode = SyncMode.IN_PLACE
    all_or_nothing: bool = False
    replicas: dict[str, Replica] = field(default_factory=dict)
    coordinator: Proc | None = None
    coordinator_starts: int = 0
    """How often the coordinator was started (1 + its restarts)."""
    _stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def volume(self) -> Path:
        return self.workdir / "volume"

    @property
    def config(self) -> jobconfig.JobConfig:
        return jobconfig.JobConfig(
            self.job,
            self.channels,
            timeout_s=120.0,
            transfer_timeout_s=30.0,
            checkpoint_dir=str(self.volume),
            pause_mode=self.pause_mode,
            sync_mode=self.sync_mode,
            all_or_nothing=self.all_or_nothing,
        )

    @property
    def config_path(self) -> Path:
        return self.workdir / "job.json"

    @property
    def env(self) -> dict[str, str]:
        return {jobconfig.ENV: str(self.config_path)}

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    @property
    def coordinator_address(self) -> str:
        return f"127.0.0.1:{self.coordinator_port}"

    def start_coordinator(self) -> None:
        """Start the coordinator and the thread that restarts it whenever it dies."""
        self.volume.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps(self.config.to_json(), indent=1))
        self._spawn_coordinator()
        threading.Thread(target=self._supervise_coordinator, name="coordinator-supervisor", daemon=True).start()

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator (a crash): the supervisor starts it again."""
        if self.coordinator is not None:
            os.killpg(self.coordinator.popen.pid, signal.SIGKILL)

    def _supervise_coordinator(self) -> None:
        delay, started = 0.5, time.monotonic()
        while not self._stopping.wait(0.2):
            proc = self.coordinator
            if proc is None or proc.popen.poll() is None:
                continue
            # one that ran for a minute restarts at once; one that keeps dying later and later (up to 30 s)
            delay = 0.5 if time.monotonic() - started > 60 else delay
            print(
                f"coordinator exited with {proc.popen.returncode}; restarting it in {delay:.1f}s "
                f"(see {self.logs / 'coordinator.log'})",
                file=sys.stderr,
                flush=True,
            )
            proc.log.close()
            if self._stopping.wait(delay):
                return
            self._spawn_coordinator()
            started, delay = time.monotonic(), min(delay * 2, 30.0)

    def _spawn_coordinator(self) -> None:
        self.coordinator_starts += 1
        self.coordinator = spawn(
            "coordinator",
            weightsync_cmd(
                "coordinator",
                "--insecure",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.coordinator_port),
                "--metrics-port",
                str(self.coordinator_metrics_port),
                "--job",
                self.job,
                "--volume",
                str(self.volume),
                "--lease-ttl",
                str(self.lease_ttl_s),
            ),
            self.logs,
            self.env,
        )

    def start_replica(self, replica_id: str) -> Replica:
        old = self.replicas.get(replica_id)
        r = old or Replica(replica_id, free_port(), free_port(), free_port(), free_port())
        vllm = vllm_cmd(self.model, r.vllm_port, Channel.CPU)
        r.procs = [
            spawn(f"{replica_id}-vllm", vllm, self.logs, VLLM_ENV),
            spawn(
                f"{replica_id}-proxy",
                weightsync_cmd(
                    "proxy",
                    "--listen",
                    f"127.0.0.1:{r.proxy_port}",
                    "--upstream",
                    f"http://127.0.0.1:{r.vllm_port}",
                    "--agent",
                    f"http://127.0.0.1:{r.served_port}",
                    "--update-wait",
                    str(self.config.timeout_s),
                ),
                self.logs,
            ),
            spawn(
                f"{replica_id}-agent",
                weightsync_cmd(
                    "agent",
                    "--vllm-url",
                    f"http://127.0.0.1:{r.vllm_port}",
                    "--coordinator",
                    self.coordinator_address,
                    "--job",
                    self.job,
                    "--replica-id",
                    replica_id,
                    "--checkpoint-dir",
                    str(self.volume),
                    "--insecure",
                    "--host",
                    "localhost",
                    "--metrics-port",
                    str(r.metrics_port),
                    "--served-listen",
                    f"127.0.0.1:{r.served_port}",
                ),
                self.logs,
                self.env,
            ),
        ]
        self.replicas[replica_id] = r
        return r

    def wait_healthy(self, replicas: list[Replica], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for r in replicas:
            while not r.healthy():
                dead = [p.name for p in r.procs if p.popen.poll() is not None]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} exited; see {self.logs}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{r.replica_id} not healthy within {timeout_s:.0f}s; see {self.logs}")
                time.sleep(1.0)

    def publisher(self, source: WeightSource, timeout_s: float | None = None) -> Publisher:
        """The trainer's publisher for this fleet (one rank, on this host): its job's channels, volume and timeouts;
        ``timeout_s`` bounds a transfer (default: the job's)."""
        from weightsync_trainer.publisher import Publisher

        return Publisher(
            source,
            CoordinatorClient(self.coordinator_address, insecure=True),
            job=self.job,
            channels_=self.config.channels,
            node="localhost",
            checkpoint_dir=self.volume,
            config=self.config,
            timeout_s=self.config.transfer_timeout_s if timeout_s is None else timeout_s,
            version_timeout_s=self.config.timeout_s,
        )

    def wait_registered(self, client: CoordinatorClient, timeout_s: float) -> None:
        """Every replica's agent registered with the coordinator: a version opened before that would be planned
        for fewer replicas (or none, which fails it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if set(self.replicas) <= {m.member_id for m in client.get_job(self.job).members}:
                    return
            except faults.NotFound:  # no member registered yet: the job does not exist
                pass
            agents = [p for r in self.replicas.values() for p in r.procs if p.name.endswith("-agent")]
            if any(p.popen.poll() is not None for p in agents) or time.monotonic() > deadline:
                raise TimeoutError(
                    f"agents of {sorted(self.replicas)} not registered within {timeout_s:.0f}s\n" + self._record(agents)
                )
            time.sleep(0.5)

    def _record(self, procs: list[Proc], lines: int = 40) -> str:
        """For a failure's message: each process's exit code, or its threads' stacks (its SIGUSR1), and the end of
        its log: the fleet's logs live in a temporary directory a CI run does not keep."""
        for p in procs:
            if p.popen.poll() is None:
                os.kill(p.popen.pid, signal.SIGUSR1)
        time.sleep(1.0)
        parts = []
        for p in procs:
            state = "running" if p.popen.poll() is None else f"exited with code {p.popen.returncode}"
            tail = (self.logs / f"{p.name}.log").read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {p.name} ({state}), its log's last {len(tail)} lines:\n" + "\n".join(tail))
        return "\n".join(parts)

    def stop(self) -> None:
        self._stopping.set()
        for r in self.replicas.values():
            r.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
