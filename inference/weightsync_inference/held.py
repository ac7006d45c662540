"""What a worker computes with, parameter by parameter: the digests an audit compares across replicas.

A receiver checks the bytes that arrive; this says what the engine holds once they landed and vLLM post-processed
them, so two replicas of one layout that hold the same weights answer the same digests, whichever path loaded them
(regions landed by weightsync, or vLLM's own loader given the full tensors).

vLLM's CPU backend repacks every linear layer's weight into a kernel's own form after loading (oneDNN or its AMX
kernel) and leaves the parameter empty (``dispatch_cpu_unquantized_gemm(remove_weight=True)``), so the parameter
no longer says what the layer multiplies by. Those weights are read back through the layer's own kernel: the
identity matrix through ``cpu_linear`` gives the weight transposed, exactly (each output is one product by 1.0
plus products by 0.0, accumulated in float32: nothing rounds; a weight of -0.0 reads back as +0.0).
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.channels import digests

ROWS = 2048
"""Identity rows per kernel call: bounds the probe's memory for wide layers (a 14336-wide input: 2048 x 14336)."""


def parameter_digests(model: torch.nn.Module) -> dict[str, str]:
    """``name -> digest`` (``digests.digest``) of every parameter the worker holds, kernel-packed weights included."""
    held = {name: digests.digest(p.detach().contiguous()) for name, p in model.named_parameters() if p.numel() > 0}
    with torch.no_grad():
        for name, module in model.named_modules():
            weight, kernel = getattr(module, "weight", None), getattr(module, "cpu_linear", None)
            if callable(kernel) and isinstance(weight, torch.Tensor) and weight.numel() == 0:
                held[f"{name}.weight".lstrip(".")] = digests.digest(_through_kernel(module))
    return held


def _through_kernel(module: Any) -> torch.Tensor:
    """The ``(out, in)`` weight a packed linear layer multiplies by, read through its kernel (``cpu_linear``, which
    ignores the empty ``weight`` it is handed: the packed weight is bound in it)."""
    # a row-parallel layer keeps a slice of the input; a replicated one (the router's gate) keeps all of it
    width = int(getattr(module, "input_size_per_partition", None) or module.input_size)
    transposed = []
    for start in range(0, width, ROWS):
        probe = torch.zeros(min(ROWS, width - start), width, dtype=module.weight.dtype)
        probe[:, start : start + probe.shape[0]].fill_diagonal_(1.0)
        transposed.append(module.cpu_linear(probe, module.weight, None))  # rows of the weight's transpose
    return torch.cat(transposed).t().contiguous()


__all__ = ["parameter_digests"]
