"""Landing pieces in a worker: what it refuses before writing, whole tensors assembled for the loader, the end check.

The writes into vLLM's parameters inside its layerwise reload are checked against vLLM's own loader in
``tests/integration/test_landing.py``; here the model is a stand-in that only records what reaches its loader
(no piece below reaches a parameter).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weightsync.errors import IntegrityError, ModelMismatchError
from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import WHOLE, Fill, ParamSpec, WorkerLayout
from weightsync.tensors import TensorTable
from weightsync_inference.landing import Landing

pytestmark = pytest.mark.unit

TABLE = TensorTable.build([[("a.weight", "bfloat16", (4, 6)), ("b.weight", "float32", (3, 2))]])
# worker 1 of a TP=2 replica: rows 2:4 of a.weight into x.weight, b.weight whole to the loader
LAYOUT = WorkerLayout(
    1,
    (ParamSpec("x.weight", "bfloat16", (2, 6)),),
    (Fill(0, Box((2, 0), (2, 6)), 0, Box((0, 0), (2, 6))), Fill(1, Box.whole((3, 2)), WHOLE, Box.whole((3, 2)))),
)


def _bf16(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.bfloat16)


class LoaderOnly:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded += weights

    def get_submodule(self, name: str) -> Any:
        raise AssertionError(f"no piece here should reach a parameter (asked for {name!r})")


def test_whole_tensor_pieces_are_assembled_and_loaded_once_complete() -> None:
    model = LoaderOnly()
    landing = Landing(model, LAYOUT, TABLE)
    b = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    landing.land([(Fill(1, Box((2, 0), (1, 2)), WHOLE, Box((2, 0), (1, 2))), b[2:].clone())])
    assert model.loaded == []  # not whole yet
    landing.land([(Fill(1, Box((0, 0), (2, 2)), WHOLE, Box((0, 0), (2, 2))), b[:2].flatten().clone())])
    assert [n for n, _ in model.loaded] == ["b.weight"] and torch.equal(model.loaded[0][1], b)
    assert landing.nbytes == 6 * 4


@pytest.mark.parametrize(
    "piece, words",
    [
        ((Fill(0, Box((2, 0), (2, 6)), 0, Box((0, 0), (2, 6))), torch.zeros(12)), "float32"),
        ((Fill(0, Box((2, 0), (2, 6)), 0, Box((0, 0), (2, 6))), _bf16(6)), "came as 6 elements"),
        ((Fill(0, Box((2, 0), (2, 6)), 3, Box((0, 0), (2, 6))), _bf16(12)), "#3"),
        ((Fill(0, Box((0, 0), (4, 6)), 0, Box((0, 0), (4, 6))), _bf16(24)), "outside"),
        ((Fill(0, Box((4, 0), (1, 6)), 0, Box((0, 0), (1, 6))), _bf16(6)), "outside"),
        ((Fill(0, Box((0, 0), (4, 6)), WHOLE, Box.whole((4, 6))), _bf16(24)), "whole"),
        ((Fill(1, Box((0, 0), (1, 2)), WHOLE, Box((1, 0), (1, 2))), torch.zeros(2)), "not where it comes"),
        ((Fill(7, Box((0,), (1,)), 0, Box((0,), (1,))), torch.zeros(1)), "tensor #7"),
    ],
)
def test_a_piece_that_does_not_fit_is_refused_naming_it(piece: tuple[Fill, torch.Tensor], words: str) -> None:
    model = LoaderOnly()
    with pytest.raises(ModelMismatchError, match=words):
        Landing(model, LAYOUT, TABLE).land([piece])
    assert model.loaded == []


def test_more_elements_than_the_layout_gives_a_parameter_fail_before_writing() -> None:
    layout = WorkerLayout(
        0, (ParamSpec("x.weight", "bfloat16", (4, 6)),), (Fill(0, Box((0, 0), (2, 6)), 0, Box((0, 0), (2, 6))),)
    )
    piece = (Fill(0, Box((0, 0), (4, 6)), 0, Box((0, 0), (4, 6))), torch.zeros(24, dtype=torch.bfloat16))
    with pytest.raises(IntegrityError, match=r"'x.weight' would get 24 elements .* gives it 12"):
        Landing(LoaderOnly(), layout, TABLE).land([piece])


def test_finish_names_every_parameter_and_whole_tensor_short_of_elements() -> None:
    landing = Landing(LoaderOnly(), LAYOUT, TABLE)
    landing.land([(Fill(1, Box((0, 0), (2, 2)), WHOLE, Box((0, 0), (2, 2))), torch.zeros(4))])
    with pytest.raises(IntegrityError, match=r"worker 1: .* x.weight \(0 of 12 elements\), b.weight \(whole: 4 of 6"):
        landing.finish()
