"""Python's cyclic garbage collector held off while a version's regions move.

A process of the sharded path holds tens of thousands of long-lived objects (the plan's regions and boxes, the
tables, torch's own), and each version allocates a few per region (views, fills, launch-table rows): enough that
the collector's oldest generation came due about one version in seven, inside the transfer, and scanned everything
(2x H200 / 1x H200, Qwen3-8B, ``bench/ipc_regions_gpu.py``: versions of 78-138 ms among versions of 20-23 ms; none
with the collector off). A region's garbage is freed by reference counting as it goes; the cycles the collector
finds wait until the version moved, when it runs as it would have. A walk (a generator) pauses it while it runs,
not across its yields: the consumer's code between pieces is the application's, and a walk dropped unfinished must
not keep it off.

    with collector.paused():   # nests, and across threads: on again when the last one leaves, if it was on
        ...

    @collector.during          # a function: paused while it runs
    @collector.during_steps    # a generator: paused while each step runs, not across its yields
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Generator, Iterator
from typing import ParamSpec, TypeVar

_lock = threading.Lock()
_inside = 0
_was_on = False


class paused:  # a function to its callers: ``with collector.paused():``
    """No automatic collection inside (an explicit ``gc.collect`` still runs); the collector's state before the
    first of overlapping pauses (a rank's sends to several replicas, each on a thread) comes back after the last.
    A class, not a generator-based context manager: a walk enters one per step (a few hundred a version)."""

    def __enter__(self) -> None:
        global _inside, _was_on
        with _lock:
            if not _inside:
                _was_on = gc.isenabled()
                gc.disable()
            _inside += 1

    def __exit__(self, *_: object) -> None:
        global _inside
        with _lock:
            _inside -= 1
            if not _inside and _was_on:
                gc.enable()


P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def during(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run with the collector paused (``regions.send``: a rank's sends, its digests' host syncs included)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with paused():
            return fn(*args, **kwargs)

    return run


def during_steps(walk: Callable[P, Iterator[T]]) -> Callable[P, Iterator[T]]:
    """The generator ``walk`` with each step (up to the item it yields) run with the collector paused
    (``regions.receive``); closed when its consumer closes it."""

    @functools.wraps(walk)
    def steps(*args: P.args, **kwargs: P.kwargs) -> Iterator[T]:
        it = walk(*args, **kwargs)
        try:
            while True:
                with paused():
                    try:
                        item = next(it)
                    except StopIteration:
                        return
                yield item
        finally:
            if isinstance(it, Generator):  # its own cleanup (a walk releases its links) as the consumer leaves
                it.close()

    return steps


__all__ = ["during", "during_steps", "paused"]
