"""The NCCL channel's code path into vLLM's parameter layout, fused q/k/v and gate/up rows included, on the CPU.

vLLM's CPU build repacks linear weights (its ``qkv_proj.weight`` is empty after loading), so a
real CPU engine takes only embeddings and norms in place (tests/integration/test_sync_cpu.py).
The fused layout is what vLLM holds on GPUs; this test runs the plugin's own update code
(``weightsync_inference.updates.Updater``, what vLLM's weightsync engine runs) against that
layout (``tests/gpu/harness.HarnessModel``, the Qwen3 layout vLLM uses, here a tiny one) with
the NCCL channel over gloo: rendezvous from a plan, a membership, the table in-band, every
tensor received straight into its rows of the fused parameters, verified, bit-exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from bench import gpu_models
from bench.staged_switch import StagedPair
from tests.gpu.fleet_trainer import RandomSource
from tests.gpu.harness import HarnessModel, plan_file
from weightsync.channels import nccl
from weightsync.channels.base import UpdateTicket, WorkerContext, direct_rendezvous
from weightsync.errors import PermanentError
from weightsync.vocabulary import Channel
from weightsync_inference.staging import staging_bytes
from weightsync_inference.updates import Updater

pytestmark = pytest.mark.integration
MODEL = "qwen3-tiny"


@pytest.fixture
def gloo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(nccl.TRANSPORT_ENV, "gloo")
    yield


def test_every_tensor_lands_in_its_rows_of_the_fused_parameters(gloo: None) -> None:
    table = gpu_models.trainer_table(MODEL)
    layout = {k: (v[0], tuple(v[1])) for k, v in plan_file(MODEL)["layout"].items()}
    cpu = torch.device("cpu")
    source = RandomSource(table, cpu)
    model = HarnessModel(layout, cpu, seed=5)
    updater = Updater(model, WorkerContext())
    sender = nccl.NcclSender(device="cpu", timeout_s=30)
    rdv = direct_rendezvous(sender.offer(), join_timeout_s=25).with_timeout(30)
    sender.take_plan({"replica": rdv})
    joined = threading.Thread(target=updater.init, args=(rdv,))  # the receiver joins while the sender forms the group
    joined.start()
    joined.join(30)
    try:
        for version in (1, 2):
            source.fill(seed=version)
            updater.start()
            receiving = threading.Thread(
                target=updater.receive, args=(UpdateTicket(version, Channel.NCCL, layout_digest=table.layout_digest()),)
            )
            receiving.start()
            report = sender.send(UpdateTicket(version, Channel.NCCL, table, table.layout_digest()), source.groups())
            receiving.join(30)
            updater.finish()
            receipt = updater.receipt
            assert receipt.ok and receipt.version == version
            assert set(receipt.in_place) == {s.name for s in table} and not receipt.loader
            assert model.loaded_through_loader == 0
            assert dict(receipt.digests) == report.digests  # what the receiver checked where the bytes landed
            assert model.digests(table) == report.digests  # and what the parameters hold, read back
            qkv = model.params["model.layers.1.self_attn.qkv_proj.weight"]
            q, k, v = (source.tensors[table.tensors.index(table[f"model.layers.1.self_attn.{p}_proj.weight"])]
                       for p in ("q", "k", "v"))  # fmt: skip
            assert torch.equal(qkv, torch.cat([q, k, v]))
    finally:
        sender.close()
        updater.close()


def test_a_staged_version_is_received_beside_the_serving_weights_and_switched_in_place(gloo: None) -> None:
    """Staged mode on the same code path: the version lands in the stage while the parameters keep the previous
    one (bit for bit), then the switch copies it into the same parameter addresses, verified; a stage the sender
    abandons leaves the parameters as they were and the switch is refused."""
    pair = StagedPair(MODEL, "cpu", "cpu", timeout_s=5)
    model, updater, table = pair.model, pair.updater, pair.table
    addresses = {name: p.data_ptr() for name, p in model.params.items()}
    try:
        serving = model.digests(table)
        sent = pair.stage(1)
        assert model.digests(table) == serving and not updater.torn  # the engine served v0 all along
        receipt = pair.switch(1)
        assert receipt.ok and receipt.version == 1 and set(receipt.in_place) == {s.name for s in table}
        assert dict(receipt.digests) == sent == model.digests(table)
        assert {name: p.data_ptr() for name, p in model.params.items()} == addresses

        # the sender gives up after two groups: the stage fails, the parameters keep version 1
        pair.source.fill(seed=2)
        updater.stage(pair.ticket(2), staging_bytes(table.total_bytes, len(table)))
        with pytest.raises(RuntimeError, match="stops"):
            pair.sender.send(UpdateTicket(2, Channel.NCCL, table, table.layout_digest()), _stops(pair.source.groups()))
        deadline = time.monotonic() + 60
        while updater.stager.status.state == "receiving" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert updater.stager.status.state == "failed" and updater.stager.status.version == 2
        assert model.digests(table) == sent and not updater.torn
        with pytest.raises(PermanentError, match="version 2 is not staged here"):
            pair.switch(2)
        assert model.digests(table) == sent
    finally:
        pair.close()


def _stops(groups: Iterator[list[torch.Tensor]]) -> Iterator[list[torch.Tensor]]:
    for i, group in enumerate(groups):
        if i == 2:
            raise RuntimeError("the trainer stops mid-version")
        yield group
