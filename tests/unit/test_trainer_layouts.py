"""What the trainer's layout cannot read makes it unsupported, naming the tensor, so every replica takes the
gathered path. (Readable trainers: ``tests/integration/test_trainer_layouts.py``, real gloo ranks.)

The cases that need a mesh of 8 ranks (torch's own uneven cut of a strided dimension) run on torch's fake
process group: real DTensors and DeviceMeshes, with collectives that move nothing, which the layout never
calls. That is the one stand-in here, for 8 processes this machine cannot afford in a unit test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from weightsync.sharding.boxes import Box
from weightsync_trainer.layouts import trainer_layout
from weightsync_trainer.sources import ModuleSource

pytestmark = pytest.mark.unit


@pytest.fixture
def eight_ranks() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _module(**params: torch.Tensor) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, value in params.items():
        setattr(module, name, torch.nn.Parameter(value))
    return module


def test_a_plain_module_is_rank_zeros_whole() -> None:
    layout = trainer_layout(ModuleSource(_module(w=torch.ones(6, 4), b=torch.ones(6))))
    assert layout.unsupported == "" and layout.world_size == 1
    assert [layout.shard(t, 0) for t in range(2)] == [Box.whole((6, 4)), Box.whole((6,))]


def test_a_source_that_computes_its_tensors_is_unsupported() -> None:
    class Merged(ModuleSource):
        pass

    layout = trainer_layout(Merged(_module(w=torch.ones(2, 2))))
    assert layout.unsupported == "Merged computes the tensors it publishes from several parameters"


def test_torchs_uneven_strided_cut_and_partial_sums_are_unsupported_naming_the_tensor(eight_ranks: None) -> None:
    mesh = init_device_mesh("cpu", (4, 2))
    strided = [_StridedShard(0, split_factor=2), Shard(0)]  # FSDP2 over tensor parallelism, 25 rows
    local, _ = _compute_local_shape_and_global_offset((25, 8), (4, 2), [0, 0], strided)
    w = DTensor.from_local(torch.zeros(local), mesh, strided, run_check=False, shape=torch.Size((25, 8)), stride=(8, 1))
    layout = trainer_layout(ModuleSource(_module(w=w)))
    assert layout.unsupported == (
        "tensor 'w' (_S(0, 2), S(0) on mesh [4, 2]): rank 6 holds [2, 8] at [12, 0] in DTensor's cut, "
        "[12:13, 0:8] in the layout's"
    )
    even = DTensor.from_local(
        torch.zeros(3, 8), mesh, strided, run_check=False, shape=torch.Size((24, 8)), stride=(8, 1)
    )
    assert trainer_layout(ModuleSource(_module(w=even))).unsupported == ""
    p = DTensor.from_local(torch.zeros(4, 4), init_device_mesh("cpu", (8,)), [Partial()], run_check=False)
    assert trainer_layout(ModuleSource(_module(p=p))).unsupported == (
        "tensor 'p' has a P(sum) placement, which the sharded path cannot send from"
    )
