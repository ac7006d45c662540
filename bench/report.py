"""How a benchmark reports: its result as JSON on stdout, and in the ``--json`` file when one is named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(result: dict[str, Any], path: str) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        Path(path).write_text(text)
