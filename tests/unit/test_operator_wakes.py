"""A job's reconcile is woken at once by a change of its spec, and lets a burst of its children's events settle."""

from __future__ import annotations

import asyncio
import time

import pytest

from weightsync_operator import handlers

pytestmark = pytest.mark.unit
KEY = ("ml", "grpo")


def test_a_childs_event_settles_and_a_spec_change_cuts_the_wait_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "SETTLE_S", 5.0)  # far above any scheduling delay on a loaded machine

    async def scenario() -> tuple[float, float]:
        wakers = handlers.Wakers()
        wake = wakers.register(KEY)
        wakers.wake(KEY)  # a pod went
        with pytest.raises(TimeoutError):  # still settling a second later
            await asyncio.wait_for(wake.settle(), 1.0)

        wake.clear()
        wakers.wake(KEY)
        started = time.monotonic()
        waiting = asyncio.ensure_future(wake.settle())
        await asyncio.sleep(0.2)
        wakers.wake(KEY, spec=True)  # spec.suspend patched meanwhile
        await waiting
        cut_short = time.monotonic() - started

        wake.clear()
        wakers.wake(KEY, spec=True)
        started = time.monotonic()
        await wake.settle()
        return cut_short, time.monotonic() - started

    cut_short, spec_change = asyncio.run(scenario())
    assert cut_short < 4.0 and spec_change < 4.0, (cut_short, spec_change)
