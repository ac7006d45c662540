"""docs/environment.md names every environment variable the components read or set, and nothing else.

The code is scanned (AST, every module of the four packages): string constants passed to
``os.environ``/``env`` lookups or set as a pod's ``env`` entry, and every ``"WEIGHTSYNC_..."``
literal or ``*_ENV`` constant. The options' ``WEIGHTSYNC_<OPTION>`` variables are one row of prose
there (``weightsync.cli.main``), not scanned.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "weightsync", ROOT / "trainer", ROOT / "inference", ROOT / "operator"]
NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
LOOKUPS = ("get", "getenv")
OPTION_PREFIX = "WEIGHTSYNC_"


def _names_in(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("WEIGHTSYNC_"):
            if NAME.match(node.value):
                found.add(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOOKUPS:
            owner = ast.unparse(node.func.value)
            if (owner.endswith("environ") or owner == "env" or owner == "os") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and NAME.match(arg.value):
                    found.add(arg.value)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith(("environ", "env")):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.add(node.slice.value)
        elif isinstance(node, ast.Dict):  # a pod's env entry: {"name": "X", "value": ...}
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if "name" in keys and ("value" in keys or "valueFrom" in keys):
                value = node.values[keys.index("name")]
                if isinstance(value, ast.Constant) and isinstance(value.value, str) and NAME.match(value.value):
                    found.add(value.value)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if any(t.endswith("ENV") for t in targets) and isinstance(node.value.value, str):
                found.add(node.value.value)
    return found


def _code() -> dict[str, str]:
    out: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            if "_proto" in path.parts:
                continue
            for name in _names_in(ast.parse(path.read_text(), str(path))):
                out.setdefault(name, str(path.relative_to(ROOT)))
    out.pop(OPTION_PREFIX, None)  # WEIGHTSYNC_<OPTION>: the table's prose
    return out


def _documented() -> set[str]:
    text = (ROOT / "docs" / "environment.md").read_text()
    first_cells = re.findall(r"^\| (`[A-Z][^|]*)\|", text, flags=re.MULTILINE)
    return {name for cell in first_cells for name in re.findall(r"`([A-Z][A-Z0-9_]*)`", cell)}


def test_every_variable_the_code_uses_is_in_the_table() -> None:
    missing = {name: where for name, where in _code().items() if name not in _documented()}
    assert not missing, f"add these to docs/environment.md (variable: first file using it): {missing}"


def test_the_table_names_no_variable_the_code_does_not_use() -> None:
    stale = _documented() - set(_code())
    assert not stale, f"docs/environment.md lists variables nothing reads or sets: {sorted(stale)}"
