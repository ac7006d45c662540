"""A live engine reads a sharded volume version by region: which versions go by region, the agent's ack, and the
coordinator's checks of it (``volume_reads``, ``Agent._apply_from_volume``, ``versions._content_mismatch``).

The engine here is a stand-in whose workers read their fills with ``RegionReader`` (the real workers, landing in
a vLLM engine, are ``tests/integration/test_sharded_volume.py``'s, under ``make sharded-volume``).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit import sharding_cases as cases
from tests.unit.test_sharded_volume import TABLE, _fsdp, _full, _write
from weightsync.channels import digests, manifests
from weightsync.channels.base import Rendezvous, UpdateTicket
from weightsync.channels.volume import VolumeSender
from weightsync.channels.volume_regions import RegionReader
from weightsync.coordinator import models, serde
from weightsync.coordinator.clock import ManualClock
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import AckReport, Capabilities, Role, SentReport, summarize
from weightsync.coordinator.store import MemoryStore
from weightsync.errors import IntegrityError
from weightsync.sharding.fills import EngineLayout
from weightsync.tensors import DIGEST_PREFIX, TensorTable, manifest_checksum
from weightsync.vocabulary import Channel, ReplicaState
from weightsync_inference import volume_reads
from weightsync_inference.agent import Agent, AgentConfig
from weightsync_inference.receipts import Identity, Receipt

pytestmark = pytest.mark.unit

ENGINE = cases.random_replica(random.Random(5), TABLE, 2)
OTHER = cases.random_replica(random.Random(6), TABLE, 2)
OTHER_TABLE = TensorTable.build([[("x", "float32", (4,))]])


def test_only_a_sharded_copy_with_a_layout_of_its_table_is_read_by_region() -> None:
    digest = TABLE.layout_digest()
    assert volume_reads.why_whole(True, (TABLE, ENGINE), True, digest) == ""
    assert "not sharded" in volume_reads.why_whole(True, (TABLE, ENGINE), False, digest)
    assert "cannot read regions" in volume_reads.why_whole(False, (TABLE, ENGINE), True, digest)
    assert "no engine layout" in volume_reads.why_whole(True, None, True, digest)
    assert "another table" in volume_reads.why_whole(True, (OTHER_TABLE, ENGINE), True, digest)
    unsupported = EngineLayout(digest, unsupported="a loader computes")
    assert "a loader computes" in volume_reads.why_whole(True, (TABLE, unsupported), True, digest)


def _answers(root: Path, request: dict[str, Any]) -> list[dict[str, Any]]:
    """What each worker answers: the tiles it checked, or its fills read and their digests."""
    version = int(request["version"])
    directory = manifests.version_dir(root, version)
    manifest = manifests.read(directory, version, request["manifest_checksum"])
    out: list[dict[str, Any]] = []
    for w in ENGINE.workers:
        reader = RegionReader(directory, manifest)
        if request["phase"] == volume_reads.CHECK:
            reader.check(w.fills)
            out.append({"worker": w.rank, "bytes_checked": reader.bytes_checked, "seconds": 0.0})
            continue
        pieces = list(reader.fills(w.fills))
        out.append(
            {
                "worker": w.rank,
                "layout_digest": manifest.table.layout_digest(),
                "bytes_read": reader.bytes_read,
                "landed": sum(t.numel() * t.element_size() for _, t in pieces),
                "digests": [digests.digest(t) for _, t in pieces],
                "seconds": 0.0,
            }
        )
    return out


class _Engine:
    """A serving engine: whole loads through the lifecycle, region reads through ``read_regions``."""

    def __init__(self, root: Path) -> None:
        self.root, self.calls, self.version, self.fail = root, list[str](), 0, ""

    def identity(self) -> list[Identity]:
        return [Identity(0, 2, "cpu"), Identity(1, 2, "cpu")]

    def weight_version(self) -> str:
        return str(self.version)

    def is_paused(self) -> bool:
        return False

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def reset_caches(self) -> None: ...

    def init_transfer(self, init_info: dict[str, Any]) -> None: ...

    def start(self) -> None: ...

    def update(self, update_info: dict[str, Any]) -> None:
        self.calls.append(f"whole {update_info['version']}")

    def finish(self, version: str) -> None:
        self.version = int(version)

    def label(self, version: str) -> None:
        self.version = int(version)

    def receipt(self) -> Receipt:
        return Receipt(self.version, Channel.VOLUME, layout_digest=TABLE.layout_digest(), digests={"t": "8:00"})

    def last_table(self) -> TensorTable:
        return TABLE

    def engine_layout(self, table: TensorTable) -> EngineLayout:
        return ENGINE

    def receive_regions(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        raise AssertionError("no stream here")

    def release_regions(self) -> list[int]:
        self.calls.append("release")
        return [1, 1]

    def read_regions(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        self.calls.append(f"{request['phase']} {request['version']}")
        answers = _answers(self.root, request)
        if self.fail and request["phase"] == volume_reads.CHECK:  # worker 1 finds damage, worker 0 none
            answers[1] = {"error": f"worker 1: {self.fail}", "torn": False}
        return answers


class _Client:
    def __init__(self) -> None:
        self.acks: list[AckReport] = []
        self.layouts: list[Any] = []

    def register_replica(self, *args: Any, layout: Any = None, **kwargs: Any) -> None:
        self.layouts.append(layout)

    def set_current_version(self, version: int) -> None: ...

    def ack(self, report: AckReport) -> None:
        self.acks.append(report)


def _volume(root: Path) -> dict[int, str]:
    """v1 whole (format v1), v2 and v3 sharded by 2 FSDP2 ranks: each version's manifest checksum."""
    full = _full(TABLE)
    VolumeSender(root).send(UpdateTicket(1, Channel.VOLUME, verify=True, table=TABLE), [full])
    _write(root, _fsdp(TABLE, 2), full, version=2)
    _write(root, _fsdp(TABLE, 2), full, version=3)
    return {v: manifest_checksum(manifests.manifest_path(root, v).read_bytes()) for v in (1, 2, 3)}


def _catch_up(agent: Agent, root: Path, checksums: dict[int, str], version: int) -> None:
    plan = models.ChannelPlan("r", Channel.VOLUME, Rendezvous(Channel.VOLUME, root=str(root)), "", checksums[version])
    agent.handle(models.Assignment(models.EventKind.CATCH_UP, "job", version, plan=plan, table=summarize(TABLE)))


def test_an_agent_reads_a_sharded_version_by_region_once_it_recorded_its_layout(tmp_path: Path) -> None:
    checksums = _volume(tmp_path)
    engine, client = _Engine(tmp_path), _Client()
    config = AgentConfig("job", "r", (Channel.VOLUME,), "n", volume=tmp_path, volume_id="vol", retry_s=0.0)
    agent = Agent(engine, client, config)  # type: ignore[arg-type]
    _catch_up(agent, tmp_path, checksums, 2)  # no layout yet: whole, then the layout is recorded
    assert engine.calls == ["whole 2"] and client.layouts == [ENGINE] and not client.acks[-1].regions_read

    engine.fail = "tile [0:4] of tensor 'q.weight': sha256 ... does not match"
    _catch_up(agent, tmp_path, checksums, 3)
    refused = client.acks[-1]
    assert engine.calls[-1] == "check 3"  # no worker lands, worker 0 included
    assert not refused.ok and not refused.torn and "worker 1: tile [0:4] of tensor 'q.weight'" in refused.error
    assert "keeps serving version 2" in refused.error and agent.replica.version == 2

    engine.fail = ""
    _catch_up(agent, tmp_path, checksums, 3)  # the retry reads by region
    read, ack = agent.last_read, client.acks[-1]
    assert engine.calls[-2:] == ["check 3", "land 3"] and read is not None and agent.replica.version == 3
    assert ack.ok and ack.regions_read and ack.content_digest == read.content_digest
    assert read.landed == {w.rank: w.bytes_needed(TABLE) for w in ENGINE.workers}
    assert all(read.bytes_checked[w] == read.bytes_read[w] < TABLE.total_bytes for w in read.landed)


class _Durable(_Client):
    """The coordinator's answers about the job's newest durable READY version (0: none) and its files."""

    def __init__(self, newest: int, checksums: dict[int, str]) -> None:
        super().__init__()
        self.newest, self.checksums = newest, checksums

    def get_job(self) -> Any:
        return SimpleNamespace(newest_durable_ready=self.newest)

    def version_info(self, version: int) -> Any:
        return SimpleNamespace(durable=True, table=summarize(TABLE), manifest_checksum=self.checksums[version])


def test_an_agent_told_that_the_version_it_loaded_failed_goes_back_to_the_newest_durable_ready(
    tmp_path: Path,
) -> None:
    """An ABORT for the version the engine serves (it loaded it before the version failed): the agent loads the
    newest durable READY version from the volume; with none, it keeps serving what it has, saying so."""
    checksums = _volume(tmp_path)
    engine, client = _Engine(tmp_path), _Durable(0, checksums)
    config = AgentConfig("job", "r", (Channel.VOLUME,), "n", volume=tmp_path, volume_id="vol", retry_s=0.0)
    agent = Agent(engine, client, config)  # type: ignore[arg-type]
    _catch_up(agent, tmp_path, checksums, 2)
    abort = models.Assignment(models.EventKind.ABORT, "job", 2, reason="a trainer rank died", table=summarize(TABLE))
    agent.handle(abort)  # no durable READY version: v2 stays
    assert agent.events[-1] == ("rollback", 2, "kept: no durable READY version") and engine.version == 2
    _catch_up(agent, tmp_path, checksums, 3)
    client.newest = 2
    agent.handle(models.Assignment(models.EventKind.ABORT, "job", 2, reason="late", table=summarize(TABLE)))
    assert engine.version == 3, "an ABORT for a version the replica moved past changes nothing"
    agent.handle(dataclasses.replace(abort, version=3))
    assert engine.calls[-2:] == ["check 2", "land 2"] and agent.replica.version == engine.version == 2
    assert agent.events[-1] == ("rollback", 2, "ok") and client.acks[-1].ok and client.acks[-1].version == 2


class _Restarted(_Client):
    """The coordinator as an agent that starts sees it: registration answers, the stream of events ends at once."""

    def register_replica(self, *args: Any, layout: Any = None, **kwargs: Any) -> object:
        super().register_replica(*args, layout=layout, **kwargs)
        return object()  # a lease

    def watch(self) -> list[models.Assignment]:
        return []

    def close(self) -> None: ...


def test_an_agent_that_starts_beside_a_serving_engine_records_its_layout_and_reads_by_region(tmp_path: Path) -> None:
    """An agent restarted beside vLLM, which serves v2 and kept the table it received, records and registers its
    engine layout when it registers (before: only after the next version received whole, so that version went
    gathered and a catch-up was read whole)."""
    checksums = _volume(tmp_path)
    engine, client = _Engine(tmp_path), _Restarted()
    engine.version = 2
    config = AgentConfig("job", "r", (Channel.VOLUME,), "n", volume=tmp_path, volume_id="vol", lag_check_s=3600)
    agent = Agent(engine, client, config)  # type: ignore[arg-type]
    try:
        agent.run()  # registers, records its layout; the stream ends at once
    finally:
        agent.stop()
    assert client.layouts == [None, ENGINE] and agent.engine_layout == ENGINE
    _catch_up(agent, tmp_path, checksums, 3)
    assert engine.calls == ["check 3", "land 3"] and client.acks[-1].regions_read


def test_a_plain_copy_or_a_layout_of_another_table_is_read_whole(tmp_path: Path) -> None:
    checksums = _volume(tmp_path)
    engine, client = _Engine(tmp_path), _Client()
    config = AgentConfig("job", "r", (Channel.VOLUME,), "n", volume=tmp_path, volume_id="vol")
    agent = Agent(engine, client, config)  # type: ignore[arg-type]
    agent._layout = (TABLE, ENGINE)
    _catch_up(agent, tmp_path, checksums, 1)  # format v1
    assert engine.calls == ["whole 1"] and not client.acks[-1].regions_read
    agent._layout = (OTHER_TABLE, ENGINE)
    _catch_up(agent, tmp_path, checksums, 2)
    assert engine.calls == ["whole 1", "whole 2"] and agent.last_read is None


def test_the_workers_answers_are_checked_before_the_replica_acks_them(tmp_path: Path) -> None:
    checksums = _volume(tmp_path)
    request = volume_reads.request(str(tmp_path), 2, checksums[2], TABLE, ENGINE, volume_reads.LAND)
    answers = _answers(tmp_path, request)
    read = volume_reads.regions_read(2, TABLE, ENGINE, answers, {})
    again = volume_reads.regions_read(2, TABLE, ENGINE, _answers(tmp_path, request), {})
    assert read.content_digest == again.content_digest and read.content_digest.startswith(DIGEST_PREFIX)
    assert volume_reads.combine(OTHER, {0: ["x"] * len(OTHER.workers[0].fills), 1: ["x"] * len(OTHER.workers[1].fills)})
    with pytest.raises(IntegrityError, match="worker 0: gone; worker 1: gone"):
        volume_reads.checked([{"error": f"worker {w}: gone", "torn": False} for w in (0, 1)])
    short = [dict(answers[0], landed=1), answers[1]]
    with pytest.raises(IntegrityError, match="landed"):
        volume_reads.regions_read(2, TABLE, ENGINE, short, {})
    missing = [dict(answers[0], digests=answers[0]["digests"][1:]), answers[1]]
    with pytest.raises(IntegrityError, match="worker 0 reported"):
        volume_reads.regions_read(2, TABLE, ENGINE, missing, {})
    other = [dict(a, layout_digest=OTHER_TABLE.layout_digest()) for a in answers]
    with pytest.raises(IntegrityError, match="not the version's"):
        volume_reads.regions_read(2, TABLE, ENGINE, other, {})


WHOLE, READ, READ_2 = DIGEST_PREFIX + "a" * 64, DIGEST_PREFIX + "b" * 64, DIGEST_PREFIX + "c" * 64
CAPS = Capabilities(host="n", channels=(Channel.CPU, Channel.VOLUME), volume_id="vol", volume_mount="/ckpt")


def _ack(digest: str, regions_read: bool = False) -> AckReport:
    return AckReport(1, TABLE.layout_digest(), content_digest=digest, regions_read=regions_read)


def test_the_coordinator_compares_a_region_read_only_with_region_reads_of_the_same_engine_layout() -> None:
    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    lease = core.register("job", Role.TRAINER, "t", "t1", CAPS).lease_id
    leases = {
        rid: core.register("job", Role.REPLICA, rid, f"i-{rid}", CAPS, layout=layout).lease_id
        for rid, layout in (("a", ENGINE), ("b", ENGINE), ("c", OTHER), ("w", None), ("x", None))
    }
    core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    core.ack(leases["a"], _ack(READ, regions_read=True))  # before the trainer's report: no whole digest to match
    core.ack(leases["w"], _ack(WHOLE))  # not compared with a's
    core.report_sent(lease, 1, SentReport(WHOLE, {}))  # nor is a's with what the trainer sent
    core.ack(leases["b"], _ack(READ_2, regions_read=True))  # a's layout: it must read what a read
    core.ack(leases["c"], _ack(READ_2, regions_read=True))  # another layout: nothing to compare with
    core.ack(leases["x"], _ack(READ))  # a whole load that claims a region read's digest: not the trainer's
    rec = core._state.job("job").versions[1]
    assert {rid: rec.status[rid] for rid in "abcwx"} == {
        "a": ReplicaState.LOADED,
        "b": ReplicaState.FAILED,
        "c": ReplicaState.LOADED,
        "w": ReplicaState.LOADED,
        "x": ReplicaState.FAILED,
    }
    assert "other replicas that read this version by region with the same engine layout" in rec.errors["b"]
    assert "the trainer sent" in rec.errors["x"]
    assert serde.ack(serde.ack_to("lease", _ack(READ, regions_read=True))).regions_read  # it crosses the wire


def test_an_agent_back_on_the_gathered_path_has_its_workers_let_their_region_groups_go_once(tmp_path: Path) -> None:
    checksums = _volume(tmp_path)
    engine, client = _Engine(tmp_path), _Client()
    config = AgentConfig("job", "r", (Channel.VOLUME,), "n", volume=tmp_path, volume_id="vol")
    agent = Agent(engine, client, config)  # type: ignore[arg-type]
    agent._holds_regions = True  # as after a plan that sent its workers regions
    for v in (1, 2):
        plan = models.ChannelPlan("r", Channel.VOLUME, Rendezvous(Channel.VOLUME, root=str(tmp_path)), "", checksums[v])
        agent.handle(models.Assignment(models.EventKind.ASSIGN, "job", v, plan=plan, table=summarize(TABLE)))
    assert engine.calls.count("release") == 1 and engine.calls[0] == "release", engine.calls
    assert agent.replica.version == 2
