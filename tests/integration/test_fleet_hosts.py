"""One fleet, every process on its own host: weights reach replicas planned on different channels.

The fleet is ``tests.hostfleet``'s (each process in its own network namespace; the NCCL channel over
gloo): ``replica-nccl`` and ``replica-nccl-2`` share ``nccl``, ``replica-cpu`` gets the CPU stream,
``replica-volume`` the volume. Then, one at a time: one NCCL replica's route to the trainer is made
unreachable (a partition between those two hosts only) and it takes the same version from the volume
while the other NCCL replica gets it over NCCL, from a group formed without it; the volume replica is
killed and started again and catches up; a trainer that reports another content digest than it
sent gets every replica's ack refused. The fault suite (``test_fleet_hosts_faults.py``) goes on
with the same fleet.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.hostfleet import JOB, REPLICAS, Fleet
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import VersionInfo
from weightsync.vocabulary import ReplicaState, VersionState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def fleet(host_fleet: Fleet) -> Fleet:
    return host_fleet


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> Iterator[CoordinatorClient]:
    with fleet.client() as c:
        yield c


def _replicas(info: VersionInfo) -> dict[str, tuple[str, ReplicaState]]:
    return {r.replica_id: (r.channel.value if r.channel else "", r.state) for r in info.replicas}


def _served(client: CoordinatorClient) -> dict[str, int]:
    return {m.member_id: m.current_version for m in client.get_job(JOB).members if m.role.value == "replica"}


def test_one_version_reaches_replicas_on_three_channels_bit_exact(fleet: Fleet, client: CoordinatorClient) -> None:
    report = fleet.publish(seed=1)
    assert report["state"] == "READY", report
    info = client.version_info(report["version"], job=JOB)
    assert _replicas(info) == {
        "replica-nccl": ("nccl", ReplicaState.LOADED),
        "replica-nccl-2": ("nccl", ReplicaState.LOADED),
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
    repair = fleet.refuse("replica-nccl", "trainer")
    try:
        report = fleet.publish(seed=2)
    finally:
        repair()
    assert report["state"] == "READY", report
    assert "replica-nccl" in report["failed"], report
    info = client.version_info(report["version"], job=JOB)
    assert _replicas(info)["replica-nccl"] == ("volume", ReplicaState.LOADED)
    assert _replicas(info)["replica-nccl-2"] == ("nccl", ReplicaState.LOADED)  # its group formed without the other
    errors = {r.replica_id: r.error for r in info.replicas}
    assert "nccl failed, loading from the volume" in errors["replica-nccl"], errors
    assert {r.content_digest for r in info.replicas} == {info.content_digest}
    fleet.generates_like("replica-nccl", seed=2)


@pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_FAULTS") != "all",
    reason="make faults (WEIGHTSYNC_FAULTS=all); make test: the demo's killed replica and the e2e tier's "
    "deleted replica pod catch up",
)
def test_a_restarted_replica_catches_up_from_the_volume(fleet: Fleet, client: CoordinatorClient) -> None:
    fleet.stop_host("replica-volume")
    deadline = time.monotonic() + 60
    while "replica-volume" in _served(client):  # its lease expires: the coordinator forgets it
        assert time.monotonic() < deadline
        time.sleep(0.5)
    report = fleet.publish(seed=3)
    assert report["state"] == "READY" and "replica-volume" not in report["channels"], report
    fleet.start_replica("replica-volume")
    fleet.wait_serving(("replica-volume",))
    deadline = time.monotonic() + 300
    while _served(client).get("replica-volume") != report["version"]:
        assert time.monotonic() < deadline, fleet.tail("replica-volume-agent")
        time.sleep(1)
    fleet.generates_like("replica-volume", seed=3)
    # the next version reaches it live again
    nxt = fleet.publish(seed=4)
    assert nxt["state"] == "READY" and nxt["channels"]["replica-volume"] == "volume", nxt
    fleet.generates_like("replica-volume", seed=4)


def test_acks_are_checked_against_what_the_trainer_sent(fleet: Fleet, client: CoordinatorClient) -> None:
    """A trainer that reports another content digest than it sent: each replica acks what its engine computed,
    which is not that, so every ack is refused and the version fails. Every replica's engine had loaded it: each
    then goes back to the previous READY version (from the volume), for a FAILED version is served by no replica."""
    previous = client.get_job(JOB).newest_ready
    assert _served(client) == dict.fromkeys(REPLICAS, previous)
    report = fleet.publish(seed=5, lie=True)
    assert report["state"] == "FAILED", report
    info = client.version_info(report["version"], job=JOB)
    assert all("not the sha256:0000" in r.error for r in info.replicas if r.state is ReplicaState.FAILED)
    assert info.state is VersionState.FAILED
    deadline = time.monotonic() + 300
    while _served(client) != dict.fromkeys(REPLICAS, previous):
        assert time.monotonic() < deadline, (_served(client), fleet.tail("replica-cpu-agent"))
        time.sleep(1)
    for host in REPLICAS:
        assert fleet.engine(host) == (previous, False), host
        fleet.generates_like(host, seed=fleet.seeds[previous])
