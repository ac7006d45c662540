"""One replica's fault on the host fleet, timed: the faults of issue 25 and how the others' loads are measured.

Shared by the isolation suite (``tests/integration/test_fleet_hosts_isolation.py``, which checks the
bounds) and its benchmark (``bench/fault_isolation.py --fleet``, which prints the ratios). Each fault
hits one replica of ``tests.hostfleet``'s fleet while a version goes out, the trainer's gather stalled
``STALL_S`` after its first group (so a fault lands mid-version); ``Loads`` records when each replica's
ack arrived, from the test's host.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from tests import faultrun
from tests.hostfleet import JOB
from weightsync.coordinator.client import CoordinatorClient
from weightsync.errors import WeightsyncError
from weightsync.jobconfig import DEFAULT_JOIN_TIMEOUT_S
from weightsync.vocabulary import ReplicaState

JOIN_S = DEFAULT_JOIN_TIMEOUT_S
"""The fleet's join deadline (the job's default)."""
STALL_S = 2.0
SLACK_S = 3.0
"""Allowed beyond the bound for scheduling noise on a loaded 2-core machine."""


class Loads:
    """When each replica's ack of the next version (after ``after``) arrived, in seconds from the start, read from
    the coordinator every 0.1 s on ``client`` (a client of its own: the reads run on a thread)."""

    def __init__(self, client: CoordinatorClient, job: str, after: int) -> None:
        self.client, self.job, self.after, self.t0 = client, job, after, time.monotonic()
        self.at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loads", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(WeightsyncError, IndexError):
            info = self.client.list_versions(self.job, limit=1)[0]
            now = time.monotonic() - self.t0
            if info.version > self.after:
                for r in info.replicas:
                    if r.state is ReplicaState.LOADED:
                        self.at.setdefault(r.replica_id, now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(0.1)

    def stop(self) -> None:
        """Stop reading (after one last read: an ack that came with the verdict counts at the verdict's time), and
        close the client."""
        self._stop.set()
        self._thread.join()
        self._read()
        self.client.close()


def timed(run: faultrun.Run, fault: Callable[[], None] | None = None) -> tuple[dict[str, Any], Loads]:
    """One publish with its gather stalled after the first group; ``fault`` lands once the live replicas joined,
    while the version streams."""
    before = run.client.list_versions(JOB, limit=1)[0].version
    loads = Loads(run.fleet.client(timeout_s=10), JOB, before)
    seed = run.send(STALL_S)
    if fault is not None:

        def joined() -> bool:
            info = run.client.list_versions(JOB, limit=1)[0]
            live = [r for r in info.replicas if r.channel is not None and r.channel.value != "volume"]
            return info.version > before and bool(live) and all(r.state is ReplicaState.JOINED for r in live)

        faultrun.wait("the replicas joined the new version", joined, 60)
        time.sleep(0.5)  # the first group goes out and lands
        fault()
    try:
        return run.report(seed), loads
    finally:
        loads.stop()


def restart_agent(run: faultrun.Run, host: str) -> None:
    """A new incarnation of ``host``'s agent: the next version forms a new group with it (it must join)."""
    run.fleet.kill(f"{host}-agent")
    faultrun.wait(f"{host} forgotten", lambda: host not in faultrun.members(run.client), 30)
    run.fleet.start_agent(host)
    faultrun.wait(f"{host} registered again", lambda: host in faultrun.members(run.client), 120)


# ---- the faults: each returns the faulty replica and the publish it hit --------------------------------------------

Fault = Callable[[faultrun.Run], tuple[str, dict[str, Any], Loads]]


def at_join(host: str, refuse: bool) -> Fault:
    """``host`` joins a new group (its agent restarted) while its route to the trainer drops every packet, or
    (``refuse``) refuses at once."""

    def inject(run: faultrun.Run) -> tuple[str, dict[str, Any], Loads]:
        restart_agent(run, host)
        repair = run.fleet.refuse(host, "trainer") if refuse else run.fleet.cut(host, "trainer")
        try:
            report, loads = timed(run)
        finally:
            repair()
        run.cleared()
        return host, report, loads

    return inject


def frozen_mid_transfer(run: faultrun.Run) -> tuple[str, dict[str, Any], Loads]:
    host = "replica-nccl"
    try:
        report, loads = timed(run, lambda: run.fleet.freeze_host(host))
    finally:
        run.fleet.freeze_host(host, signal.SIGCONT)
    run.cleared()
    return host, report, loads


def killed_mid_transfer(run: faultrun.Run) -> tuple[str, dict[str, Any], Loads]:
    host = "replica-nccl"
    report, loads = timed(run, lambda: run.fleet.stop_host(host))
    run.fleet.start_replica(host)
    run.fleet.wait_serving((host,))
    run.cleared()
    return host, report, loads


def partition_after_join(run: faultrun.Run) -> tuple[str, dict[str, Any], Loads]:
    host = "replica-nccl-2"
    repairs: list[Callable[[], None]] = []
    try:
        report, loads = timed(run, lambda: repairs.append(run.fleet.cut(host, "trainer")))
    finally:
        for repair in repairs:
            repair()
    run.cleared()
    return host, report, loads


FAULTS: dict[str, Fault] = {
    "join-dropped": at_join("replica-nccl", refuse=False),
    "join-refused": at_join("replica-cpu", refuse=True),
    "frozen-mid-transfer": frozen_mid_transfer,
    "killed-mid-transfer": killed_mid_transfer,
    "partition-after-join": partition_after_join,
}
