"""One faulty replica against a fault-free fleet: when the healthy replicas load a version, with the ratio.

    .venv/bin/python bench/fault_isolation.py --light 16 32 64 [--json out.json]   # lightweight replicas, loopback
    .venv/bin/python bench/fault_isolation.py --fleet [--json out.json]            # 4 real vLLM CPU replicas, netns

For each fleet, first a fault-free version, then one version per fault with exactly one replica faulty;
each time the trainer's gather stalls ``STALL_S`` after its first group (so a fault lands mid-version),
and the time that counts is publish -> each healthy replica's ack (LOADED), read from the coordinator every
0.1 s. The table gives the slowest healthy replica against the fault-free slowest, their ratio, and the goal
(1.2x the fault-free time plus the join deadline), and where the faulty one ended (light: its channel in the
publisher's report, or dropped; fleet: its channel and state as the coordinator records that version, once the
fleet converged after the fault).

``--light N``: N lightweight replicas on loopback: real coordinator (its own process), real ``Publisher`` (this
process; the CPU stream and the volume), and replicas that are real clients with real CPU-stream receivers
(gloo) and volume receivers, acking the digests they computed, but no engine: they keep the bytes. Several
share a process (``--per-process``); the faulty one has a process of its own. Faults:

- ``unreachable``: the faulty replica's route to the trainer drops its packets: its receiver dials a tarpit
  (a socket that accepts and never answers), as a silent drop looks to the receiver; its agent restarted
  first, so the version forms a new group with it;
- ``refused``: the same with a port nobody listens on (the connection is refused at once);
- ``frozen``: its process stopped (SIGSTOP) once it joined, mid-version;
- ``killed``: its process killed (SIGKILL) once it joined, mid-version.

``--fleet``: tests.hostfleet's fleet (needs root for network namespaces): two NCCL replicas over gloo, one
CPU, one volume, real vLLM CPU engines; the faults of ``tests.isolation``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOB = "isolation"
STALL_S = 1.0
JOIN_S = 5.0
"""The light fleet's join deadline (the job's ``joinTimeoutSeconds``)."""
TRANSFER_S = 60.0
LEASE_TTL_S = 5.0
GROUPS, ROWS = 8, 256
"""The light fleet's model: 8 groups of two 256x1024 bf16 tensors (1 MiB a group)."""
LIGHT_FAULTS = ("unreachable", "refused", "frozen", "killed")


# ---- the lightweight replicas -----------------------------------------------------------------------------------


def _tarpit() -> tuple[socket.socket, int]:
    """A listening socket that never accepts: a connection to it completes and then hears nothing."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1024)
    return s, int(s.getsockname()[1])


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _replica(target: str, rid: str, volume: str, redirect: int, ready: Any) -> None:
    """One lightweight replica: register, follow the watch stream, receive each version and ack what it computed.
    ``redirect`` > 0: its receiver dials that port instead of the trainer's (a route that drops or refuses)."""
    import dataclasses

    from weightsync import channels
    from weightsync.channels.base import Endpoint, Receiver, Rendezvous, UpdateTicket, WorkerContext
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.coordinator.models import AckReport, Capabilities, EventKind
    from weightsync.errors import WeightsyncError
    from weightsync.tensors import content_digest
    from weightsync.vocabulary import Channel

    caps = Capabilities(host="bench", channels=(Channel.CPU, Channel.VOLUME), volume_id=JOB, volume_mount=volume)
    for ch in caps.channels:  # imported (torch with them) before it registers, as an agent's engine is up by then
        channels.receiver_class(ch)
    client = CoordinatorClient(target, insecure=True, timeout_s=30)
    client.register_replica(JOB, rid, caps)
    ready.put(rid)
    joined: dict[Channel, tuple[Rendezvous, Receiver]] = {}
    for a in client.watch():
        if a.kind not in (EventKind.ASSIGN, EventKind.CATCH_UP) or a.plan is None or a.table is None:
            continue
        plan, live = a.plan, a.plan.channel is not Channel.VOLUME
        try:
            rdv = plan.rendezvous.with_timeout(TRANSFER_S)
            held = joined.get(plan.channel)
            if held is None or not rdv.same_membership(held[0]) or not live:
                if held is not None:
                    held[1].close()
                if redirect and live and rdv.endpoint is not None:
                    rdv = dataclasses.replace(rdv, endpoint=Endpoint(rdv.endpoint.host, redirect))
                joined[plan.channel] = (rdv, channels.receiver_class(plan.channel).start(rdv, WorkerContext()))
            receiver = joined[plan.channel][1]
            if live:
                client.report_joined(a.version)
            ticket = UpdateTicket(
                a.version,
                plan.channel,
                layout_digest=a.table.layout_digest,
                manifest_checksum=plan.manifest_checksum,
                timeout_s=TRANSFER_S,
                root=rdv.root if not live else "",
            )
            for _ in receiver.receive(ticket):
                pass
            client.ack(AckReport(a.version, a.table.layout_digest, content_digest=content_digest(receiver.verified)))
        except WeightsyncError as e:
            joined.pop(plan.channel, None)
            client.ack(AckReport(a.version, a.table.layout_digest, ok=False, error=str(e), channel_failed=live))


def _replicas(target: str, ids: list[str], volume: str, redirect: int, ready: Any) -> None:
    threads = [threading.Thread(target=_replica, args=(target, r, volume, redirect, ready), daemon=True) for r in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class LightFleet:
    """A coordinator, N lightweight replicas (``per_process`` a process; ``faulty`` alone in one), a publisher."""

    def __init__(self, n: int, per_process: int, work: Path) -> None:
        from weightsync.jobconfig import JobConfig
        from weightsync.vocabulary import Channel

        self.work, self.ctx = work, mp.get_context("spawn")
        self.ready = self.ctx.Queue()
        self.coordinator, self.target = _coordinator()
        self.ids = [f"r{i:03d}" for i in range(n)]
        self.faulty = self.ids[-1]
        self.procs: list[Any] = []
        healthy = self.ids[:-1]
        for i in range(0, len(healthy), per_process):
            self._start(healthy[i : i + per_process], 0)
        self.faulty_proc = self._start([self.faulty], 0)
        for _ in self.ids:
            self.ready.get(timeout=600)
        config = JobConfig(
            JOB, (Channel.CPU, Channel.VOLUME), timeout_s=300, transfer_timeout_s=TRANSFER_S, join_timeout_s=JOIN_S,
            checkpoint_dir=str(work / "volume"),
        )  # fmt: skip
        self.publisher, self.source = _publisher(self.target, config)
        self.step = 0

    def _start(self, ids: list[str], redirect: int) -> Any:
        volume = str(self.work / "volume")
        p = self.ctx.Process(target=_replicas, args=(self.target, ids, volume, redirect, self.ready), daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def restart_faulty(self, redirect: int) -> None:
        """The faulty replica's process again (a new incarnation: the next version forms a new group with it)."""
        self.faulty_proc.kill()
        self.faulty_proc.join()
        _wait_gone(self.target, self.faulty)
        self.faulty_proc = self._start([self.faulty], redirect)
        self.ready.get(timeout=300)

    def publish(self, inject: Any = None) -> tuple[Any, dict[str, float]]:
        """One version (its gather stalled after the first group; ``inject()`` once the live replicas joined)."""
        self.step += 1
        from tests.isolation import Loads
        from weightsync.coordinator.client import CoordinatorClient

        newest = self.publisher.client.list_versions(limit=1)
        after = newest[0].version if newest else 0
        loads = Loads(CoordinatorClient(self.target, insecure=True, timeout_s=30), JOB, after)
        if inject is not None:
            threading.Thread(target=_when_joined, args=(self.target, loads.after, inject), daemon=True).start()
        try:
            report = self.publisher.publish(self.step)
        finally:
            loads.stop()
        return report, loads.at

    def close(self) -> None:
        self.publisher.close()
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.kill()
        self.coordinator.kill()
        self.coordinator.wait(10)


def _coordinator() -> tuple[subprocess.Popen[str], str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    argv = [sys.executable, "-m", "weightsync.cli.main", "coordinator", "--insecure", "--port", str(port), "--json",
            "--lease-ttl", str(LEASE_TTL_S), "--max-workers", "1024"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["target"]


def _publisher(target: str, config: Any) -> tuple[Any, Any]:
    import torch

    from weightsync.coordinator.client import CoordinatorClient
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, ROWS, bias=False) for _ in range(2 * GROUPS)]).bfloat16()
    source = ModuleSource(model)
    gather = source.groups

    def stalled() -> Iterator[Any]:
        for i, group in enumerate(gather()):
            if i == 1:
                time.sleep(STALL_S)
            yield group

    source.groups = stalled  # type: ignore[method-assign]
    client = CoordinatorClient(target, insecure=True, timeout_s=30)
    pub = Publisher(
        source, client, job=JOB, channels_=config.channels, node="bench", checkpoint_dir=config.checkpoint_dir,
        config=config, timeout_s=config.transfer_timeout_s, version_timeout_s=config.timeout_s,
    )  # fmt: skip
    return pub, source


def _wait_gone(target: str, rid: str) -> None:
    from weightsync.coordinator.client import CoordinatorClient

    with CoordinatorClient(target, insecure=True, timeout_s=30) as c:
        deadline = time.monotonic() + 60
        while any(m.member_id == rid for m in c.get_job(JOB).members):
            assert time.monotonic() < deadline, f"{rid} was not forgotten"
            time.sleep(0.2)


def _when_joined(target: str, after: int, inject: Any) -> None:
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.vocabulary import ReplicaState

    with CoordinatorClient(target, insecure=True, timeout_s=30) as c:
        while True:
            versions = c.list_versions(JOB, limit=1)
            if versions and versions[0].version > after:
                live = [r for r in versions[0].replicas if r.channel is not None and r.channel.value != "volume"]
                if live and all(r.state is ReplicaState.JOINED for r in live):
                    break
            time.sleep(0.02)
    time.sleep(0.3)  # the first group goes out
    inject()


def light(n: int, per_process: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fault-isolation-") as tmp:
        fleet = LightFleet(n, per_process, Path(tmp))
        tarpit, tarpit_port = _tarpit()
        try:
            fleet.publish()  # every group formed
            report, base = fleet.publish()
            healthy = [r for r in fleet.ids if r != fleet.faulty]
            base_worst = max(base[r] for r in healthy)
            rows.append(_row(n, "none", report, base, healthy, base_worst, fleet.faulty))
            for fault in LIGHT_FAULTS:
                inject = None
                if fault in ("unreachable", "refused"):
                    fleet.restart_faulty(tarpit_port if fault == "unreachable" else _closed_port())
                elif fault == "frozen":
                    inject = lambda: os.kill(fleet.faulty_proc.pid, signal.SIGSTOP)  # noqa: E731
                else:
                    inject = lambda: os.kill(fleet.faulty_proc.pid, signal.SIGKILL)  # noqa: E731
                report, at = fleet.publish(inject)
                rows.append(_row(n, fault, report, at, healthy, base_worst, fleet.faulty))
                print(json.dumps(rows[-1]), flush=True)
                if fault in ("frozen", "killed", "unreachable", "refused"):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(fleet.faulty_proc.pid, signal.SIGCONT)
                    fleet.restart_faulty(0)
                    fleet.publish()  # the replica back, its group formed again
        finally:
            tarpit.close()
            fleet.close()
    return rows


def _row(
    n: int, fault: str, report: Any, at: dict[str, float], healthy: list[str], base: float, faulty: str
) -> dict[str, Any]:
    missing = [r for r in healthy if r not in at]
    worst = max((at[r] for r in healthy if r in at), default=float("nan"))
    goal = 1.2 * base + (JOIN_S if fault != "none" else 0.0)
    return {
        "replicas": n,
        "fault": fault,
        "healthy_slowest_s": round(worst, 2),
        "fault_free_s": round(base, 2),
        "ratio": round(worst / base, 2),
        "goal_s": round(goal, 2),
        "within_goal": worst <= goal and not missing,
        "healthy_missing": missing,
        "faulty_ended": report.channels.get(faulty, "dropped"),
        "state": report.state.value,
    }


# ---- the real fleet -----------------------------------------------------------------------------------------------


def fleet_mode() -> list[dict[str, Any]]:
    from tests import faultrun, hostfleet, isolation

    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="fault-isolation-fleet-") as tmp,
        hostfleet.running(Path(tmp)) as fleet,
        fleet.client(timeout_s=30) as client,
    ):
        run = faultrun.Run(fleet, client, {})
        run.cleared()
        faultrun.converge(run)
        report, loads = isolation.timed(run)
        base = dict(loads.at)
        for name, fault in isolation.FAULTS.items():
            faultrun.on_their_channels(run)  # the last fault's replica back on its channel
            faulty, report, loads = fault(run)
            faultrun.converge(run)  # the faulty replica back: what it did with the version is on record
            info = client.version_info(report["version"], job=hostfleet.JOB)
            ended = next((r for r in info.replicas if r.replica_id == faulty), None)
            where = "-" if ended is None or ended.channel is None else ended.channel.value
            healthy = [r for r in hostfleet.REPLICAS if r != faulty]
            worst = max(loads.at.get(r, float("inf")) for r in healthy)
            fault_free = max(base[r] for r in healthy)
            row = {
                "replicas": len(hostfleet.REPLICAS),
                "fault": name,
                "faulty": faulty,
                "healthy_slowest_s": round(worst, 2),
                "fault_free_s": round(fault_free, 2),
                "ratio": round(worst / fault_free, 2),
                "goal_s": round(1.2 * fault_free + isolation.JOIN_S, 2),
                "faulty_ended": "dropped" if ended is None else f"{where} {ended.state.value}",
                "state": report["state"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| replicas | fault | healthy, slowest (s) | fault-free (s) | ratio | goal (s) | faulty ended on | state |",
        "|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['replicas']} | {r['fault']} | {r['healthy_slowest_s']} | {r['fault_free_s']} | {r['ratio']} | "
            f"{r['goal_s']} | {r['faulty_ended']} | {r['state']} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--light", type=int, nargs="*", default=[], help="fleet sizes of lightweight replicas")
    p.add_argument("--per-process", type=int, default=8, help="lightweight replicas per process")
    p.add_argument("--fleet", action="store_true", help="the 4 real vLLM CPU replicas of tests.hostfleet (root)")
    p.add_argument("--json", default="", help="write every row here")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for n in args.light:
        rows += light(n, args.per_process)
    if args.fleet:
        rows += fleet_mode()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
