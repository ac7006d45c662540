"""Keeping ``--json`` output clean when libraries (vLLM, its worker processes) log to stdout."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO


@contextlib.contextmanager
def stdout_for_json(enabled: bool) -> Iterator[TextIO]:
    """While active, file descriptor 1 (inherited by child processes) points at stderr.

    Yields a stream on the original stdout for the one JSON document.
    """
    if not enabled:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(os.dup(saved), "w")
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield out
    finally:
        out.flush()
        out.close()
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
