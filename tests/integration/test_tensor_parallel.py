"""A tensor-parallel replica: a real vLLM CPU engine with two workers, in place and staged.

Each worker is a receiver of its own in the channel's membership (the replica's rank and
the next, as the coordinator plans a replica of two devices); no tensor can be written in
place (a shard is never the trainer's tensor), so every one reaches its worker's shard
through vLLM's loaders, and the replica's receipt merges both workers'. A staged version
is received by both workers beside their weights and switched in with one call, as a
served replica's is; the engine then generates what transformers predicts for the
trainer's weights.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import support
from weightsync.channels.base import UpdateTicket, direct_rendezvous
from weightsync.channels.cpu import CpuSender
from weightsync.vocabulary import Channel, EngineState
from weightsync_inference.lifecycle import Replica
from weightsync_inference.staging import staging_bytes
from weightsync_trainer.publisher import send
from weightsync_trainer.sources import ModuleSource

pytestmark = pytest.mark.integration
WORKERS = 2


class Live:
    def __init__(self) -> None:
        from weightsync_inference.offline import OfflineEngine

        self.folder = support.tiny_model()
        self.engine = OfflineEngine(self.folder, Channel.CPU, tensor_parallel_size=WORKERS)
        self.replica = Replica(self.engine)
        self.sender = CpuSender(bucket_bytes=1 << 20)
        rdv = direct_rendezvous(self.sender.offer(), devices=WORKERS, join_timeout_s=60)
        self.sender.take_plan({"replica-0": rdv})
        self.replica.init_transfer(rdv.to_dict())
        self.version = 0

    def tickets(self, source: ModuleSource) -> tuple[UpdateTicket, UpdateTicket]:
        """The next version's ticket for the sender (with the table) and for the replica (without)."""
        self.version += 1
        table = source.table()
        sent = UpdateTicket(self.version, Channel.CPU, table, table.layout_digest(), step=self.version)
        return sent, UpdateTicket(self.version, Channel.CPU, layout_digest=table.layout_digest(), step=self.version)

    def close(self) -> None:
        self.sender.close()
        self.engine.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with pytest.MonkeyPatch.context() as env:
        # two CPU workers on one NUMA node: vLLM binds each worker's OpenMP threads to a node of its own unless told
        # not to (its workers inherit the environment when they start)
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setenv("OMP_NUM_THREADS", "1")
        live = Live()
    yield live
    live.close()


def test_each_worker_is_a_receiver_of_its_own(live: Live) -> None:
    identities = live.engine.identity()
    assert [(i.rank, i.world_size) for i in identities] == [(0, WORKERS), (1, WORKERS)]


def test_in_place_update_reaches_every_shard(live: Live) -> None:
    trainer = support.hf_trainer(live.folder, seed=31)
    source = ModuleSource(trainer)
    sent, ticket = live.tickets(source)
    reports = []
    outcome = live.replica.apply(ticket, send=lambda: reports.append(send(source, live.sender, sent)))
    (report,) = reports
    receipt = outcome.receipt
    assert receipt.ok and not receipt.torn and receipt.version == live.version
    assert dict(receipt.digests) == report.digests and len(report.digests) == len(sent.table or ())
    assert receipt.in_place == () and set(receipt.loader) == {s.name for s in sent.table or ()}
    assert live.engine.receipt() == receipt
    support.assert_generates_like(live.engine, trainer)


def test_staged_version_switches_in_on_every_worker(live: Live) -> None:
    trainer = support.hf_trainer(live.folder, seed=32)
    source = ModuleSource(trainer)
    before = live.engine.greedy(support.PROMPTS, support.TOKENS)
    sent, ticket = live.tickets(source)
    assert sent.table is not None
    live.replica.stage(ticket, staging_bytes(sent.table.total_bytes, len(sent.table)))
    report = send(source, live.sender, sent)  # both workers receive into their stage while the engine serves
    staged = live.replica.wait_staged(ticket)
    assert staged.state == "staged" and staged.version == live.version
    assert live.engine.greedy(support.PROMPTS, support.TOKENS) == before  # nothing switched yet
    outcome = live.replica.switch(ticket, staged)
    receipt = outcome.receipt
    assert receipt.ok and not receipt.torn and receipt.version == live.version
    assert dict(receipt.digests) == report.digests and set(receipt.loader) == {s.name for s in sent.table}
    assert live.replica.state is EngineState.SERVING and live.engine.weight_version() == str(live.version)
    support.assert_generates_like(live.engine, trainer)
