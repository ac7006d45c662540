"""Engine layouts recorded from vLLM's own loaders: inside real CPU engines, and exact against real loads.

- Inside real vLLM CPU engines of tensor-parallel size 1 and 2 (``WorkerExtension.weightsync_layout``): each
  worker reports what it keeps of the trainer's table; recording leaves the engine's weights as they were
  (it generates the same tokens after) and takes an update after it; the layout equals the one recorded on
  a meta model built from the config alone (``offline_layouts``), which the benchmark plans big models with.
- Exact: in a process of its own (``loader_check``), every recorded fill is checked against vLLM's loaders
  run on real tensors, for Qwen2 (tied head, q/k/v biases, a vocabulary vLLM pads) at tensor-parallel size 1
  and 2 and Qwen2-MoE (a shared expert, experts spread over the workers: expert parallel); ``make layouts``
  adds Llama and Mixtral (``WEIGHTSYNC_LAYOUTS=all``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import support
from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import EngineLayout, WorkerLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel
from weightsync_trainer.sources import ModuleSource

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _loader_check(tmp: Path, *args: str) -> dict[str, object]:
    out = tmp / "check.json"
    cmd = [sys.executable, "-m", "tests.integration.loader_check", *args, "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=support.env_without_proxies(), check=True, timeout=900)
    result: dict[str, object] = json.loads(out.read_text())
    return result


ALL = os.environ.get("WEIGHTSYNC_LAYOUTS") == "all"
CASES = [("qwen2", ["1", "2"], False), ("qwen2_moe", ["2"], True), ("llama", ["2"], False), ("mixtral", ["2"], False)]
REPRESENTATIVE = {"qwen2", "qwen2_moe"}  # make test; ``make layouts`` runs every case (WEIGHTSYNC_LAYOUTS=all)


@pytest.mark.parametrize("arch, tps, ep", CASES)
def test_recorded_fills_are_what_vllms_loaders_write(arch: str, tps: list[str], ep: bool, tmp_path: Path) -> None:
    if not ALL and arch not in REPRESENTATIVE:
        pytest.skip("a representative set runs in make test; make layouts runs every architecture")
    result = _loader_check(tmp_path, "--arch", arch, "--tp", *tps, *(["--ep"] if ep else []))
    table = TensorTable.from_dict(result["table"])  # type: ignore[arg-type]
    for tp in tps:
        workers = result[tp]
        assert isinstance(workers, list) and len(workers) == int(tp)
        layouts = [WorkerLayout.from_dict(w["layout"]) for w in workers]
        for w, layout in zip(workers, layouts, strict=True):
            assert w["mismatches"] == [] and w["unlisted"] == [], w
            assert layout.why_whole == "" and all(f.param >= 0 for f in layout.fills)
        _assert_covered(table, layouts, experts_spread=ep)


def _assert_covered(table: TensorTable, layouts: list[WorkerLayout], experts_spread: bool) -> None:
    """Each tensor is kept whole by every worker, split over them, or (expert parallel) by one worker only."""
    for t, spec in enumerate(table):
        count = torch.zeros(spec.shape, dtype=torch.int32)
        for layout in layouts:
            for f in layout.needs().get(t, ()):
                count[tuple(slice(o, o + n) for o, n in zip(f.source.offsets, f.source.lengths, strict=True))] += 1
        kept = set(count.flatten().tolist())
        if spec.name == "lm_head.weight" and kept == {0}:
            continue  # a tied head: vLLM shares the embedding's parameter
        if experts_spread and ".experts." in spec.name:
            assert kept == {1} and sum(t in w.needs() for w in layouts) == 1, spec.name
        else:
            assert kept in ({1}, {len(layouts)}) or (len(layouts) > 1 and kept == {1, len(layouts)}), (spec.name, kept)


@pytest.mark.skipif(
    not ALL,
    reason="a TP=2 MoE engine: make layouts (WEIGHTSYNC_LAYOUTS=all); make test records the "
    "MoE layout on meta models (test_recorded_fills_are_what_vllms_loaders_write)",
)
def test_a_mixture_of_experts_engine_records_each_workers_experts(tmp_path: Path) -> None:
    """A tiny Qwen2-MoE served at tensor-parallel size 2 with expert parallelism: each worker keeps half the
    experts whole, and says so."""
    from tests.integration.loader_check import checkpoint
    from weightsync_inference.offline import OfflineEngine
    from weightsync_trainer import naming

    folder = tmp_path / "moe"
    _, tensors = checkpoint("qwen2_moe", folder)
    table = TensorTable.build(
        [[(n, "bfloat16", tuple(tensors[n].shape)) for n in g] for g in naming.layer_groups(sorted(tensors))]
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setenv("OMP_NUM_THREADS", "1")
        engine = OfflineEngine(
            folder, Channel.CPU, tensor_parallel_size=2, enable_expert_parallel=True, skip_tokenizer_init=True
        )
    try:
        before = engine.greedy(support.PROMPTS, support.TOKENS)
        layout = engine.engine_layout(table)
        assert engine.greedy(support.PROMPTS, support.TOKENS) == before
    finally:
        engine.close()
    assert layout.unsupported == "" and len(layout.workers) == 2
    experts = [
        {_expert(table.tensors[t].name) for t in w.needs() if ".experts." in table.tensors[t].name}
        for w in layout.workers
    ]
    assert experts == [{"0", "1"}, {"2", "3"}]
    table_file = tmp_path / "table.json"
    table_file.write_text(json.dumps(table.to_dict()))
    offline = _loader_check(tmp_path, "--model", str(folder), "--table", str(table_file), "--tp", "2", "--ep")
    recorded = tuple(WorkerLayout.from_dict(w["layout"]) for w in offline["2"])  # type: ignore[union-attr]
    assert recorded == layout.workers and all(not w["mismatches"] for w in offline["2"])  # type: ignore[union-attr]


class Engines:
    def __init__(self) -> None:
        from weightsync_inference.offline import OfflineEngine

        self.folder = support.tiny_model()
        self.trainer = support.hf_trainer(self.folder, seed=51)
        self.table = ModuleSource(self.trainer).table()
        self.engines = {tp: OfflineEngine(self.folder, Channel.CPU, tensor_parallel_size=tp) for tp in (1, 2)}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # two engines' workers on one NUMA node
        env.setenv("OMP_NUM_THREADS", "1")
        live = Engines()
    yield live
    live.close()


LIVE = pytest.mark.skipif(
    not ALL,
    reason="two live engines (TP 1 and 2): make layouts (WEIGHTSYNC_LAYOUTS=all); make test records on meta models",
)


@LIVE
@pytest.mark.parametrize("tp", [1, 2])
def test_each_worker_records_its_layout_inside_the_engine(engines: Engines, tp: int, tmp_path: Path) -> None:
    engine, table = engines.engines[tp], engines.table
    before = engine.greedy(support.PROMPTS, support.TOKENS)
    layout = engine.engine_layout(table)
    assert (
        layout.unsupported == "" and layout.why_not(table) == "" and [w.rank for w in layout.workers] == list(range(tp))
    )
    assert engine.greedy(support.PROMPTS, support.TOKENS) == before  # recording put every weight back
    needed = [w.bytes_needed(table) for w in layout.workers]
    assert len(set(needed)) == 1 and (needed[0] == table.total_bytes if tp == 1 else needed[0] < table.total_bytes)
    by_name = {s.name: t for t, s in enumerate(table)}
    for w in layout.workers:  # what tensor parallelism means, read off the recorded boxes
        o_proj = w.needs()[by_name["model.layers.0.self_attn.o_proj.weight"]][0]
        q_proj = w.needs()[by_name["model.layers.0.self_attn.q_proj.weight"]][0]
        assert o_proj.source == Box((0, 128 * w.rank), (256, 256 // tp))  # row-parallel: a block of columns
        assert q_proj.source == Box((128 * w.rank, 0), (256 // tp, 256))  # column-parallel: a block of rows
        assert w.params[q_proj.param].name == "model.layers.0.self_attn.qkv_proj.weight" and q_proj.dest.offsets == (
            0,
            0,
        )
    table_file = tmp_path / "table.json"
    table_file.write_text(json.dumps(table.to_dict()))
    offline = _loader_check(tmp_path, "--model", str(engines.folder), "--table", str(table_file), "--tp", str(tp))
    recorded = [WorkerLayout.from_dict(w["layout"]) for w in offline[str(tp)]]  # type: ignore[union-attr]
    assert EngineLayout(table.layout_digest(), tuple(recorded)) == layout  # the engine's own and the meta model's
    assert all(not w["mismatches"] for w in offline[str(tp)])  # type: ignore[union-attr]


@LIVE
def test_an_engine_takes_an_update_after_recording(engines: Engines) -> None:
    from weightsync.channels.base import UpdateTicket, direct_rendezvous
    from weightsync.channels.cpu import CpuSender
    from weightsync_inference.lifecycle import Replica
    from weightsync_trainer.publisher import send

    engine = engines.engines[2]
    assert engine.engine_layout(engines.table).unsupported == ""
    replica = Replica(engine)
    sender = CpuSender(bucket_bytes=1 << 20)
    try:
        rendezvous = direct_rendezvous(sender.offer(), devices=2)
        sender.take_plan({"replica-0": rendezvous})
        replica.init_transfer(rendezvous.to_dict())
        trainer = support.hf_trainer(engines.folder, seed=52)
        source = ModuleSource(trainer)
        table = source.table()
        sent = UpdateTicket(1, Channel.CPU, table, table.layout_digest(), step=1)
        ticket = UpdateTicket(1, Channel.CPU, layout_digest=table.layout_digest(), step=1)
        outcome = replica.apply(ticket, send=lambda: send(source, sender, sent))
        assert outcome.receipt.ok and not outcome.receipt.torn
        support.assert_generates_like(engine, trainer)
    finally:
        sender.close()


def _expert(name: str) -> str:
    return name.split(".experts.")[1].split(".")[0]
