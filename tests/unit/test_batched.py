"""The batched digest and copy kernels under Triton's interpreter on the CPU (``batched_kernels.py``, in a pytest
of its own: Triton reads ``TRITON_INTERPRET`` at import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def test_the_batched_kernels_under_tritons_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton's interpreter runs the kernels on the CPU")
    checks = Path(__file__).with_name("batched_kernels.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "8 passed" in run.stdout, run.stdout[-2000:]
