"""The GPU fleet end to end on the GPU host: coordinator, Publisher, agents, GPU channels, bit-exact parameters.

Real processes: the coordinator (``weightsync coordinator``), the trainer
(tests/gpu/fleet_trainer.py: the real ``Publisher`` on GPU 0 with a Qwen3-1.7B-sized table),
and replicas, each the real ``Agent`` driving the GPU harness (tests/gpu/harness.py: the
plugin's own ``Updater`` over vLLM-layout parameters, since vLLM's GPU build cannot be
installed on the GPU host; its vLLM wrapper is covered by the CPU integration tests):

- ``r-ipc`` on GPU 0, the trainer's GPU and node: CUDA IPC;
- ``r-nccl`` on GPU 1 in the trainer's NCCL domain: NCCL;
- ``r-nixl`` on GPU 1 with NIXL importable and no NCCL domain: NIXL (skipped with the reason
  when the ``nixl`` package is not importable);
- ``r-late``, joining after v3: over NCCL on a third GPU, or over IPC on GPU 0 on a 2-GPU host
  (NCCL takes one rank per GPU, and the coordinator plans accordingly).

A version is READY only when every replica's engine holds it: the test compares the
digests of each replica's *parameters* (fused q/k/v and gate/up rows included) with the
trainer's per-tensor digests, bit for bit. Then ``r-nccl`` is killed as a version's transfer
starts: that version still goes READY for the others, and the restarted replica loads the
same version from the volume; a replica joining late catches up from the volume and then
follows live.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
JOB = "gpu-fleet"
HAVE_NIXL = importlib.util.find_spec("nixl") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GpuFleet:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.volume = work / "volume"
        self.volume.mkdir()
        self.out = work / "out"
        self.out.mkdir()
        self.port = _free_port()
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "trainer"),
                    str(ROOT / "inference"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        self.trainer: subprocess.Popen[str] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[Any]:
        log = (self.work / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        self.procs[name] = proc
        return proc

    def start_coordinator(self) -> None:
        config = {"job": JOB, "sync": {"channels": ["ipc", "nccl", "nixl", "volume"], "timeoutSeconds": 300,
                  "transferTimeoutSeconds": 30, "retention": 3}}  # fmt: skip
        (self.work / "job.json").write_text(json.dumps(config))
        self.spawn(
            "coordinator",
            [sys.executable, "-m", "weightsync.cli.main", "coordinator", "--insecure", "--port", str(self.port),
             "--job-config", str(self.work / "job.json"), "--volume", str(self.volume), "--lease-ttl", "4"],
        )  # fmt: skip

    def start_replica(self, rid: str, device: str, channels: str, domain: str = "", die_in: int = 0) -> None:
        argv = [sys.executable, "-m", "tests.gpu.harness", "--coordinator", self.target, "--job", JOB,
                "--replica-id", rid, "--device", device, "--channels", channels, "--nccl-domain", domain,
                "--volume", str(self.volume), "--out", str(self.out), "--timeout", "30"]  # fmt: skip
        if die_in:
            argv += ["--die-in-version", str(die_in)]
        self.spawn(rid, argv)

    def wait_registered(self, replicas: list[str], timeout_s: float = 180) -> None:
        from weightsync.coordinator.client import CoordinatorClient

        with CoordinatorClient(self.target, insecure=True) as client:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    members = {m.member_id for m in client.get_job(JOB).members}
                except Exception:  # noqa: BLE001 - the coordinator may still be starting
                    members = set()
                if set(replicas) <= members:
                    return
                for rid in ["coordinator", *replicas]:
                    proc = self.procs.get(rid)
                    assert proc is None or proc.poll() is None, f"{rid} exited: {self.tail(rid)}"
                assert time.monotonic() < deadline, f"{replicas} not registered: {members}"
                time.sleep(0.5)

    def start_trainer(self) -> None:
        argv = [sys.executable, "-m", "tests.gpu.fleet_trainer", "--coordinator", self.target, "--job", JOB,
                "--device", "cuda:0", "--channels", "ipc,nccl,nixl,volume", "--nccl-domain", "fabric",
                "--volume", str(self.volume), "--timeout", "30"]  # fmt: skip
        self.trainer = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(self.work / "trainer.log").open("ab"),
            env=self.env,
            cwd=ROOT,
            text=True,
        )
        assert json.loads(self._line(300))["ready"]

    def _line(self, timeout_s: float) -> str:
        assert self.trainer is not None and self.trainer.stdout is not None
        while True:  # libraries (NIXL) log to stdout too: answers are the JSON lines
            line = self.trainer.stdout.readline()
            if not line:
                raise AssertionError(f"the trainer exited {self.trainer.poll()}: {self.tail('trainer')}")
            if line.startswith("{"):
                return line

    def publish(self, seed: int, step: int) -> dict[str, Any]:
        assert self.trainer is not None and self.trainer.stdin is not None
        self.trainer.stdin.write(json.dumps({"seed": seed, "step": step}) + "\n")
        self.trainer.stdin.flush()
        report: dict[str, Any] = json.loads(self._line(600))
        return report

    def parameters(self, rid: str, version: int, timeout_s: float = 120) -> dict[str, Any]:
        """The replica's record of its parameters after it loaded ``version``."""
        path = self.out / f"{rid}.json"
        deadline = time.monotonic() + timeout_s
        while True:
            if path.exists():
                record: dict[str, Any] = json.loads(path.read_text())
                if record["version"] >= version:
                    return record
            assert time.monotonic() < deadline, f"{rid} never recorded v{version}: {self.tail(rid)}"
            time.sleep(0.2)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(30)

    def tail(self, name: str) -> str:
        path = self.work / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.kill()
        for proc in self.procs.values():
            proc.kill()
        for name in ("coordinator", "trainer", *self.procs):
            print(f"----- {name}\n{self.tail(name)}")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[GpuFleet]:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"the GPU fleet needs 2 GPUs (trainer + replicas); this host has {torch.cuda.device_count()}")
    f = GpuFleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


def _assert_bit_exact(fleet: GpuFleet, rid: str, report: dict[str, Any]) -> dict[str, Any]:
    record = fleet.parameters(rid, report["version"])
    assert record["version"] == report["version"], (rid, record["version"])
    assert record["param_digests"] == report["digests"], f"{rid}: its parameters differ from the trainer's"
    return record


def test_gpu_fleet_channels_fallback_and_late_joiner(fleet: GpuFleet) -> None:
    replicas = {"r-ipc": "ipc", "r-nccl": "nccl", **({"r-nixl": "nixl"} if HAVE_NIXL else {})}
    fleet.start_coordinator()
    fleet.start_replica("r-ipc", "cuda:0", "ipc,volume")
    fleet.start_replica("r-nccl", "cuda:1", "nccl,volume", domain="fabric", die_in=3)
    if HAVE_NIXL:
        fleet.start_replica("r-nixl", "cuda:1", "nixl,volume")
    fleet.wait_registered(list(replicas))
    fleet.start_trainer()

    for version, seed in ((1, 11), (2, 12)):
        report = fleet.publish(seed, step=version)
        assert report["state"] == "READY", report
        assert {r: report["channels"][r] for r in replicas} == replicas, report["channels"]
        for rid in replicas:
            record = _assert_bit_exact(fleet, rid, report)
            assert record["in_place"] == len(report["digests"]), f"{rid}: not every tensor landed in place"

    # r-nccl dies as v3's transfer starts: v3 goes READY for the others (its lease expires: dropped)
    report = fleet.publish(13, step=3)
    assert report["state"] == "READY" and "r-nccl" in report["failed"], report
    for rid in ("r-ipc", *(["r-nixl"] if HAVE_NIXL else [])):
        _assert_bit_exact(fleet, rid, report)
    fleet.procs.pop("r-nccl").wait(30)
    fleet.start_replica("r-nccl", "cuda:1", "nccl,volume", domain="fabric")
    _assert_bit_exact(fleet, "r-nccl", report)  # the same version, from the volume (catch-up)

    # a fresh replica joins late: it catches up from the volume, then follows live. NCCL takes one rank per GPU,
    # so on a 2-GPU host (trainer on GPU 0, r-nccl on GPU 1) it joins on GPU 0 over IPC; with a third GPU, NCCL.
    import torch

    late = ("cuda:2", "nccl") if torch.cuda.device_count() >= 3 else ("cuda:0", "ipc")
    fleet.start_replica("r-late", late[0], f"{late[1]},volume", domain="fabric")
    _assert_bit_exact(fleet, "r-late", report)
    report = fleet.publish(14, step=4)
    assert report["state"] == "READY", report
    assert report["channels"]["r-late"] == late[1] and report["channels"]["r-nccl"] == "nccl", report["channels"]
    for rid in (*replicas, "r-late"):
        _assert_bit_exact(fleet, rid, report)
