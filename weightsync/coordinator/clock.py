"""The coordinator's time: one injectable source for every deadline the core keeps.

The core reads two clocks. Monotonic time decides everything that counts down:
lease expiry, a version's timeout, the window in which a replica that closed its
stream still counts as watching, and ``wait_version``'s deadline. Wall time only
labels records for people and the store (a version's ``opened_at`` and
``settled_at``). Both come from one ``Clock`` so a test (or a simulation) can
hold time still and move it on by hand: leases and timeouts are then decided by
``ManualClock.advance`` and a call to ``Coordinator.tick()``, not by sleeping.

What a clock does not drive is a blocked thread. ``wait_version`` sleeps on the
core's condition for real, bounded by what the clock says is left of its
deadline, and recomputes that after every wake-up: a notification wakes it at
once, and under ``SystemClock`` so does the deadline. Under a ``ManualClock`` a
positive timeout ends only once the clock was advanced past it (seen at the next
bounded wake-up), so single-threaded tests ask with a timeout of 0.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (deadlines, expiry)."""

    def time(self) -> float:
        """Seconds since the epoch (timestamps on records)."""


class SystemClock:
    """The process's own clocks: ``time.monotonic`` and ``time.time``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


SYSTEM_CLOCK = SystemClock()
"""The default clock (stateless: one instance serves every coordinator)."""


class ManualClock:
    """Time that moves only when told to (tests, simulations). Thread-safe.

    It starts well above zero: a record's ``opened_mono`` of 0.0 marks a version
    recovered from the store (no monotonic reference, never timed out), so a clock
    starting at 0 would make a version opened at the start look recovered.
    """

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def time(self) -> float:
        with self._lock:
            return self._wall_offset + self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock never goes backwards; advance by >= 0, got {seconds}")
        with self._lock:
            self._now += seconds
