"""docs/serving.md's "Running it by hand", run as written: the commands a user copies serve and sync.

The block is read from the page itself (the first ``bash`` block under its heading) and run by bash
with ``-euo pipefail`` inside a network namespace of its own, so its fixed ports (50051, 8000-8002)
cannot meet another test's, with ``.venv/bin`` first on ``PATH`` (the user's ``python`` and
``weightsync``). Teardown stops every process the block left running in the background.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns, support

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        os.environ.get("WEIGHTSYNC_SERVING") != "all",
        reason="the by-hand command in a network namespace of its own: make serving (WEIGHTSYNC_SERVING=all)",
    ),
]
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "serving.md"
DEADLINE_S = 720.0


def block() -> str:
    text = DOC.read_text()
    section = text[text.index("## Running it by hand") :]
    found = re.search(r"```bash\n(.*?)\n```", section, flags=re.DOTALL)
    assert found, f"{DOC}: no bash block under 'Running it by hand'"
    return found.group(1)


def test_the_by_hand_commands_serve_and_sync(tmp_path: Path) -> None:
    netns.require()
    out = tmp_path / "out.log"
    env = {
        **support.env_without_proxies(),
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "TMPDIR": str(tmp_path),
    }
    with netns.Hosts(["by-hand"]) as hosts, out.open("wb") as log:
        proc = hosts.popen(
            "by-hand", ["bash", "-euo", "pipefail", "-c", block()], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + DEADLINE_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        text = out.read_text(errors="replace")
        assert proc.returncode == 0, f"the block ended with {proc.returncode} (None: still running):\n{text[-6000:]}"
    lines = [line.strip().lower() for line in text.splitlines()]
    headers = [line for line in lines if line.startswith("x-weightsync-versions:")]
    assert headers == ["x-weightsync-versions: 0", "x-weightsync-versions: 1"], text[-6000:]
    assert "404" in lines and "published version 1: ready" in lines, text[-6000:]
    assert '{"status": "ok"}' in text
