"""A coordinator restart keeps what is READY: the journal and the volume's manifests bring it back.

The coordinator runs as a real ``weightsync coordinator`` process on a fixed
loopback port with ``--volume``; it is SIGKILLed (no chance to flush anything)
and started again on the same volume. Clients ride through: UNAVAILABLE is
retried, the forgotten lease is re-registered with the same incarnation. The
coordinator mounts the volume, so it hashes each manifest itself when a version
becomes durable and refuses a checksum claim that does not match.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests import simulation
from weightsync.channels import manifests
from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import faults, store
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import Capabilities, EngineKind, summarize
from weightsync.tensors import manifest_checksum
from weightsync.vocabulary import Channel, VersionState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
JOB = "restart-job"
CPU_OFFER = Offer(Channel.CPU, Endpoint("127.0.0.1", 29999))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_coordinator(port: int, volume: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightsync.cli.main",
            "coordinator",
            "--insecure",
            "--port",
            str(port),
            "--json",
            "--volume",
            f"{JOB}={volume}",
            "--lease-ttl",
            # renewals every third of it: at 1 s a loaded 2-core CI machine starved the trainer's renewer past its
            # lease ("trainer lost mid-publish: trainer lease expired" 0.7 s after v3 opened, 3 runs in 8 here)
            "3",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the coordinator exited before printing its startup record"
    record = json.loads(line)
    assert record["target"] == f"127.0.0.1:{port}"
    return proc


def write_version(volume: Path, version: int, step: int) -> tuple[str, str, Any]:
    """A real volume version (safetensors shard + manifest) as the trainer writes it: its manifest's path and
    checksum, and its table."""
    import torch

    from weightsync.channels.base import UpdateTicket
    from weightsync.channels.volume import VolumeSender
    from weightsync.tensors import TensorTable

    table = TensorTable.build([[("w", "float32", (4, 4)), ("b", "float32", (4,))]])
    tensors = [torch.full((4, 4), float(step)), torch.zeros(4)]
    VolumeSender(volume).send(UpdateTicket(version, Channel.VOLUME, table, step=step), [tensors])
    path = manifests.manifest_path(volume, version)
    return str(path), manifest_checksum(path.read_bytes()), table


def test_ready_state_survives_a_coordinator_kill(tmp_path: Path) -> None:
    volume, port = tmp_path / "ckpt", free_port()
    coordinator = start_coordinator(port, volume)
    ctx = mp.get_context("spawn")
    events: Any = ctx.Queue()
    target = f"127.0.0.1:{port}"
    replica = ctx.Process(
        target=simulation.replica_main,
        daemon=True,
        args=(
            simulation.Member(target, JOB, "r0", channels=("cpu", "volume"), volume_id="vol", volume_mount=str(volume)),
            events,
        ),
    )
    replica.start()
    trainer = CoordinatorClient(target, insecure=True, timeout_s=20)
    procs: list[Any] = [replica]
    try:
        assert events.get(timeout=30)[0] == "registered"
        # on the simulated replica's host: its cpu offer is a loopback endpoint, which no other host could reach
        caps = Capabilities(
            host="node-a", channels=(Channel.CPU, Channel.VOLUME), volume_id="vol", engine=EngineKind.CPU
        )
        trainer.register_trainer(JOB, "trainer", caps, offers=[Offer(Channel.VOLUME)])
        _, _, table = write_version(tmp_path / "scratch", 1, 1)  # only for the table's summary
        summary = summarize(table)
        # v1 reaches r0 over the volume: it is sent to r0 once its copy is durable
        opened = trainer.open_version(1, summary)
        v1 = opened.version
        assert [(p.replica_id, p.channel) for p in opened.plans] == [("r0", Channel.VOLUME)]
        trainer.report_sent(v1, "", {})
        assert trainer.wait_version(v1, 30, durable_needed=True).durable_needed
        path, checksum, _ = write_version(volume, v1, 1)
        with pytest.raises(faults.InvalidArgument, match="does not match version 1's manifest on the volume"):
            trainer.mark_durable(v1, path, manifest_checksum(b"some other manifest"))
        assert trainer.mark_durable(v1, path, checksum).manifest_checksum == checksum
        assert trainer.wait_version(v1, 30).state is VersionState.READY
        # v2 reaches r0 over a cpu stream offered for it alone, and is never made durable
        v2 = trainer.open_version(2, summary, offers=[CPU_OFFER]).version
        trainer.report_sent(v2, "", {})
        assert trainer.wait_version(v2, 30).state is VersionState.READY

        coordinator.kill()
        coordinator.wait(10)
        coordinator = start_coordinator(port, volume)

        observer = CoordinatorClient(target, insecure=True, timeout_s=20)
        job = observer.get_job(JOB)
        assert (job.newest_ready, job.newest_durable_ready) == (v2, v1)
        states = {v.version: (v.state, v.durable, v.manifest_checksum) for v in observer.list_versions(JOB)}
        assert states == {v1: (VersionState.SUPERSEDED, True, checksum), v2: (VersionState.READY, False, "")}

        # both clients ride through the restart: renewals re-register, numbering continues. A version opened
        # before r0 is back would be planned for no replica and fail (READY means acked), so wait for it.
        deadline = time.monotonic() + 30
        while "r0" not in {m.member_id for m in observer.get_job(JOB).members}:
            assert time.monotonic() < deadline, "r0 did not register again after the coordinator restart"
            time.sleep(0.1)
        v3 = trainer.open_version(3, summary, offers=[CPU_OFFER]).version
        assert v3 == v2 + 1
        trainer.report_sent(v3, "", {})
        assert trainer.wait_version(v3, 30).state is VersionState.READY
        late = ctx.Process(
            target=simulation.replica_main,
            daemon=True,
            args=(
                simulation.Member(target, JOB, "late", channels=("volume",), volume_id="vol", volume_mount=str(volume)),
                events,
            ),
        )
        late.start()
        procs.append(late)
        deadline = time.monotonic() + 30
        seen: list[tuple[Any, ...]] = []
        answered = {("acked", "late", v1), ("refused", "late", v1)}
        while time.monotonic() < deadline and not answered & {e[:3] for e in seen}:
            seen.append(tuple(events.get(timeout=30)))
        assert ("catch_up", "late", v1, "volume") in seen
        # the catch-up carried the checksum the coordinator recovered, or the replica would have refused it
        assert ("acked", "late", v1, VersionState.SUPERSEDED.value) in seen, seen
        observer.close()
    finally:
        trainer.close()
        for p in procs:
            p.kill()
            p.join(5)
        coordinator.kill()
        coordinator.wait(10)


def test_recovery_from_manifests_alone(tmp_path: Path) -> None:
    volume = tmp_path / "ckpt"
    path, checksum, table = write_version(volume, 4, 40)
    write_version(volume, 5, 50)
    recovered = store.VolumeStore({JOB: volume}).load(JOB)
    assert [(v.version, v.step, v.state, v.durable) for v in recovered] == [
        (4, 40, VersionState.READY, True),
        (5, 50, VersionState.READY, True),
    ]
    assert recovered[0].manifest_path == path and recovered[0].manifest_checksum == checksum
    assert recovered[0].table == summarize(table)


def test_a_version_left_staging_comes_back_failed(tmp_path: Path) -> None:
    from weightsync.coordinator.models import TableSummary, VersionInfo

    volume = tmp_path / "ckpt"
    s = store.VolumeStore({JOB: volume})
    s.save(VersionInfo(JOB, 1, 1, "inc", VersionState.READY, table=TableSummary(1, 1, simulation.LAYOUT)))
    s.save(VersionInfo(JOB, 2, 2, "inc", VersionState.STAGING, table=TableSummary(1, 1, simulation.LAYOUT)))
    back = {v.version: v for v in store.VolumeStore({JOB: volume}).load(JOB)}
    assert back[1].state is VersionState.READY and not back[1].durable
    assert back[2].state is VersionState.FAILED and "restarted while this version was staging" in back[2].reason
