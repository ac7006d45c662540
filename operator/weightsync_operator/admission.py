"""The built-in gang admission: a job's pods are created only once the whole job fits, so jobs never deadlock on GPUs.

Without it, ten jobs created at once on 16 GPUs could each get part of what
they need (replicas here, two of four trainer ranks there) and none could run.
With it, a job that wants to run is *queued* (no pod of it exists; ``Admitted``
False, saying what is short) until its every pod (coordinator, replicas, trainer
ranks) fits the nodes' free capacity at once (:mod:`capacity`); then it is
*granted* (``Admitted`` True) and its pods are created. A grant is held while the
job runs (a gang restart re-creates its ranks into the room it holds) and
released when it is suspended, finishes or is deleted, which wakes the queue.

A round of admission reads the nodes and every unfinished pod of the cluster
(two LISTs), keeps room first for pods that wait for a node (any namespace's:
the scheduler will place those) and for the pods that granted jobs have not
created yet, then walks the queued jobs in creation order and grants each one
that fits: a job that does not fit does not hold back a smaller one behind it
(Kueue's BestEffortFIFO). Rounds are serialized and shared: a job that asks
within ``FRESH_S`` of the last round, with no grant released since, gets that
round's answer, or, if it was not in it, is fitted on what that round left (no
new reads: fifty jobs resumed at once cost one round); a queued job asks again
every ``RECHECK_S`` (room that pods of other workloads free is seen then) or
when a grant is released.

The grants of this process are in memory; across a restart the job's status
(``Admitted`` True) and its pods are the record: a job that has pods, or says it
was admitted, keeps its grant. Jobs that Kueue admits (the
``kueue.x-k8s.io/queue-name`` label) never come here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from weightsync.resources import JOB_LABEL
from weightsync_operator import capacity
from weightsync_operator.capacity import Node, Shape
from weightsync_operator.kubeapi import Api, Obj
from weightsync_operator.names import COMPONENT_LABEL, Component

Key = tuple[str, str]
FRESH_S = 5.0
RECHECK_S = 30.0
"""How often a queued job asks again without being woken."""
UNFINISHED = "status.phase!=Succeeded,status.phase!=Failed"


@dataclass(frozen=True)
class Want:
    """A job's demand: its creation time (the queue's order) and the shape of each of its pods, by component;
    ``colocate``: its trainer and inference pods must share one node (the coordinator goes anywhere)."""

    created: str
    pods: dict[str, list[Shape]]
    colocate: bool = False

    @property
    def shapes(self) -> list[Shape]:
        return [s for shapes in self.pods.values() for s in shapes]

    def fit(self, free: list[Node], pods: dict[str, list[Shape]] | None = None) -> list[Node] | None:
        """``free`` once ``pods`` (default: all of the job's) took their nodes, or None when they do not fit."""
        pods = self.pods if pods is None else pods
        loose = [s for c, shapes in pods.items() if c == Component.COORDINATOR or not self.colocate for s in shapes]
        together = [s for c, shapes in pods.items() if c != Component.COORDINATOR and self.colocate for s in shapes]
        after = capacity.place(free, loose)
        return capacity.place(after, together, colocate=True) if after is not None and together else after


@dataclass(frozen=True)
class Decision:
    """Whether a job may have its pods now, why (for its ``Admitted`` condition), and where: ``node_labels`` by
    component, those of the flavors Kueue assigned (the built-in admission leaves placement to the job)."""

    admitted: bool
    message: str
    node_labels: dict[str, dict[str, str]] = field(default_factory=dict)


@dataclass
class _Round:
    at: float
    free: list[Node]
    """What the nodes have left after the round's grants: a job that asks first within ``FRESH_S`` is fitted here."""
    answers: dict[Key, Decision] = field(default_factory=dict)


class Gate:
    """One per operator; ``decide`` from any reconcile thread."""

    def __init__(self, api: Api, wake: Callable[[Key], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._api, self._wake, self._clock = api, wake, clock
        self._lock = threading.Lock()
        self._queued: dict[Key, Want] = {}
        self._granted: dict[Key, Want] = {}
        self._round: _Round | None = None
        self.rounds = 0
        """Rounds run so far (each two LISTs): the gate's cost, for tests and benchmarks."""

    def decide(self, key: Key, want: Want, holds: bool) -> Decision:
        """Whether ``key`` may have pods now; ``holds``: it has GPU pods already or its status says it was admitted
        (it keeps its grant, e.g. across an operator restart)."""
        with self._lock:
            if key in self._granted or holds:
                self._queued.pop(key, None)
                self._granted[key] = want
                return Decision(True, _granted(want))
            self._queued[key] = want
            if self._round is None or self._clock() - self._round.at >= FRESH_S:
                self._round = self._run(key)
            elif key not in self._round.answers:  # a newcomer since: fitted on what the round left, no new reads
                self._round.answers[key] = self._fit(self._round, key, want)
            answer = self._round.answers[key]
        return answer

    def release(self, key: Key) -> None:
        """``key`` no longer runs (suspended, finished, deleted): its room goes back and the queue is woken."""
        with self._lock:
            self._queued.pop(key, None)
            released = self._granted.pop(key, None) is not None
            if released:
                self._round = None
            waiting = list(self._queued)
        if released:
            for queued in waiting:
                self._wake(queued)

    def _run(self, asking: Key) -> _Round:
        self.rounds += 1
        pods = self._api.list("Pod", "", "", field_selector=UNFINISHED)
        free = capacity.nodes(self._api.list("Node", "", ""), pods)
        unbound = sorted(
            (p for p in pods if not p["spec"].get("nodeName") and not p["spec"].get("schedulingGates")),
            key=lambda p: str(p["metadata"].get("creationTimestamp", "")),
        )
        for pod in unbound:  # the scheduler places these first; those that fit nowhere hold nothing
            free = capacity.place(free, [Shape.of(pod["metadata"]["name"], pod["spec"])]) or free
        for key, want in sorted(self._granted.items(), key=lambda item: item[1].created):
            free = want.fit(free, _not_created(key, want, pods)) or free
        out = _Round(self._clock(), free)
        for key, want in sorted(self._queued.items(), key=lambda item: (item[1].created, item[0])):
            out.answers[key] = self._fit(out, key, want)
            if out.answers[key].admitted and key != asking:
                self._wake(key)
        return out

    def _fit(self, round_: _Round, key: Key, want: Want) -> Decision:
        """Grant ``key`` if it fits what ``round_`` left (which its grant then takes)."""
        after = want.fit(round_.free)
        if after is None:
            return Decision(False, f"the whole job does not fit now: {capacity.shortfall(round_.free, want.shapes)}")
        round_.free = after
        self._granted[key] = self._queued.pop(key)
        return Decision(True, _granted(want))


def _granted(want: Want) -> str:
    gpus = sum(sum(a for r, a in s.requests.items() if r.endswith("/gpu")) for s in want.shapes)
    return f"the whole job fits: {len(want.shapes)} pods, {gpus} GPUs"


def _not_created(key: Key, want: Want, pods: list[Obj]) -> dict[str, list[Shape]]:
    """Pods of a granted job that do not exist yet (by component: a job's pods of one component are alike)."""
    namespace, job = key
    existing: dict[str, int] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if pod["metadata"].get("namespace") == namespace and labels.get(JOB_LABEL) == job:
            component = labels.get(COMPONENT_LABEL, "")
            existing[component] = existing.get(component, 0) + 1
    return {component: shapes[existing.get(component, 0) :] for component, shapes in want.pods.items()}
