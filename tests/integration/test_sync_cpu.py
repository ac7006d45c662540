"""A real vLLM CPU engine receives over the streams from real trainers.

Covers the CPU stream itself, the NCCL channel's code path over gloo (in-place
destinations in the engine's parameters), a trainer process killed mid-stream (the
replica stays paused, torn, until a whole version loads from the volume), and an FSDP2
trainer on two gloo ranks. What the engine loaded is checked against its own receipt
(the digests it computed while loading, read back through vLLM's ``collective_rpc``)
and the sender's report.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import support
from weightsync.channels import manifests
from weightsync.channels.base import Rendezvous, Sender, SendReport, UpdateTicket, direct_rendezvous
from weightsync.channels.cpu import CpuSender
from weightsync.channels.volume import VolumeSender
from weightsync.tensors import TensorTable, manifest_checksum
from weightsync.vocabulary import Channel, EngineState, SyncPhase
from weightsync_inference.lifecycle import Replica, UpdateFailed, UpdateOutcome
from weightsync_trainer.publisher import send
from weightsync_trainer.sources import ModuleSource

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _stream(replica: Replica, sender: Sender, source: ModuleSource, version: int) -> tuple[UpdateOutcome, SendReport]:
    """One version streamed from ``sender`` while ``replica`` loads it; the replica's ticket carries no table."""
    table = source.table()
    sent = UpdateTicket(version, sender.channel, table, table.layout_digest(), step=version)
    reports: list[SendReport] = []
    outcome = replica.apply(
        UpdateTicket(version, sender.channel, layout_digest=table.layout_digest(), step=version),
        send=lambda: reports.append(send(source, sender, sent)),
    )
    (report,) = reports
    receipt = outcome.receipt
    assert receipt.ok and not receipt.torn and receipt.version == version and receipt.channel is sender.channel
    assert not report.failed and dict(receipt.digests) == report.digests and len(report.digests) == len(table)
    assert set(receipt.in_place) | set(receipt.loader) == {s.name for s in table}
    assert not set(receipt.in_place) & set(receipt.loader)
    assert set(outcome.seconds) == set(SyncPhase) - {SyncPhase.PUBLISH}
    assert replica.state is EngineState.SERVING and replica.version == version
    return outcome, report


def _cpu_backend_repacks_linear(shape: tuple[int, int]) -> bool:
    """Whether vLLM's CPU backend, on this machine, keeps a bf16 linear layer's weight only in a packed kernel copy.

    Asked of vLLM's own dispatch (what its linear layers run after loading) on a layer of ``shape``: oneDNN, AMX
    or zentorch repack the weight and free it; where none can take bf16 (e.g. an AVX2-only CPU: oneDNN cannot
    build a bf16 matmul there) vLLM falls back to ``torch.nn.functional.linear`` on the weight as loaded.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return tuple(layer.weight.shape) != shape


def test_nccl_channel_over_gloo_writes_in_place_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NCCL channel's code path on CPU tensors: what the engine can hold as such lands in its parameters.

    Its own engine (the transport is chosen where the engine's workers start: they inherit
    the environment), started before the module's CPU-stream engine so only one runs at a time.
    """
    from weightsync.channels.nccl import TRANSPORT_ENV, NcclSender
    from weightsync_inference.offline import OfflineEngine

    monkeypatch.setenv(TRANSPORT_ENV, "gloo")
    folder = support.tiny_model()
    engine = OfflineEngine(folder, Channel.NCCL)
    sender = NcclSender(device="cpu")
    try:
        replica = Replica(engine)
        rdv = direct_rendezvous(sender.offer(), join_timeout_s=60)
        sender.take_plan({"replica-0": rdv})
        replica.init_transfer(rdv.to_dict())
        in_place: tuple[str, ...] = ()
        for version, seed in ((1, 21), (2, 22)):  # the second reuses the group and the engine's in-place views
            trainer = support.hf_trainer(folder, seed=seed)
            outcome, _ = _stream(replica, sender, ModuleSource(trainer), version)
            receipt = outcome.receipt
            down = dict(trainer.named_parameters())["model.layers.0.mlp.down_proj.weight"]
            repacked = _cpu_backend_repacks_linear((down.shape[0], down.shape[1]))
            # embeddings and norms are held as sent on every CPU: broadcast straight into the parameters
            assert "model.embed_tokens.weight" in receipt.in_place and "model.norm.weight" in receipt.in_place
            assert {"model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"} <= set(
                receipt.in_place
            )
            # linear layers go through vLLM's loaders where its CPU backend repacks them (the parameter is freed);
            # where it computes from the weight as loaded (no bf16 kernel on this CPU) they land in place too,
            # fused q/k/v and gate/up rows included
            linear = {n for n in receipt.digests if n.endswith("_proj.weight") or n.endswith("_proj.bias")}
            assert linear and linear <= set(receipt.loader if repacked else receipt.in_place), (repacked, receipt)
            assert not in_place or receipt.in_place == in_place
            in_place = receipt.in_place
            assert engine.receipt() == receipt
            support.assert_generates_like(engine, trainer)
    finally:
        sender.close()
        engine.close()


class Live:
    def __init__(self, root: Path) -> None:
        from weightsync_inference.offline import OfflineEngine

        self.root = root
        self.folder = support.tiny_model()
        self.engine = OfflineEngine(self.folder, Channel.CPU)
        self.replica = Replica(self.engine)
        self.version = 0

    def volume_ticket(self, volume: Path, table: TensorTable) -> UpdateTicket:
        """A replica's ticket for the volume version ``self.version`` (its root in the params, no rendezvous)."""
        return UpdateTicket(
            self.version,
            Channel.VOLUME,
            layout_digest=table.layout_digest(),
            manifest_checksum=manifest_checksum(manifests.manifest_path(volume, self.version).read_bytes()),
            step=self.version,
            root=str(volume),
        )


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    live = Live(tmp_path_factory.mktemp("cpu"))
    yield live
    live.engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_stream_syncs_bit_exact(live: Live) -> None:
    trainer = support.hf_trainer(live.folder, seed=11)
    sender = CpuSender(bucket_bytes=1 << 20)
    rdv = direct_rendezvous(sender.offer(), join_timeout_s=60)
    sender.take_plan({"replica-0": rdv})
    live.replica.init_transfer(rdv.to_dict())
    live.version += 1
    outcome, _ = _stream(live.replica, sender, ModuleSource(trainer), live.version)
    assert outcome.receipt.in_place == ()  # the CPU stream hands every tensor to vLLM's loaders
    assert live.engine.receipt() == outcome.receipt
    support.assert_generates_like(live.engine, trainer)
    sender.close()


def _read_rendezvous(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before planning its replica"
        assert time.monotonic() < deadline, "the trainer never wrote its rendezvous"
        time.sleep(0.1)
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_trainer_killed_mid_stream_leaves_replica_paused_until_a_whole_version(live: Live, tmp_path: Path) -> None:
    live.version += 1
    rendezvous = tmp_path / "rendezvous.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.procs",
            "stream",
            "--model",
            str(live.folder),
            "--rendezvous-out",
            str(rendezvous),
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
        info = _read_rendezvous(rendezvous, proc)
        rdv = Rendezvous.from_dict(info)
        assert rdv.channel is Channel.CPU and rdv.endpoint is not None and rdv.endpoint.host == "127.0.0.1"
        live.replica.init_transfer(info)
        table = ModuleSource(support.hf_trainer(live.folder, seed=12)).table()
        ticket = UpdateTicket(live.version, Channel.CPU, layout_digest=table.layout_digest(), timeout_s=60)
        with pytest.raises(UpdateFailed, match="failed after bytes reached the parameters") as err:
            live.replica.apply(ticket)
        assert err.value.state is EngineState.TORN and live.replica.state is EngineState.TORN
        receipt = live.engine.receipt()  # the engine says so itself, in a field
        assert receipt.torn and not receipt.ok and receipt.version == live.version
        assert proc.wait(timeout=60) == 17
    finally:
        proc.kill()

    # Recovery: a whole version from the volume, then the replica serves again.
    trainer = support.hf_trainer(live.folder, seed=13)
    source = ModuleSource(trainer)
    table = source.table()
    volume = live.root / "volume"
    live.version += 1
    report = send(source, VolumeSender(volume), UpdateTicket(live.version, Channel.VOLUME, table, step=live.version))
    outcome = live.replica.apply(live.volume_ticket(volume, table))
    assert live.replica.state is EngineState.SERVING and live.replica.version == live.version
    assert outcome.receipt.ok and not outcome.receipt.torn and dict(outcome.receipt.digests) == report.digests
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
    assert manifests.list_versions(volume) == [live.version]  # rank 1 wrote nothing of its own
    manifest = manifests.Manifest.load(manifests.version_dir(volume, live.version))
    assert manifest.table.digests() == json.loads(expected.read_text())  # gathered == torch's own full state dict
    outcome = live.replica.apply(live.volume_ticket(volume, manifest.table))
    assert dict(outcome.receipt.digests) == manifest.table.digests()
    import transformers

    full = transformers.AutoModelForCausalLM.from_pretrained(live.folder, dtype=torch.float32)
    full.load_state_dict(load_file(str(expected.with_suffix(".safetensors"))), strict=False)
    support.assert_generates_like(live.engine, full)
