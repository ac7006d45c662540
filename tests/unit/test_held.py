"""``held``: the digests of what a worker computes with, packed linear weights read back through vLLM's own CPU
kernels (the dispatch the CPU backend runs after loading, on real weights; no engine). On a CPU whose instruction
set vLLM's packing kernels do not take (an AMD EPYC without AVX-512, say), the backend keeps the weight as it is
and ``held`` reads that: the same digests are asserted either way."""

from __future__ import annotations

import pytest
import torch

from weightsync.channels import digests
from weightsync_inference import held

pytestmark = pytest.mark.unit


def _packed(weight: torch.Tensor, width: str = "input_size_per_partition") -> torch.nn.Module:
    """A linear layer after vLLM's CPU post-processing: the weight in its kernel, the parameter left empty.
    ``width``: where the layer says how wide its input is (a replicated layer, the MoE router's gate: input_size)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    setattr(layer, width, weight.shape[1])
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    return layer


@pytest.mark.parametrize(
    ("rows", "columns", "dtype"),
    [
        (96, 64, torch.bfloat16),  # oneDNN, or the AMX kernel where the CPU has one
        (8, 64, torch.bfloat16),  # fewer rows than a kernel tile: a float32 copy inside the kernel
        (96, 64, torch.float32),
        (40, held.ROWS + 64, torch.bfloat16),  # wider than one probe
    ],
)
def test_a_packed_linear_weight_reads_back_bit_for_bit(rows: int, columns: int, dtype: torch.dtype) -> None:
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows)).to(dtype)
    model = torch.nn.Sequential(_packed(weight))
    assert held.parameter_digests(model) == {"0.weight": digests.digest(weight)}


def test_a_replicated_layer_reads_back_by_its_input_size() -> None:
    weight = torch.randn(4, 64, dtype=torch.bfloat16)
    assert held.parameter_digests(_packed(weight, "input_size")) == {"weight": digests.digest(weight)}


def test_one_changed_value_changes_the_digest() -> None:
    weight = torch.randn(96, 64, dtype=torch.bfloat16)
    changed = weight.clone()
    changed[17, 3] = changed[17, 3].item() * 2 + 1
    assert held.parameter_digests(_packed(weight)) != held.parameter_digests(_packed(changed))


def test_parameters_the_backend_keeps_are_digested_as_they_are() -> None:
    norm = torch.nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.uniform_()
    assert held.parameter_digests(torch.nn.Sequential(norm)) == {
        "0.weight": digests.digest(norm.weight.detach()),
        "0.bias": digests.digest(norm.bias.detach()),
    }
