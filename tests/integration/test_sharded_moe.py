"""A mixture-of-experts trainer on the sharded path, through the product (make sharded).

Two FSDP2 ranks of the tiny Qwen2-MoE, each on its own host (network namespaces), publish through
``Publisher`` to a TP=2 replica that takes regions and a TP=2 replica that cannot (the gathered path, in the
same versions), through the coordinator and the agents, as ``test_sharded_publish.py`` does for the dense
model. transformers 5 fuses a layer's experts into one parameter and publishes them one by one under the
checkpoint's names; FSDP2 cuts the fused parameter by expert, so each expert lies whole on one rank, which
sends it cut from its shard (``naming.View``). Checked: each TP=2 worker received only its regions (its
experts' TP shards among them), holds bit for bit what vLLM's loader made of the full tensors on the gathered
replica (the CPU backend's prepacked experts included), and both replicas generate like transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests import support
from tests.integration.test_sharded_publish import (
    ALL,
    Fleet,
    assert_the_versions_after_the_first_move_as_regions,
    running,
)
from weightsync_trainer import tiny_models

DEEP_MOE = replace(tiny_models.PRESETS["tiny-qwen2-moe"], num_layers=6)
"""The tiny Qwen2-MoE with 6 layers: its layouts list more than an ordinary request list may hold (158 tensors, a
TP=2 worker's 68 parameters), as every real model's do."""

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not ALL, reason="make sharded (WEIGHTSYNC_SHARDED=all); make test runs the dense model"),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running(tmp_path_factory.mktemp("sharded-moe"), support.tiny_model(DEEP_MOE), (2, 2)) as f:
        yield f


def test_a_fsdp2_moe_trainer_sends_each_expert_from_the_rank_that_holds_it(fleet: Fleet) -> None:
    assert_the_versions_after_the_first_move_as_regions(fleet, "moe")
