"""One fault's run on the host fleet: its publishes, what they showed, convergence, and the invariants after it.

Shared by the fault suites on ``tests.hostfleet`` (``test_fleet_hosts_faults``: crashes, partitions,
storage; ``test_fleet_hosts_isolation``: one replica's fault stays its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.hostfleet import CHANNELS, JOB, LEASE_TTL_S, REPLICAS, Fleet
from weightsync.channels import manifests
from weightsync.channels.volume import verify_version
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.jobs import FAILED_CHANNEL_RETRY_S
from weightsync.vocabulary import ReplicaState, VersionState


@dataclass
class Run:
    """One fault's run: its publishes, what they showed, and when the fault was cleared."""

    fleet: Fleet
    client: CoordinatorClient
    seeds: dict[int, int]
    """Version -> the seed of its weights, for every version the suite published (shared across faults)."""
    failed: list[int] = field(default_factory=list)
    cleared_at: float = 0.0
    problems: list[str] = field(default_factory=list)

    def send(self, stall_s: float = 0.0) -> int:
        seed = 1000 + self.fleet.step + 1
        self.fleet.send(seed, stall_s=stall_s)
        return seed

    def mid_publish(self, stall_s: float) -> int:
        """Start a publish whose gather stalls after its first group; return once the replicas joined it (its
        first bytes are on their way into their engines), with the version number."""
        newest = self.client.list_versions(JOB, limit=1)[0].version
        self.send(stall_s)

        def joined() -> bool:
            info = self.client.list_versions(JOB, limit=1)[0]
            live = [r for r in info.replicas if r.channel is not None and r.channel.value != "volume"]
            return info.version > newest and bool(live) and all(r.state is ReplicaState.JOINED for r in live)

        wait("the replicas joined the new version", joined, 60)
        time.sleep(0.5)  # the first group goes out and lands
        return self.client.list_versions(JOB, limit=1)[0].version

    def report(self, seed: int) -> dict[str, Any]:
        report = self.fleet.report()
        version = report["version"]
        if version:
            self.seeds[version] = seed
            info = self.client.version_info(version, job=JOB)
            if info.state is VersionState.FAILED:
                self.failed.append(version)
            loaded = [r.replica_id for r in info.replicas if r.state is ReplicaState.LOADED]
            if info.state is VersionState.READY and not loaded:
                self.problems.append(f"v{version} went READY with no replica loaded: {info.reason}")
        return report

    def publish(self) -> dict[str, Any]:
        return self.report(self.send())

    def cleared(self) -> None:
        self.cleared_at = time.monotonic()


def members(client: CoordinatorClient) -> dict[str, int]:
    return {m.member_id: m.current_version for m in client.get_job(JOB).members if m.role.value == "replica"}


def wait(what: str, done: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f}s"
        time.sleep(0.25)


def converge(run: Run) -> tuple[float, float, dict[str, Any]]:
    """Publish until a version is READY, then wait until every replica serves the newest READY version.

    Returns the time from the fault's clearing to convergence, its bound (two lease TTLs plus the
    transfer of the version converged to), and the report of that version's publish."""
    tried: list[str] = []
    for _ in range(3):
        report = run.publish()
        if report["state"] == VersionState.READY.value:
            break
        tried.append(f"v{report['version']} {report['state']}: {report['reason']}")
    else:
        raise AssertionError(f"no version READY after the fault cleared: {tried}")
    target, bound = report["version"], 2 * LEASE_TTL_S + report["seconds"].get("total", 0.0)

    def converged() -> bool:
        newest = run.client.get_job(JOB).newest_ready
        served = members(run.client)
        return newest >= target and set(served) == set(REPLICAS) and set(served.values()) == {newest}

    deadline = time.monotonic() + 300
    while not converged():
        if time.monotonic() > deadline:
            run.fleet.dump_stacks()
            raise AssertionError(
                f"not converged: newest READY {run.client.get_job(JOB).newest_ready}, {members(run.client)} "
                f"(every agent's and the coordinator's threads are in their logs under {run.fleet.work})"
            )
        time.sleep(0.25)
    return time.monotonic() - run.cleared_at, bound, report


def on_their_channels(run: Run) -> None:
    """Publish until one version plans every replica on its own channel, then converge: a fault keeps its replica
    off its channel for a while (``FAILED_CHANNEL_RETRY_S``, as it should), which must not count against the next
    fault's healthy replicas. Each publish waits a few seconds; the backoff ends within its first wait."""
    deadline = time.monotonic() + 2 * FAILED_CHANNEL_RETRY_S + 30
    while True:
        report = run.publish()
        if report["state"] == VersionState.READY.value and report["channels"] == CHANNELS:
            break
        assert time.monotonic() < deadline, f"no version on every replica's channel: {report['channels']}"
        time.sleep(5)
    run.cleared()
    converge(run)


def check_invariants(run: Run) -> None:
    fleet, client = run.fleet, run.client
    job = client.get_job(JOB)
    reported = members(client)
    for host in REPLICAS:
        version, paused = fleet.engine(host)
        if paused:
            run.problems.append(f"{host}'s engine is left paused")
        if reported.get(host) != version:
            run.problems.append(f"{host}: the coordinator has v{reported.get(host)}, its engine serves v{version}")
        if version not in run.seeds:
            run.problems.append(f"{host} serves v{version}, which the suite did not publish")
            continue
        try:
            fleet.generates_like(host, run.seeds[version])
        except AssertionError as e:
            run.problems.append(f"{host} does not serve v{version}'s weights: {e}")
    durable = job.newest_durable_ready
    if not durable:
        run.problems.append("no durable READY version")
        return
    info = client.version_info(durable, job=JOB)
    directory = manifests.version_dir(fleet.volume, durable)
    try:
        verify_version(directory, manifests.read(directory, durable, info.manifest_checksum))
    except Exception as e:  # noqa: BLE001 - any way it fails to load is the finding
        run.problems.append(f"the newest durable READY v{durable} is not loadable: {e}")
