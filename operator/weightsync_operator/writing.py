"""Where the reconciles' writes queue for the API server: one lane, the answer to a spec change first.

On a busy control plane (the API server, kine's SQLite, the controllers and KWOK
on 2 shared cores) a write takes hundreds of milliseconds, and what a user waits
for after a spec change is the job's status. Suspending 30 jobs at once, each
pass sent its status patch beside its children's applies and deletes, passes ran
8 at a time, and the API server took the writes in the order they came: a job
whose pass started late had its status land behind dozens of other jobs' writes
(status p99 5-12 s for 30 jobs on a loaded machine). Every write of a pass now
goes through one ``Lane``, at most ``WIDTH`` in flight, and a free writer takes
a status patch that answers a new ``metadata.generation`` before any other write
waiting; the others go in the order they came, and none starts while an answer is
being written (suspending 50 jobs, the answers shared the API server with up to 16
children's writes; status p99 1.78-2.28 s on a quiet 2-core machine). So the
statuses of jobs changed together land first and their children follow. Only the
answers jump the queue (at most one per spec change): a job's other status
patches, for pods coming and going, keep their turn. While many jobs resume those
never stop coming, and put ahead of every child's write they could hold back the
very pods being waited for (tried: 4 of 30 jobs were not Running 300 s after a
resume on a loaded machine).

Nothing is dropped or reordered within a pass: a pass waits on its own writes
(``run``), so the order a pass needs (a gang restart's count before the ranks'
deletes, a pod's claim before the pod) holds whatever else is queued.
"""

from __future__ import annotations

import enum
import functools
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

R = TypeVar("R")
WIDTH = 16
"""Writes in flight at once: enough to keep the API server busy (64 did no better than 8 on 2 cores,
docs/benchmarks.md), few enough that an urgent write waits behind at most this many."""


class Urgency(enum.IntEnum):
    """The order in which waiting writes are sent (lowest first)."""

    ANSWER = 0
    """The status patch of a pass that sees a spec generation its status has not observed."""
    IN_TURN = 1
    """Every other write: the children's, and status patches that answer no spec change."""


class Lane:
    """A fixed number of writer threads taking the most urgent waiting write first; threads start as needed."""

    def __init__(self, width: int = WIDTH, name: str = "write") -> None:
        self._width, self._name = width, name
        self._queue: queue.PriorityQueue[tuple[Urgency, int, Callable[[], Any], Future[Any]]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._writers = 0
        self._queued = 0  # answers waiting for a writer
        self._flying = 0  # answers being written
        self._answered = threading.Condition(self._lock)

    def submit(self, urgency: Urgency, write: Callable[..., R], *args: Any) -> Future[R]:
        """Queue ``write(*args)``; its future holds what it returned or raised."""
        future: Future[R] = Future()
        with self._lock:  # counted before a writer can take it (``_may_start`` uncounts it)
            if urgency is Urgency.ANSWER:
                self._queued += 1
                self._answered.notify_all()  # a writer holding a child's write takes this one instead
            self._queue.put((urgency, next(self._order), functools.partial(write, *args), future))
            if self._writers < self._width:
                self._writers += 1
                name = f"{self._name}-{self._writers}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
        return future

    def run(self, urgency: Urgency, write: Callable[..., R], *args: Any) -> R:
        """``write(*args)`` in its turn, waited for."""
        return self.submit(urgency, write, *args).result()

    def each(self, urgency: Urgency, write: Callable[[Any], R], items: list[Any]) -> list[R]:
        """``write`` of every item, in flight together; an error is raised (the first in ``items``' order)."""
        futures = [self.submit(urgency, write, item) for item in items]
        return [f.result() for f in futures]

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            urgency, _, write, future = item
            if not self._may_start(urgency):
                self._queue.put(item)  # its place kept (its order number); the answer waiting goes first
                continue
            if not future.set_running_or_notify_cancel():
                self._done(urgency)
                continue
            try:
                future.set_result(write())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting pass, which raises it
                future.set_exception(err)
            finally:
                self._done(urgency)

    def _may_start(self, urgency: Urgency) -> bool:
        """Whether this write goes out now. An answer does; a child's write waits while answers are being written
        (so the statuses changed together have the API server to themselves) and yields to an answer queued
        meanwhile (False: the caller puts it back and takes the answer)."""
        with self._answered:
            if urgency is Urgency.ANSWER:
                self._queued -= 1
                self._flying += 1
                return True
            self._answered.wait_for(lambda: self._queued > 0 or self._flying == 0)
            return self._queued == 0

    def _done(self, urgency: Urgency) -> None:
        if urgency is Urgency.ANSWER:
            with self._answered:
                self._flying -= 1
                self._answered.notify_all()
