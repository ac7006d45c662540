"""The sharded volume with real ranks: 2 FSDP2 gloo ranks write their own shards, the workers of a TP=2 replica
read only their regions, a real TP=2 vLLM CPU engine loads the version, and a rank that dies or writes to a
disk of its own fails the version at every rank.

Each rank names the volume by its own mount point (a link per rank here): nothing assumes the same path on
both ends. The readers run vLLM's own model for each worker (``sharded_volume_reader``): the regions they read
land through ``Landing`` inside vLLM's layerwise reload and leave every parameter as vLLM's own reload of the
gathered tensors does. A live engine without a recorded layout reads the version whole through its volume engine
(``VolumeReceiver``); one whose agent recorded its layout reads it by region (``volume_reads``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import netns, support
from weightsync.channels import manifests
from weightsync.channels.base import Rendezvous, UpdateTicket
from weightsync.channels.volume import VolumeReceiver
from weightsync.tensors import manifest_checksum
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
ALL = os.environ.get("WEIGHTSYNC_SHARDED_VOLUME") == "all"
full = pytest.mark.skipif(
    not ALL,
    reason="make sharded-volume (a TP=2 engine, the rank faults); make test: the write, region reads, the publisher "
    "(and test_sharded_engine.py's TP=2 engine)",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(
    mode: str, tmp: Path, timeout_s: float = 60.0, *extra: str, hosts: netns.Hosts | None = None
) -> tuple[Path, list[dict[str, object]]]:
    """Run 2 trainer ranks in ``mode`` (on hosts ``rank-0`` and ``rank-1`` of ``hosts`` when given); the shared
    volume and what each rank reported."""
    volume, out = tmp / "volume", tmp / "out"
    volume.mkdir()
    out.mkdir()
    for rank in (0, 1):
        (tmp / f"mnt-rank{rank}").symlink_to(volume)  # each rank's own mount point of the one volume
    args = ["--mode", mode, "--model", str(support.tiny_model()), "--port", str(_free_port())]
    args += ["--root", str(tmp / "mnt-rank{rank}"), "--reference", str(tmp / "reference"), "--out", str(out)]
    args += ["--timeout", str(timeout_s), *extra]
    if hosts is not None:
        args += ["--master", hosts.address("rank-0")]
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "tests.integration.sharded_volume_ranks", *args]
        env = {**support.env_without_proxies(), "RANK": str(rank), "WORLD_SIZE": "2"}
        if hosts is None:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))
        else:
            procs.append(hosts.popen(f"rank-{rank}", cmd, cwd=ROOT, env=env))
    try:
        assert [p.wait(timeout=400) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    return volume, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    """Versions 1 (tiles of 64) and 2 (the default 256) of one trained model, written by 2 FSDP2 ranks."""
    tmp = tmp_path_factory.mktemp("sharded")
    _, reports = _ranks("write", tmp)
    return tmp, reports


def test_fsdp2_ranks_write_their_shards_and_tp2_workers_read_only_their_regions(
    written: tuple[Path, list[dict[str, object]]],
) -> None:
    tmp_path, reports = written
    volume = tmp_path / "volume"
    for r in reports:
        writes = r["writes"]
        assert isinstance(writes, list) and [w.get("error") for w in writes] == [None, None], writes
        assert [w["files"] for w in writes] == [["rank-00000.safetensors", "rank-00001.safetensors"]] * 2
    assert manifests.list_versions(volume) == [1, 2] and not list(volume.glob(".tmp-*"))

    out = tmp_path / "read.json"
    cmd = [sys.executable, "-m", "tests.integration.sharded_volume_reader", "--initial", str(support.tiny_model())]
    cmd += ["--reference", str(tmp_path / "reference"), "--root", str(volume), "--versions", "1", "2", "--tp", "2"]
    cmd += ["--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=support.env_without_proxies(), check=True, timeout=600)
    read = json.loads(out.read_text())
    on_grid, default = read["1"], read["2"]
    assert on_grid["tile"] == 64 and default["tile"] == 256
    for version in (on_grid, default):
        for w in version["workers"]:
            # landed by region, every parameter is what vLLM's own reload of the gathered tensors leaves
            assert w["differ"] == [] and w["unchanged"] == [] and w["fills"] > 0, w
            assert w["landed"] == w["bytes_needed"] and w["bytes_checked"] == w["bytes_read"], w
    for w in on_grid["workers"]:  # the tensor-parallel cuts fall on a 64-element grid: not a byte more
        assert w["bytes_read"] == w["bytes_needed"], w
        assert w["bytes_needed"] < 0.75 * on_grid["total_bytes"]  # about half of the sharded layers, norms whole
    for w in default["workers"]:  # 256-element tiles: what a cut inside a tile costs
        assert w["bytes_needed"] <= w["bytes_read"] <= on_grid["total_bytes"], w

    # a replica without a recorded layout reads the version whole (the gathered way), tile by tile
    reference = load_file(str(tmp_path / "reference" / "model.safetensors"))
    checksum = manifest_checksum(manifests.manifest_path(volume, 1).read_bytes())
    receiver = VolumeReceiver(tmp_path / "mnt-rank1")
    ticket = UpdateTicket(1, Channel.VOLUME, verify=True, manifest_checksum=checksum)
    got = {spec.name: t for group in receiver.receive(ticket) for spec, t in group}
    assert got.keys() == reference.keys() and all(torch.equal(got[n], reference[n]) for n in got)


class _Coordinator:
    """What an agent asks of its coordinator client on a catch-up, recorded (the acks' checks are the core's,
    ``tests/unit/test_volume_reads.py``)."""

    def __init__(self) -> None:
        self.acks: list[Any] = []
        self.layouts: list[Any] = []

    def register_replica(self, *args: Any, layout: Any = None, **kwargs: Any) -> None:
        self.layouts.append(layout)

    def set_current_version(self, version: int) -> None:
        pass

    def ack(self, report: Any) -> None:
        self.acks.append(report)


def _whole_copy(root: Path, version: int, table: Any, tensors: dict[str, torch.Tensor]) -> str:
    """``tensors`` written as a plain (format v1) volume version of ``table``; its manifest checksum."""
    from weightsync.channels.volume import VolumeSender
    from weightsync.channels.wire import TORCH_DTYPES

    ticket = UpdateTicket(version, Channel.VOLUME, verify=True, table=table, step=version)
    groups = [[tensors[s.name].to(TORCH_DTYPES[s.dtype]) for s in specs] for specs in table.groups()]
    VolumeSender(root).send(ticket, groups)
    return manifest_checksum(manifests.manifest_path(root, version).read_bytes())


@full
def test_a_tp2_engine_that_recorded_its_layout_catches_up_on_a_sharded_version_by_region(
    written: tuple[Path, list[dict[str, object]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A real TP=2 engine behind a real agent: v1 (the initial weights, format v1) loads whole and the agent records
    its engine layout; a catch-up to the sharded v2 (2 FSDP2 ranks, 256-element tiles) reads by region: refused
    with the weights untouched while a rank file is damaged or truncated, then each worker reads about its
    layout's bytes, and the engine holds bit for bit what a whole load of the same weights (v3, format v1) makes
    and generates what transformers generates."""
    import transformers

    from weightsync.coordinator import models
    from weightsync.sharding.fills import EngineLayout
    from weightsync_inference import volume_reads
    from weightsync_inference.agent import Agent, AgentConfig
    from weightsync_inference.offline import OfflineEngine

    written_at, _ = written
    root = tmp_path / "volume"  # the replica's volume: v2 copied from the ranks' (this test damages it), v1, v3
    shutil.copytree(written_at / "volume" / "v00000002", root / "v00000002")
    sharded = manifests.Manifest.load(root / "v00000002")
    table = sharded.table
    checksums = {2: manifest_checksum(manifests.manifest_path(root, 2).read_bytes())}
    checksums[1] = _whole_copy(root, 1, table, load_file(str(support.tiny_model() / "model.safetensors")))
    checksums[3] = _whole_copy(root, 3, table, load_file(str(written_at / "reference" / "model.safetensors")))
    summary = models.summarize(table)

    def catch_up(version: int) -> None:
        rdv = Rendezvous(Channel.VOLUME, root=str(root))
        plan = models.ChannelPlan("replica", Channel.VOLUME, rdv, "catch-up", checksums[version])
        agent.handle(models.Assignment(models.EventKind.CATCH_UP, "job", version, plan=plan, table=summary))

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    engine = OfflineEngine(support.tiny_model(), Channel.VOLUME, tensor_parallel_size=2)
    try:
        coordinator = _Coordinator()
        config = AgentConfig("job", "replica", (Channel.VOLUME,), "node", volume=root, volume_id="vol", retry_s=0.0)
        agent = Agent(engine, coordinator, config)  # type: ignore[arg-type]
        catch_up(1)  # format v1: whole; then the agent records and registers its engine layout of the table
        (layout,) = coordinator.layouts
        assert isinstance(layout, EngineLayout) and not layout.unsupported and len(layout.workers) == 2
        assert agent.last_read is None and not coordinator.acks[-1].regions_read and coordinator.acks[-1].ok
        initial = engine.parameter_digests()

        rank_file = root / "v00000002" / "rank-00001.safetensors"
        intact = rank_file.read_bytes()
        damaged = bytearray(intact)
        damaged[len(damaged) // 2] ^= 0x40
        rank_file.write_bytes(bytes(damaged))
        catch_up(2)  # by region: every worker checks every tile it will use before any worker lands a byte
        refused = coordinator.acks[-1]
        assert not refused.ok and not refused.torn, refused
        assert "rank-00001.safetensors of version 2 (written by trainer rank 1), tile" in refused.error, refused
        assert "of tensor 'model." in refused.error and "the version is refused" in refused.error, refused
        assert "keeps serving version 1" in refused.error, refused
        assert agent.replica.version == 1 and engine.parameter_digests() == initial  # untouched

        rank_file.write_bytes(intact[: len(intact) - 4096])  # truncated: the workers themselves name it
        request = volume_reads.request(str(root), 2, checksums[2], table, layout)
        answers = engine.read_regions(request)
        assert all("is truncated" in a["error"] and "trainer rank 1" in a["error"] for a in answers), answers
        assert all("of version 2" in a["error"] and "of tensor 'model." in a["error"] for a in answers), answers
        assert [a["torn"] for a in answers] == [False, False] and not engine.receipt().torn
        assert engine.parameter_digests() == initial

        rank_file.write_bytes(intact)
        catch_up(2)  # the retry: the files check out; read by region
        read, ack = agent.last_read, coordinator.acks[-1]
        assert ack.ok and ack.regions_read and ack.content_digest == read.content_digest, ack
        assert agent.replica.version == 2 and engine.weight_version() == "2" and not engine.receipt().torn
        for w in layout.workers:  # only about its layout's bytes: tiles of 256 elements cut at the shards' edges
            needed = w.bytes_needed(table)
            assert read.landed[w.rank] == needed
            assert needed <= read.bytes_read[w.rank] <= 1.25 * needed < table.total_bytes, (read, needed)
            assert read.bytes_checked[w.rank] == read.bytes_read[w.rank]  # checked all before landing, then read
        by_region = engine.parameter_digests()
        assert by_region != initial
        trained = transformers.AutoModelForCausalLM.from_pretrained(written_at / "reference", dtype=torch.float32)
        support.assert_generates_like(engine, trained)

        catch_up(3)  # the same weights, format v1: whole
        assert not coordinator.acks[-1].regions_read and agent.last_read is read
        assert engine.parameter_digests() == by_region  # bit for bit what vLLM's loader makes of the whole tensors
    finally:
        engine.close()


@full
def test_a_tp2_engine_loads_the_sharded_version_and_refuses_a_damaged_one(
    written: tuple[Path, list[dict[str, object]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    from weightsync.channels.base import Rendezvous
    from weightsync_inference.lifecycle import EngineState, Replica, UpdateFailed
    from weightsync_inference.offline import OfflineEngine

    tmp_path, _ = written
    # two CPU workers on one NUMA node (as in test_tensor_parallel): no OpenMP binding per worker
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    engine = OfflineEngine(support.tiny_model(), Channel.VOLUME, tensor_parallel_size=2)
    try:
        replica = Replica(engine)
        mount = tmp_path / "mnt-rank1"  # the replica's own mount point of the volume
        replica.init_transfer(Rendezvous(Channel.VOLUME, root=str(mount)).to_dict())

        def ticket(version: int) -> UpdateTicket:
            checksum = manifest_checksum(manifests.manifest_path(mount, version).read_bytes())
            return UpdateTicket(version, Channel.VOLUME, verify=True, manifest_checksum=checksum, step=version)

        outcome = replica.apply(ticket(1))
        assert outcome.receipt.ok and outcome.receipt.version == 1 and not outcome.receipt.torn
        trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32)
        support.assert_generates_like(engine, trained)

        rank_file = mount / "v00000002" / "rank-00001.safetensors"
        original = rank_file.read_bytes()
        data = bytearray(original)
        data[len(data) // 2] ^= 0x40
        rank_file.write_bytes(bytes(data))
        refused = r"rank-00001.safetensors of version 2: sha256 .* holds tensors \['model.embed_tokens.weight'"
        # Both workers refuse it before a byte lands. Each worker's engine records the failure in its receipt rather
        # than raising it (vLLM 0.32's multiprocess executor would raise at the first failed worker and leave the
        # other's reply queued for the next call): the refusal is UpdateFailed, and the next calls read fresh replies.
        with pytest.raises(UpdateFailed, match=refused) as failed:
            replica.apply(ticket(2))
        assert failed.value.state is EngineState.SERVING and replica.state is EngineState.SERVING
        assert not engine.receipt().torn and engine.receipt().version == 2  # the refusal, recorded untorn
        assert engine.weight_version() == "1"  # vLLM named version 2 at finish; the lifecycle named 1 again
        support.assert_generates_like(engine, trained)  # still version 1, whole
        rank_file.write_bytes(original)  # repaired: the same engine loads it (a stale reply would fail this)
        outcome = replica.apply(ticket(2))
        assert outcome.receipt.ok and outcome.receipt.version == 2 and engine.weight_version() == "2"
    finally:
        engine.close()


def test_the_publisher_of_an_fsdp2_trainer_writes_the_sharded_copy_from_every_rank(tmp_path: Path) -> None:
    """The user's path across hosts: each rank in a network namespace of its own (gloo between them over the
    bridge), the coordinator on the test's host network, each rank with its own mount point of the volume."""
    from prometheus_client import CollectorRegistry

    from weightsync.coordinator import server
    from weightsync.coordinator.client import CoordinatorClient

    netns.require()
    with netns.Hosts(["rank-0", "rank-1"]) as hosts:
        config = server.ServerConfig(host=hosts.bridge_address, insecure=True, port=0, metrics_port=0)
        coordinator = server.CoordinatorServer(config, registry=CollectorRegistry()).start()
        try:
            volume, reports = _ranks("publish", tmp_path, 60.0, "--coordinator", coordinator.target, hosts=hosts)
            client = CoordinatorClient(coordinator.target, insecure=True, timeout_s=10)
            infos = [client.version_info(v, job="job") for v in (1, 2)]
            client.close()
        finally:
            coordinator.stop(0.5)
    assert reports[0]["published"] == [
        {"version": 1, "state": "READY"},
        {"version": 2, "state": "READY"},
        {"errors": []},
    ]
    assert reports[1]["published"] == [{}, {}, {"errors": []}]  # rank 1 wrote its shards; rank 0 reports
    assert manifests.list_versions(volume) == [1, 2]
    for info in infos:
        assert info.durable and info.step in (5, 6)
        path = manifests.manifest_path(volume, info.version)
        assert info.manifest_checksum == manifest_checksum(path.read_bytes())
        manifest = manifests.Manifest.load(path.parent)
        assert manifest.sharded and sorted(manifest.shards) == ["rank-00000.safetensors", "rank-00001.safetensors"]


@full
def test_a_rank_that_dies_before_writing_fails_the_version_after_the_timeout(tmp_path: Path) -> None:
    volume, reports = _ranks("dies", tmp_path, timeout_s=10.0)
    assert reports[1].get("died") is True
    (write,) = reports[0]["writes"]  # type: ignore[misc]
    assert "not every trainer rank took part within 10s" in write["error"], write
    assert write["seconds"] < 60
    assert manifests.list_versions(volume) == [] and not list(volume.glob(".tmp-*"))


@full
def test_a_rank_writing_to_a_disk_of_its_own_fails_the_version_at_every_rank(tmp_path: Path) -> None:
    volume, reports = _ranks("own-disk", tmp_path)
    for r in reports:
        (write,) = r["writes"]  # type: ignore[misc]
        assert "rank 1 wrote rank-00001.safetensors" in write["error"], write
        assert "but rank 0 sees no such file" in write["error"] and "one shared file system" in write["error"]
    assert manifests.list_versions(volume) == [] and not list(volume.glob(".tmp-*"))
