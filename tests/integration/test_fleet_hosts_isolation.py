"""One replica's fault stays its own, on the host fleet: the others load each version on time, on their channel.

The fleet is ``tests.hostfleet``'s (shared with ``test_fleet_hosts`` and the fault suite): two replicas
sharing one NCCL group (over gloo: its own code path, rosters and heartbeats included), one on the CPU
stream, one on the volume; each process in its own network namespace, real vLLM CPU engines. Each fault
hits one replica while a version goes out, the trainer's gather stalled ``STALL_S`` after its first
group as in every timed publish here, and the suite checks:

- every healthy replica loads that version on its own channel within 1.2x its fault-free time (measured
  in the same run, same stall) plus the join deadline, plus ``SLACK_S`` for a loaded 2-core machine;
- the faulty replica does not (it takes the volume, or catches up once the fault clears);
- no healthy replica is kept off its channel: the next version plans each on its own;
- every replica ends on the trainer's final weights (``faultrun.check_invariants``).

The faults:

- ``join-dropped``: one NCCL replica must join a new group (its agent restarted) while every packet between
  it and the trainer is dropped: the roster leaves it out at the join deadline, its peer forms the group;
- ``join-refused``: the same for the CPU replica, its route to the trainer refusing at once: it falls back,
  the others wait at most the join deadline for it;
- ``frozen-mid-transfer``: every process on one NCCL replica's host stopped (SIGSTOP) mid-version: its
  heartbeats stop, and its peer finishes the version in a group formed without it;
- ``killed-mid-transfer``: one NCCL replica's host killed mid-version: the collective fails, its peer
  finishes without it;
- ``partition-after-join``: the other NCCL replica silently cut off from the trainer mid-version;
- ``trainer-without-pod-ip``: the trainer restarted without ``POD_IP`` (outside a pod: a warning naming it):
  the coordinator plans no replica on another host against its loopback endpoint, every replica loads the
  version from the volume, and no engine is left wedged or paused.

CI runs ``frozen-mid-transfer`` and the trainer without ``POD_IP``; ``make faults`` runs all and writes the table to
``$WEIGHTSYNC_ISOLATION_TABLE`` (docs/faults.md keeps a run).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import faultrun
from tests.hostfleet import CHANNELS, JOB, REPLICAS, Fleet
from tests.isolation import FAULTS, JOIN_S, SLACK_S, Loads, timed
from weightsync.vocabulary import ReplicaState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
ALL = os.environ.get("WEIGHTSYNC_FAULTS") == "all"
REPRESENTATIVE = {"frozen-mid-transfer"}
"""CI's share (minutes on 2 cores): a member lost mid-version, on real engines and the real coordinator. The join
deadline's paths run in CI on the channels (test_nccl_exclusion, test_cpu_channel) and in the coordinator's units."""
TABLE: list[str] = []


@pytest.fixture(scope="module")
def baseline(host_fleet: Fleet) -> Iterator[tuple[dict[int, int], dict[str, float]]]:
    """The seeds of every version published here, and each replica's fault-free load time (same stall)."""
    seeds: dict[int, int] = {}
    with host_fleet.client(timeout_s=30) as client:
        run = faultrun.Run(host_fleet, client, seeds)
        run.cleared()
        faultrun.converge(run)  # a known version everywhere, every group formed
        report, loads = timed(run)
        assert report["state"] == "READY" and set(loads.at) == set(REPLICAS), (report, loads.at)
    yield seeds, loads.at
    if TABLE:
        head = ["| fault | faulty replica | healthy: slowest load (s) | fault-free (s) | bound (s) | verdict |"]
        lines = [*head, "|---|---|---:|---:|---:|---|", *TABLE]
        print("\n" + "\n".join(lines))
        out = os.environ.get("WEIGHTSYNC_ISOLATION_TABLE")
        if out:
            Path(out).write_text("\n".join(lines) + "\n")


def _isolated(
    run: faultrun.Run, faulty: str, report: dict[str, Any], loads: Loads, base: dict[str, float]
) -> tuple[float, float, float]:
    """The fault's checks on its publish; (slowest healthy load, its fault-free time, its bound)."""
    info = run.client.version_info(report["version"], job=JOB)
    got = {r.replica_id: (r.channel.value if r.channel else "", r.state) for r in info.replicas}
    if got.get(faulty) == (CHANNELS[faulty], ReplicaState.LOADED):
        run.problems.append(f"the faulty {faulty} loaded v{report['version']} on its channel: the fault did not land")
    worst = (0.0, 0.0, 0.0)
    for rid in REPLICAS:
        if rid == faulty:
            continue
        if got.get(rid) != (CHANNELS[rid], ReplicaState.LOADED):
            run.problems.append(f"healthy {rid}: {got.get(rid)} for v{report['version']}, not {CHANNELS[rid]} LOADED")
        took, bound = loads.at.get(rid, float("inf")), 1.2 * base[rid] + JOIN_S + SLACK_S
        if took > bound:
            run.problems.append(f"healthy {rid} loaded after {took:.1f}s, over its bound of {bound:.1f}s")
        worst = max(worst, (took, base[rid], bound))
    return worst


@pytest.mark.parametrize("name", list(FAULTS))
def test_one_replicas_fault_stays_its_own(
    name: str, host_fleet: Fleet, baseline: tuple[dict[int, int], dict[str, float]]
) -> None:
    if not ALL and name not in REPRESENTATIVE:
        pytest.skip("in the full fault suite only: make faults")
    seeds, base = baseline
    with host_fleet.client(timeout_s=30) as client:
        run = faultrun.Run(host_fleet, client, seeds)
        faultrun.on_their_channels(run)  # the last fault's replica back on its channel: every replica healthy
        faulty, report, loads = FAULTS[name](run)
        took, fault_free, bound = _isolated(run, faulty, report, loads, base)
        _, _, after = faultrun.converge(run)
        kept_off = [r for r in REPLICAS if r != faulty and after["channels"].get(r) != CHANNELS[r]]
        if kept_off:
            run.problems.append(f"healthy replicas kept off their channel after the fault: {after['channels']}")
        faultrun.check_invariants(run)
        verdict = "; ".join(run.problems) or "ok"
        TABLE.append(f"| {name} | {faulty} | {took:.1f} | {fault_free:.1f} | {bound:.1f} | {verdict} |")
        assert not run.problems, run.problems


@pytest.mark.skipif(
    not ALL, reason="make faults (WEIGHTSYNC_FAULTS=all); make test runs its unit test (test_publisher_env.py)"
)
def test_a_trainer_without_pod_ip_is_told_and_wedges_no_engine(
    host_fleet: Fleet, baseline: tuple[dict[int, int], dict[str, float]]
) -> None:
    """Outside a pod the publisher warns naming ``POD_IP`` and offers 127.0.0.1; the coordinator plans no replica
    on another host against it (they take the volume); every engine serves on, none paused; with ``POD_IP``
    back, the next version is live again."""
    fleet = host_fleet
    seeds, _ = baseline
    with fleet.client(timeout_s=30) as client:
        run = faultrun.Run(fleet, client, seeds)
        fleet.kill_trainer()
        fleet.start_trainer(pod_ip=False)
        try:
            report = run.publish()
            assert "$POD_IP is not set" in fleet.tail("trainer"), fleet.tail("trainer")
            assert report["state"] == "READY", report
            assert report["channels"] == dict.fromkeys(REPLICAS, "volume"), report["channels"]
            for host in REPLICAS:
                assert fleet.engine(host) == (report["version"], False), host
        finally:
            fleet.kill_trainer()
            fleet.start_trainer()
        run.cleared()
        _, _, after = faultrun.converge(run)
        assert after["channels"] == CHANNELS, after["channels"]
        faultrun.check_invariants(run)
        assert not run.problems, run.problems
