"""Suite-wide rules: every test belongs to exactly one tier; GPU tests say why they skip."""

from __future__ import annotations

import pytest

TIERS = ("unit", "integration", "e2e", "gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _cuda_available()
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid}: needs exactly one tier marker of {TIERS}, has {tiers}")
        if tiers[0] == "gpu" and not cuda:
            item.add_marker(
                pytest.mark.skip(reason="no CUDA device here: GPU tests run on the GPU machine (docs/gpu-channels.md)")
            )


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
