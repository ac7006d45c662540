"""A real vLLM CPU engine receives over the CPU stream from real trainer processes.

Covers the stream itself, a trainer killed mid-stream (the replica stays paused, torn,
until a whole version loads from the volume), and an FSDP2 trainer on two gloo ranks.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import support
from weightsync.channels.base import UpdateTicket
from weightsync.channels.cpu import CpuSender
from weightsync.channels.volume import Manifest, VolumeSender
from weightsync.vocabulary import Channel
from weightsync_inference.lifecycle import Replica, ReplicaState, UpdateFailed
from weightsync_trainer.publisher import Publisher
from weightsync_trainer.sources import ModuleSource

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


class Live:
    def __init__(self, root: Path) -> None:
        from weightsync_inference.offline import OfflineEngine

        self.root = root
        self.folder = support.tiny_model()
        self.engine = OfflineEngine(self.folder, Channel.CPU)
        self.replica = Replica(self.engine)
        self.version = 0

    def receipt(self, version: int) -> dict[str, str]:
        return dict(json.loads((self.root / "receipts" / f"v{version:08d}-rank0.json").read_text())["digests"])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    live = Live(tmp_path_factory.mktemp("cpu"))
    yield live
    live.engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init_stream(live: Live, address: str, rendezvous: object = None, bucket_bytes: int = 64 << 20) -> None:
    info = {"channel": "cpu", "address": address, "world_size": 2, "rank_offset": 1, "timeout_s": 60}
    info |= {"bucket_bytes": bucket_bytes, "receipt_dir": str(live.root / "receipts")}
    live.replica.init_transfer(info, rendezvous=rendezvous)  # type: ignore[arg-type]


def test_stream_syncs_bit_exact(live: Live) -> None:
    trainer = support.hf_trainer(live.folder, seed=11)
    sender = CpuSender(world_size=2, bucket_bytes=1 << 20)
    _init_stream(live, sender.address, sender.connect, bucket_bytes=1 << 20)
    publisher = Publisher(ModuleSource(trainer), [sender])
    live.version += 1
    ticket = publisher.ticket(live.version, live.version, Channel.CPU)
    reports = []
    live.replica.apply(ticket, send=lambda: reports.append(publisher.publish(live.version, live.version, [ticket])))
    assert live.receipt(live.version) == reports[0].digests and len(reports[0].digests) == len(publisher.table)
    support.assert_generates_like(live.engine, trainer)
    sender.close()


def test_trainer_killed_mid_stream_leaves_replica_paused_until_a_whole_version(live: Live) -> None:
    port = _free_port()
    live.version += 1
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs",
            "stream",
            "--model",
            str(live.folder),
            "--port",
            str(port),
            "--version",
            str(live.version),
            "--seed",
            "12",
            "--die-after",
            "2",
        ],
        cwd=ROOT,
    )
    try:
        _init_stream(live, f"127.0.0.1:{port}", bucket_bytes=256 << 10)
        table = ModuleSource(support.hf_trainer(live.folder, seed=12)).table()
        ticket = UpdateTicket(live.version, Channel.CPU, table, step=live.version, timeout_s=60)
        with pytest.raises(UpdateFailed, match="failed after bytes reached the parameters") as err:
            live.replica.apply(ticket)
        assert err.value.state is ReplicaState.TORN and live.replica.state is ReplicaState.TORN
        assert proc.wait(timeout=60) == 17
    finally:
        proc.kill()

    # Recovery: a whole version from the volume, then the replica serves again.
    trainer = support.hf_trainer(live.folder, seed=13)
    live.version += 1
    publisher = Publisher(ModuleSource(trainer), [VolumeSender(live.root / "volume")])
    publisher.publish(live.version, live.version)
    live.replica.apply(publisher.ticket(live.version, live.version, Channel.VOLUME, root=str(live.root / "volume")))
    assert live.replica.state is ReplicaState.SERVING
    support.assert_generates_like(live.engine, trainer)


def test_fsdp2_two_ranks_publish_gathered_weights(live: Live) -> None:
    from safetensors.torch import load_file

    volume = live.root / "fsdp-volume"
    expected = live.root / "fsdp-expected.json"
    live.version += 1
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.procs",
                "fsdp",
                "--model",
                str(live.folder),
                "--port",
                str(port),
                "--volume",
                str(volume),
                "--version",
                str(live.version),
                "--expected",
                str(expected),
            ],
            cwd=ROOT,
            env={**support.env_without_proxies(), "RANK": str(rank)},
        )
        for rank in (0, 1)
    ]
    try:
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    manifest = Manifest.load(volume / f"v{live.version:08d}")
    assert manifest.table.digests() == json.loads(expected.read_text())  # gathered == torch's own full state dict
    live.replica.apply(UpdateTicket(live.version, Channel.VOLUME, manifest.table, params={"root": str(volume)}))
    assert live.receipt(live.version) == manifest.table.digests()
    import transformers

    full = transformers.AutoModelForCausalLM.from_pretrained(live.folder, dtype=torch.float32)
    full.load_state_dict(load_file(str(expected.with_suffix(".safetensors"))), strict=False)
    support.assert_generates_like(live.engine, full)
