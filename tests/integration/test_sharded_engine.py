"""A real vLLM CPU engine at tensor-parallel size 2 takes a version as regions from 2 trainer ranks.

The engine's workers record their layouts (``weightsync_layout``); the plan cuts their needs at a 2-rank
trainer's FSDP2 shards (``Shard(0)`` of every tensor, cut here from the trained model's full tensors); two
sender threads, one per trainer rank, each send only from their own shard over the region group, while
``weightsync_receive_regions`` has each worker receive only its regions and land them inside vLLM's layerwise
reload. Checked: each worker received exactly the bytes its layout needs (less than the table), the senders'
and workers' digests combine alike in plan order, and the engine generates what transformers predicts for the
trained weights. Run for the tiny Qwen2 and the tiny Qwen2-MoE, whose experts land by expert and TP shard (it
caught recording the layout in the live worker installing vLLM's CPU expert prepack a second time: the landed
experts were prepacked twice and generated other tokens). The same engine driven by the publisher, its agent and
the coordinator: ``test_sharded_publish.py`` (in make test) and ``test_sharded_moe.py``; this test and that one
run in make sharded.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

import pytest

from tests import support
from weightsync.channels import regions, wire
from weightsync.channels.base import Endpoint, Rendezvous
from weightsync.channels.cpu import GlooGroup
from weightsync.sharding.plans import Member, plan
from weightsync.sharding.shards import Mesh, Placement, TrainerLayout
from weightsync.vocabulary import Channel
from weightsync_trainer.sources import ModuleSource

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.environ.get("WEIGHTSYNC_SHARDED") != "all",
        reason="make sharded (WEIGHTSYNC_SHARDED=all); make test: test_sharded_publish.py drives the same engine",
    ),
]
RANKS, TP = 2, 2


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen2-moe"])
def test_a_tp2_engine_takes_only_its_regions_from_two_ranks_and_generates_like_transformers(
    preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightsync_inference import sharded
    from weightsync_inference.offline import OfflineEngine

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder = support.tiny_model(preset)
    model = support.hf_trainer(folder, seed=61)
    source = ModuleSource(model)
    table = source.table()
    engine = OfflineEngine(folder, Channel.CPU, tensor_parallel_size=TP)
    store = wire.serve_store("127.0.0.1", 0, 120.0)
    try:
        layout = engine.engine_layout(table)
        assert layout.unsupported == "" and layout.why_not(table) == ""
        trainer = TrainerLayout(
            table, RANKS, (Mesh((RANKS,), tuple(range(RANKS))),), tuple(Placement(0, (0,)) for _ in table)
        )
        replica = plan(trainer, [Member("r", layout)]).replica("r")
        assert replica.sharded, replica.gathered
        full = [t.contiguous() for group in source.groups() for t in group]  # as published: experts one by one
        rdv = Rendezvous(
            Channel.CPU,
            endpoint=Endpoint("127.0.0.1", store.port),
            group="regions",
            secret=secrets.token_hex(16),
            generation=1,
            rank=RANKS,
            world_size=RANKS + TP,
            join_timeout_s=60.0,
        )
        sent: dict[int, Any] = {}

        def rank(r: int) -> None:
            try:
                group = GlooGroup(wire.own_connection(store), "127.0.0.1", rdv, r)
                group.connect()
                local = [
                    None if (b := trainer.shard(t, r)) is None else full[t][_slices(b)].clone()
                    for t in range(len(full))
                ]
                sent[r] = regions.send(group.pg, trainer, r, local, [g for g in replica.regions if g.rank == r])
                group.close()
            except Exception as e:  # noqa: BLE001 - asserted below
                sent[r] = e

        senders = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS)]
        for t in senders:
            t.start()
        answers = engine.receive_regions(
            sharded.request(sharded.Order(1, rdv, replica.regions), table, layout.workers, "plan")
        )
        for t in senders:
            t.join(timeout=120)
        assert all(isinstance(sent[r], regions.Tally) for r in range(RANKS)), sent
        for a in answers:
            need = layout.workers[a["worker"]].bytes_needed(table)
            assert a["nbytes"] == a["landed"] == need < table.total_bytes, a
        by_rank = {r: sent[r].digests for r in range(RANKS)}
        by_worker = {a["worker"]: a["digests"] for a in answers}
        assert regions.combine(replica.regions, by_rank, regions.rank_of) == regions.combine(
            replica.regions, by_worker, regions.worker_of
        )
        support.assert_generates_like(engine, model)
        # back on the gathered path, the agent has the workers let their region group go: once
        assert engine.release_regions() == [1] * TP and engine.release_regions() == [0] * TP
    finally:
        engine.close()


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))
