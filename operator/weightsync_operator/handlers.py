"""The kopf wiring: what wakes a job's reconcile, where its reads come from, and how kopf is configured.

Event-driven. kopf watches every kind the operator manages, filtered on the
server to objects with the job label (``settings.watching.label_selectors``), and
keeps each in an index keyed by ``(namespace, job)``: the children, the trainer
pods, the job's WeightVersions. Any event on one of them, or on the RLJob, wakes
that job's reconcile loop (one async daemon per RLJob): at once when the job's
spec changed, after ``SETTLE_S`` otherwise (a burst of pod events costs one
pass). The pass reads the world from those indexes (no API call) and writes what
differs. The indexes are filled from a LIST before any handler runs, and an event
is indexed before its handler runs, so a reconcile always sees at least what woke
it.

A job's first pass after the operator starts reads the indexes too: kopf runs no
handler (no daemon) before every watched kind has been listed and every listed
object indexed, so they hold what a LIST has just said. (The first passes used to
read the API, about 15 GETs per job: a restart with 30 jobs sent some 500 reads
in a burst, and a change made in the seconds after it waited behind them.)

A job left alone for about ``resync_seconds`` gets one pass that reads the API
itself: the safety net for what a watch cannot say (kopf re-lists after a watch
expires but reports no deletion that happened in between). A job deleted with no
finalizer left never reaches the cleanup and kopf does not stop its loop: its
next pass fails, and a failing pass reads the RLJob; if it is gone, the loop
releases what the operator kept of it (its admission first) and ends. Each wait is drawn
from half to one and a half periods, so jobs created together (or all woken by
an operator's start) spread their safety-net reads over a period instead of
sending them in one burst. Secrets are not watched (the operator may only get
and create them): each is read once per job and start, and the reconcile's
``Memory`` keeps which exist.

With ``gang`` (the default) one ``admission.Gate`` admits jobs whole: a queued
job asks again every ``admission.RECHECK_S`` or when a grant is released, and a
grant made in another job's round wakes the job it admits.

One daemon per job never runs two reconciles of that job at once; the passes run
on a thread pool and their writes queue in one lane, status patches that answer a
spec change first (``writing``). Deleting an RLJob cancels its daemon at
once (``cancellation_timeout``), so the deletion is not held by a reconcile in
flight. kopf keeps its own bookkeeping under our group: a diff-base annotation
``weightsync.io/last-handled``, kept empty (``_NoSpecDiff``), and the finalizer
``weightsync.io/cleanup``, which holds an RLJob's deletion until its WeightVersion
objects are gone (the coordinator may not have set ownerReferences on them).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import kopf

from weightsync.metrics import OperatorMetrics
from weightsync.resources import GROUP, JOB_LABEL, VERSION, JobPhase
from weightsync_operator import admission, names
from weightsync_operator.kubeapi import KINDS, WORKLOAD, Api, Kind, Obj
from weightsync_operator.reconciling import Memory, Outcome, Settings, reconcile

log = logging.getLogger(__name__)
KIND = "RLJob"
RESULTS = ("changed", "unchanged", "error")
"""``result`` label values of weightsync_operator_reconciles_total."""
WATCHED = tuple(k for k in KINDS.values() if k.kind not in ("RLJob", "Secret"))
"""Every kind a job owns or reads, but its Secrets: watched and indexed by job (and its Kueue Workload, with the
Kueue integration on)."""
DEBOUNCE_S = 0.05
"""A wake-up for a spec change waits this long before it reconciles, so a burst of events costs one pass."""
SETTLE_S = 0.5
"""Any other wake-up (a child's event, the job's own status coming back, a grant) waits this long, unless the spec
changes meanwhile: the pods of a job suspended or resumed go and come over seconds, and a pass at each of their
events patched the status again (98 status patches suspending 30 jobs, 30 of them the answers to the spec)."""
WORKERS = 64
"""Passes in flight at once. A pass mostly waits on its writes in ``reconciling.LANE``; the passes of jobs changed
together must all have started for their status patches to queue ahead of the children's writes (with 8, the
status of the 30th job suspended at once waited for three rounds of other jobs' whole passes)."""


@dataclass(frozen=True)
class Options:
    settings: Settings
    resync_seconds: float = 600.0
    """A job with no event for about this long (0.5 to 1.5 times, drawn each time) gets one reconcile that reads the
    API itself (the safety net)."""
    gang: bool = True
    """Admit jobs whole with the built-in gate (``admission``); False lets every job create its pods at once."""


def _resource(kind: Kind) -> tuple[str, str, str]:
    group, _, version = kind.api_version.rpartition("/")
    return group, version, kind.plural


def _index_id(kind: Kind) -> str:
    return f"by_job_{kind.plural}"


class _NoSpecDiff(kopf.AnnotationsDiffBaseStorage):  # type: ignore[misc]
    """kopf's record of the last handled spec, kept empty. No handler here reacts to a diff (the daemon reconciles
    whatever changed), so all kopf did with one was write it back to the RLJob after every spec change: a PATCH
    per change (50 of them for 50 jobs suspended at once), each waking the job's reconcile once more."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}


class PhaseCounts:
    """Keeps ``weightsync_operator_jobs{phase}`` equal to the phases of the jobs this operator reconciles."""

    def __init__(self, metrics: OperatorMetrics) -> None:
        self._metrics = metrics
        self._phases: dict[tuple[str, str], str] = {}
        self._publish()

    def set(self, key: tuple[str, str], phase: str | None) -> None:
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        self._publish()

    def _publish(self) -> None:
        for phase in JobPhase:
            self._metrics.jobs.labels(phase.value).set(sum(1 for p in self._phases.values() if p == phase))


class IndexedReads:
    """One job's world as the watches hold it: ``reconciling.Reads`` without API calls (Secrets aside)."""

    def __init__(self, api: Api, objects: dict[str, list[Obj]]) -> None:
        self._api, self._objects = api, objects

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        if kind == "Secret":  # not watched; Memory keeps those known to exist, so this is rare
            return self._api.get(kind, namespace, name)
        return next((o for o in self._objects.get(kind, []) if o["metadata"]["name"] == name), None)

    def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]:
        wanted = dict(term.split("=", 1) for term in label_selector.split(",") if term)
        return [
            o
            for o in self._objects.get(kind, [])
            if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())
        ]


class Wake:
    """A job daemon's wake-up: ``any`` event, and ``spec``, set when the job's spec changed."""

    def __init__(self) -> None:
        self.any, self.spec = asyncio.Event(), asyncio.Event()

    def clear(self) -> None:
        self.any.clear()
        self.spec.clear()

    async def settle(self) -> None:
        """Wait before the pass woken: ``DEBOUNCE_S`` after a spec change, else ``SETTLE_S`` (or until one)."""
        if not self.spec.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.spec.wait(), SETTLE_S)
        await asyncio.sleep(DEBOUNCE_S)


class Wakers:
    """One ``Wake`` per job's daemon; set from the event handlers (all on kopf's loop, so no lock)."""

    def __init__(self) -> None:
        self._wakes: dict[tuple[str, str], Wake] = {}

    def register(self, key: tuple[str, str]) -> Wake:
        wake = self._wakes[key] = Wake()
        return wake

    def drop(self, key: tuple[str, str], wake: Wake) -> None:
        if self._wakes.get(key) is wake:
            del self._wakes[key]

    def wake(self, key: tuple[str, str], spec: bool = False) -> None:
        wake = self._wakes.get(key)
        if wake is not None:
            if spec:
                wake.spec.set()
            wake.any.set()


def _snapshot(body: kopf.Body) -> Obj:
    return copy.deepcopy(dict(body))


def build_registry(
    api: Api, options: Options, metrics: OperatorMetrics, pool: ThreadPoolExecutor
) -> kopf.OperatorRegistry:
    """A registry with the operator's handlers bound to ``api``, ``options`` and ``metrics``; the blocking calls of
    reconciles run on ``pool`` (``WORKERS`` threads)."""
    registry = kopf.OperatorRegistry()
    phases = PhaseCounts(metrics)
    wakers = Wakers()
    memory = Memory()
    has_job = {JOB_LABEL: kopf.PRESENT}
    loops: list[asyncio.AbstractEventLoop] = []

    def wake_from_thread(key: tuple[str, str]) -> None:  # the gate decides in reconcile threads
        loops[0].call_soon_threadsafe(wakers.wake, key)

    gate = admission.Gate(api, wake_from_thread) if options.gang else None
    watched = WATCHED + ((WORKLOAD,) if options.settings.kueue else ())

    @kopf.on.login(registry=registry)  # type: ignore[untyped-decorator,unused-ignore]
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)  # type: ignore[untyped-decorator,unused-ignore]
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = names.CLEANUP_FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = _NoSpecDiff(prefix=GROUP, key="last-handled")
        settings.posting.level = logging.WARNING  # our own events say what changed
        settings.watching.server_timeout = 1800
        settings.background.cancellation_polling = 1.0
        for kind in watched:
            settings.watching.label_selectors[_resource(kind)] = JOB_LABEL

    @kopf.on.startup(registry=registry)  # type: ignore[untyped-decorator,unused-ignore]
    async def remember_loop(**_: Any) -> None:
        loops.append(asyncio.get_running_loop())

    def index(body: kopf.Body, **_: Any) -> dict[tuple[str, str], Obj]:
        # managedFields left out before the copy: often most of a pod's bytes, and nothing reads them
        meta = {k: v for k, v in dict(body.get("metadata", {})).items() if k != "managedFields"}
        obj = copy.deepcopy({**dict(body), "metadata": meta})
        return {(str(body.metadata.namespace), str(body.metadata.labels[JOB_LABEL])): obj}

    async def poke(body: kopf.Body, **_: Any) -> None:
        wakers.wake((str(body.metadata.namespace), str(body.metadata.labels.get(JOB_LABEL, ""))))

    for kind in watched:
        group, version, plural = _resource(kind)
        kopf.index(group, version, plural, id=_index_id(kind), labels=has_job, registry=registry)(index)
        kopf.on.event(group, version, plural, id=f"wake_on_{plural}", labels=has_job, registry=registry)(poke)

    @kopf.on.event(GROUP, VERSION, "rljobs", registry=registry, id="wake_on_rljobs")  # type: ignore[untyped-decorator,unused-ignore]
    async def job_changed(body: kopf.Body, **_: Any) -> None:
        spec = body.metadata.get("generation") != body.get("status", {}).get("observedGeneration")
        wakers.wake((str(body.metadata.namespace), str(body.metadata.name)), spec)

    def vanished(key: tuple[str, str], uid: str) -> str | None:
        """ "deleted" or "replaced" (a new RLJob of its name) when the job's RLJob is no longer the one its loop
        serves; None while it is (or the API cannot say). kopf forgets a job deleted with no finalizer left without
        stopping its loop or calling the cleanup (a finalizer taken off, or a namespace deleted under an operator
        that just listed it): its failing passes ask here."""
        try:
            found = api.get(KIND, *key)
        except Exception:  # noqa: BLE001 - cannot tell: the loop goes on retrying
            return None
        if found is None:
            return "deleted"
        return "replaced" if found["metadata"].get("uid") != uid else None

    def forget(key: tuple[str, str]) -> None:
        """What the operator keeps of a job, dropped: its phase count, its memory, its admission grant."""
        phases.set(key, None)
        memory.forget(*key)
        if gate is not None:
            gate.release(key)

    def record(body: kopf.Body, key: tuple[str, str], outcome: Outcome, started: float) -> None:
        changed = outcome.patched or outcome.writes
        metrics.reconciles_total.labels(KIND, "changed" if changed else "unchanged").inc()
        phases.set(key, outcome.status.phase)
        for kind, reason, message in outcome.events:
            kopf.event(body, type=kind, reason=reason, message=message)
        if changed:
            log.info(
                "reconciled %s/%s: phase %s, %d writes, status %s in %.3f s",
                *key,
                outcome.status.phase,
                outcome.writes,
                "patched" if outcome.patched else "unchanged",
                time.monotonic() - started,
            )

    @kopf.daemon(  # type: ignore[untyped-decorator,unused-ignore]
        GROUP, VERSION, "rljobs", registry=registry, id="reconcile", initial_delay=0.0, cancellation_timeout=1.0
    )
    async def run(body: kopf.Body, **kwargs: Any) -> None:
        """Reconcile on every wake-up, from the indexes; from the API after a quiet ``resync_seconds``."""
        key, uid = (str(body.metadata.namespace), str(body.metadata.name)), str(body.metadata.uid)
        loop = asyncio.get_running_loop()
        wake = wakers.register(key)
        from_api, backoff = False, 0.0  # the indexes are complete before any daemon starts (module docstring)
        try:
            while not body.metadata.deletion_timestamp:
                wake.clear()
                reads = None
                if not from_api:
                    reads = IndexedReads(api, {k.kind: list(kwargs[_index_id(k)].get(key, ())) for k in watched})
                started = time.monotonic()
                retry_after = None
                try:
                    outcome = await loop.run_in_executor(
                        pool, functools.partial(reconcile, api, _snapshot(body), options.settings, reads, memory, gate)
                    )
                except Exception as err:  # noqa: BLE001 - the daemon must live on (kopf would not restart it)
                    metrics.reconciles_total.labels(KIND, "error").inc()
                    why = await loop.run_in_executor(pool, vanished, key, uid)
                    if why == "deleted":
                        log.warning(
                            "RLJob %s/%s is gone (deleted) without its deletion reaching the cleanup: its admission "
                            "and what the operator kept of it are released and its loop ends",
                            *key,
                        )
                        forget(key)
                        return
                    if why == "replaced":
                        log.warning("RLJob %s/%s was replaced by a new one of its name: the old one's loop ends", *key)
                        return
                    backoff = min(max(backoff * 2, 1.0), 30.0)
                    log.warning("reconcile of %s/%s failed (retrying in %.0fs): %s", *key, backoff, err)
                else:
                    backoff, retry_after = 0.0, outcome.retry_after
                    record(body, key, outcome, started)
                finally:
                    metrics.reconcile_seconds.labels(KIND).observe(time.monotonic() - started)
                quiet = options.resync_seconds * random.uniform(0.5, 1.5)  # spreads load; not a secret
                try:
                    await asyncio.wait_for(wake.any.wait(), timeout=backoff or retry_after or quiet)
                    from_api = False
                    await wake.settle()
                except TimeoutError:
                    from_api = not (backoff or retry_after)  # a quiet period ended: the safety-net pass reads the API
        finally:
            wakers.drop(key, wake)

    @kopf.on.delete(GROUP, VERSION, "rljobs", registry=registry, id="cleanup")  # type: ignore[untyped-decorator,unused-ignore]
    def cleanup(body: kopf.Body, **_: Any) -> None:
        namespace, name = str(body.metadata.namespace), str(body.metadata.name)
        selector = names.label_selector(name)
        for item in api.list("WeightVersion", namespace, selector):
            api.delete("WeightVersion", namespace, item["metadata"]["name"])
        forget((namespace, name))

    @kopf.on.probe(id="rljobs", registry=registry)  # type: ignore[untyped-decorator,unused-ignore]
    def alive(**_: Any) -> str:
        return "ok"

    return registry
