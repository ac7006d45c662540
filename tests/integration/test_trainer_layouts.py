"""The trainer's layout read from real sharded trainers: 2 and 4 gloo ranks with FSDP2, and FSDP2 over tensor
parallelism on a 2 x 2 mesh. Each rank checks that the box the layout gives it holds exactly its own shard
of the gathered tensor (``layout_ranks``); here every rank must agree on the layout (and their all-reduce,
``agreed``, must say so, and say when they do not), and the placements must be the ones those trainers use.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import support

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(mode: str, world: int, out: Path, preset: str = "tiny-qwen2") -> list[dict[str, Any]]:
    out.mkdir()
    port = _free_port()
    args = ["--mode", mode, "--model", str(support.tiny_model(preset)), "--port", str(port), "--out", str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.integration.layout_ranks", *args],
            cwd=ROOT,
            env={**support.env_without_proxies(), "RANK": str(rank), "WORLD_SIZE": str(world)},
        )
        for rank in range(world)
    ]
    try:
        assert [p.wait(timeout=400) for p in procs] == [0] * world
    finally:
        for p in procs:
            p.kill()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize(
    "world",
    [
        2,
        pytest.param(
            4,
            marks=pytest.mark.skipif(
                os.environ.get("WEIGHTSYNC_LAYOUTS") != "all",
                reason="4 ranks, an empty chunk: make layouts (WEIGHTSYNC_LAYOUTS=all); make test: 2 ranks, a 2x2 mesh",
            ),
        ),
    ],
)
def test_fsdp2_ranks_read_one_layout_that_is_their_shards(world: int, tmp_path: Path) -> None:
    reports = _run("fsdp", world, tmp_path / "out")
    assert len({r["digest"] for r in reports}) == 1  # every rank computed the same layout, with no collective
    for r in reports:
        assert r["unsupported"] == "" and r["checked"] == r["tensors"] == 28
        assert r["meshes"] == [[[world], list(range(world))]] and r["placements"] == ["(Shard(0))"]
        assert r["agreed"] and r["local_shards"] == r["held"]  # the ranks' all-reduce found one layout
        assert "computed different layouts" in r["disagreed"]  # and finds it when each rank sees another
    assert reports[0]["extra_rows"] == ([3, 2] if world == 2 else [2, 2, 1])  # 5 rows: rank 3 holds none
    # of 4 ranks, rank 3 holds nothing of extra.0 (5 rows: 2, 2, 1, 0) nor of extra.1 (6 rows: 2, 2, 2, 0)
    assert [r["held"] for r in reports] == ([28, 28] if world == 2 else [28, 28, 28, 26])


def test_fsdp2_ranks_send_each_fused_expert_from_the_rank_that_holds_it(tmp_path: Path) -> None:
    """Qwen2-MoE in transformers 5 fuses a layer's experts into one parameter (``experts.gate_up_proj``) that it
    publishes per expert (``experts.<e>.gate_proj.weight``): FSDP2 cuts the fused parameter by expert, so each
    published expert lies whole on one rank, which sends it, cut from its shard."""
    reports = _run("fsdp", 2, tmp_path / "out", "tiny-qwen2-moe")
    assert len({r["digest"] for r in reports}) == 1
    for r in reports:
        assert r["unsupported"] == "" and r["checked"] == r["tensors"], r
        assert r["meshes"] == [[[2], [0, 1]], [[1], [0]], [[1], [1]]], r["meshes"]  # 4 experts: 0-1 on 0, 2-3 on 1
        assert r["agreed"] and r["local_shards"] == r["held"], r
    # of 56 tensors, 24 are experts (gate, up, down of 4 experts in 2 layers): 12 on each rank; the 32 others are
    # FSDP2's on both ranks, but for each layer's one-row shared_expert_gate, which rank 0 holds alone
    assert [r["tensors"] for r in reports] == [56, 56] and [r["held"] for r in reports] == [44, 42], reports


@pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_LAYOUTS") != "all",
    reason="4 ranks on a 2x2 mesh: make layouts (WEIGHTSYNC_LAYOUTS=all); make test: 2 ranks; the unit tier "
    "cuts the strided layout",
)
def test_fsdp2_over_tensor_parallel_reads_the_strided_cut(tmp_path: Path) -> None:
    reports = _run("fsdp-tp", 4, tmp_path / "out")
    assert len({r["digest"] for r in reports}) == 1
    for r in reports:
        assert r["unsupported"] == "" and r["checked"] == r["tensors"] == r["held"] == 28
        assert r["meshes"] == [[[2, 2], [0, 1, 2, 3]]]  # norms and embeddings on the dp slice, placed on the root
        assert r["placements"] == [
            "(Shard(0), Replicate())",  # FSDP2 only: replicated over tensor parallelism
            "(Shard(0), Shard(0), cut in order [1, 0])",  # column-parallel, then FSDP2 (_StridedShard)
            "(Shard(0), Shard(1))",  # row-parallel, FSDP2 on the rows
        ]
    assert reports[0]["extra_rows"] == [2, 1, 1, 1]  # tp 3 + 2 rows, then dp halves of each
