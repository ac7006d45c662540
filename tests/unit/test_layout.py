"""The folders are the architecture: each component imports only what the design allows.

Checked statically on every module (any import anywhere, lazy ones included) and at run
time for the operator (importing it must not load torch or vLLM).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "weightsync": ROOT / "weightsync",
    "weightsync_trainer": ROOT / "trainer" / "weightsync_trainer",
    "weightsync_inference": ROOT / "inference" / "weightsync_inference",
    "weightsync_operator": ROOT / "operator" / "weightsync_operator",
}
# package -> top-level modules it must never import (anywhere, lazily or not)
FORBIDDEN = {
    "weightsync_operator": {
        "torch",
        "vllm",
        "safetensors",
        "transformers",
        "weightsync_trainer",
        "weightsync_inference",
    },
    "weightsync_trainer": {"vllm", "weightsync_inference", "weightsync_operator", "kopf"},
    "weightsync_inference": {"weightsync_trainer", "weightsync_operator", "kopf", "transformers"},
}
# (package, folder) -> modules it may import although FORBIDDEN says no: vLLM's trainer-side API is one of the
# frameworks weightsync_trainer.integrations plugs into (the trainer still never imports vLLM's engine side).
ALLOWED_IN = {("weightsync_trainer", ROOT / "trainer" / "weightsync_trainer" / "integrations"): {"vllm"}}


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, top-level module, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0], id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module.split(".")[0], id(node) in top_level))
    return out


def _modules(package: str) -> list[Path]:
    return sorted(PACKAGES[package].rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_component_boundaries(package: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {mod}"
        for path in _modules(package)
        for line, mod, _ in _imports(path)
        if mod in FORBIDDEN[package] and not _allowed(package, path, mod)
    ]
    assert not bad, "\n".join(bad)


def _allowed(package: str, path: Path, mod: str) -> bool:
    return any(p == package and path.is_relative_to(folder) and mod in mods for (p, folder), mods in ALLOWED_IN.items())


def test_core_imports_torch_only_in_channels_and_components_only_in_cli() -> None:
    bad = []
    for path in _modules("weightsync"):
        rel = path.relative_to(ROOT / "weightsync").as_posix()
        for line, mod, top in _imports(path):
            if mod in {"weightsync_trainer", "weightsync_inference", "weightsync_operator"} and (
                not rel.startswith("cli/") or top
            ):
                bad.append(f"weightsync/{rel}:{line} imports {mod} (only CLI commands may, inside the command)")
            if mod in {"torch", "safetensors", "vllm"} and not rel.startswith("channels/") and top:
                bad.append(
                    f"weightsync/{rel}:{line} imports {mod} at module level (torch lives in weightsync.channels)"
                )
    assert not bad, "\n".join(bad)


def test_generated_code_stays_behind_the_coordinators_edge() -> None:
    """Only the coordinator touches generated protobuf types; channels never reach for gRPC."""
    bad = []
    for path in _modules("weightsync"):
        rel = path.relative_to(ROOT / "weightsync").as_posix()
        text = path.read_text()
        if "coordinator._proto" in text and not rel.startswith("coordinator/"):
            bad.append(f"weightsync/{rel} imports the generated code (convert in weightsync.coordinator.serde)")
        if rel.startswith("channels/") and ("weightsync.coordinator" in text or "import grpc" in text):
            bad.append(f"weightsync/{rel}: channels must not import the coordinator or gRPC")
    assert not bad, "\n".join(bad)


def test_component_folders_have_no_init_that_could_shadow() -> None:
    for folder in ("operator", "trainer", "inference", "proto", "crds", "helm", "images", "e2e"):
        assert not (ROOT / folder / "__init__.py").exists(), f"{folder}/__init__.py would shadow an import name"


def test_importing_operator_loads_neither_torch_nor_vllm() -> None:
    code = "import sys, weightsync_operator, weightsync.cli.main\n"
    code += "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT / "tests")
    assert out.stdout.strip() == "[]"
