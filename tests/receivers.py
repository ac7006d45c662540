"""Receiver processes for channel tests: started first, joining only when told, so a join deadline is fair.

Each is ``python -m tests.integration.procs receive`` (a CPU-stream or NCCL receiver on the CPU,
in its own process, the rendezvous as JSON): it imports torch and warms its kernels, writes
``<id>.ready`` and waits for the ``go`` file; the test plans the group, then writes ``go``, so
the join deadline counts the join and not a loaded machine's start-up. A receiver writes
``<id>.joined`` once its group formed and its digests (or ``{"error": ...}`` when it was left
out) to ``<id>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import netns
from weightsync.channels import nccl
from weightsync.channels.base import Rendezvous

ROOT = Path(__file__).resolve().parents[1]
START_S = 300.0
"""How long the processes may take to start (several importing torch on a loaded 2-core machine)."""


class Receivers:
    """One receiver process per replica of ``plan``; ``die_after`` makes one exit hard after that many groups;
    with ``hosts`` each runs on the host (network namespace) named after its replica."""

    def __init__(
        self,
        work: Path,
        plan: dict[str, Rendezvous],
        layout: str,
        die_after: dict[str, int] | None = None,
        hosts: netns.Hosts | None = None,
    ) -> None:
        self.work, self.go, self.hosts = work, work / "go", hosts
        work.mkdir(parents=True, exist_ok=True)
        self.procs = {rid: self._start(rid, rdv, layout, (die_after or {}).get(rid)) for rid, rdv in plan.items()}

    def _start(self, rid: str, rdv: Rendezvous, layout: str, die_after: int | None) -> subprocess.Popen[bytes]:
        files = {f"--{what}": str(self.work / f"{rid}.{what}") for what in ("joined", "ready")}
        argv = [
            *(sys.executable, "-m", "tests.integration.procs", "receive", "--version", "1"),
            *("--rendezvous", json.dumps(rdv.to_dict()), "--layout-digest", layout, "--go", str(self.go)),
            *("--out", str(self.work / f"{rid}.json"), *(x for kv in files.items() for x in kv)),
            *(("--die-after", str(die_after)) if die_after is not None else ()),
        ]
        env = {**os.environ, nccl.TRANSPORT_ENV: "gloo"}
        if self.hosts is not None:
            return self.hosts.popen(rid, argv, cwd=ROOT, env=env)
        return subprocess.Popen(argv, cwd=ROOT, env=env)

    def started(self) -> None:
        """Wait until every process is up and waiting for ``go``."""
        deadline = time.monotonic() + START_S
        while not all((self.work / f"{rid}.ready").exists() for rid in self.procs):
            dead = [rid for rid, p in self.procs.items() if p.poll() is not None]
            assert not dead, f"receivers {dead} exited before they were ready"
            assert time.monotonic() < deadline, "the receivers did not start"
            time.sleep(0.05)

    def start_joining(self) -> None:
        self.go.write_text("")

    def joined(self, *rids: str) -> None:
        deadline = time.monotonic() + 60
        while not all((self.work / f"{rid}.joined").exists() for rid in rids):
            assert time.monotonic() < deadline, "the receivers did not join"
            time.sleep(0.02)

    def result(self, rid: str, code: int | None = None) -> dict[str, str]:
        """What receiver ``rid`` wrote (its digests, or the error that left it out), once it exited."""
        returned = self.procs[rid].wait(timeout=120)
        assert returned in ((0, 3) if code is None else (code,)), f"receiver {rid} exited {returned}"
        out: dict[str, str] = json.loads((self.work / f"{rid}.json").read_text())
        return out

    def close(self) -> None:
        for p in self.procs.values():
            p.send_signal(signal.SIGCONT)
            p.kill()
