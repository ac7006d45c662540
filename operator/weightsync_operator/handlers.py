"""The kopf wiring: which events call the reconciler, and how kopf itself is configured.

One level-triggered timer per RLJob runs ``reconciling.reconcile`` every
``resync`` seconds (and at once when the operator starts or the object appears).
kopf runs one timer per object at a time, so the reconciles of one job never
overlap, and nothing depends on having seen a particular event: a missed or
replayed event changes nothing, the next tick sees the world as it is.

kopf keeps its own bookkeeping under our group: progress and diff-base
annotations ``weightsync.io/...`` and the finalizer ``weightsync.io/cleanup``,
which holds an RLJob's deletion until its WeightVersion objects are gone (the
coordinator may not have set ownerReferences on them).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import kopf

from weightsync.metrics import OperatorMetrics
from weightsync.resources import GROUP, VERSION, JobPhase
from weightsync_operator import names
from weightsync_operator.kubeapi import Api
from weightsync_operator.reconciling import Settings, reconcile

log = logging.getLogger(__name__)
KIND = "RLJob"
RESULTS = ("changed", "unchanged", "error")
"""``result`` label values of weightsync_operator_reconciles_total."""


@dataclass(frozen=True)
class Options:
    settings: Settings
    resync_seconds: float = 5.0


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


def build_registry(api: Api, options: Options, metrics: OperatorMetrics) -> kopf.OperatorRegistry:
    """A registry with the operator's handlers bound to ``api``, ``options`` and ``metrics``."""
    registry = kopf.OperatorRegistry()
    phases = PhaseCounts(metrics)

    @kopf.on.login(registry=registry)  # type: ignore[untyped-decorator,unused-ignore]
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)  # type: ignore[untyped-decorator,unused-ignore]
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = names.CLEANUP_FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled")
        settings.posting.level = logging.WARNING  # our own events say what changed
        settings.watching.server_timeout = 300

    every = {"interval": options.resync_seconds, "initial_delay": 0.0}

    @kopf.timer(GROUP, VERSION, "rljobs", registry=registry, id="reconcile", **every)  # type: ignore[untyped-decorator,unused-ignore]
    def tick(body: kopf.Body, **_: Any) -> None:
        started = time.monotonic()
        key = (str(body.metadata.namespace), str(body.metadata.name))
        try:
            outcome = reconcile(api, dict(body), options.settings)
        except Exception:
            metrics.reconciles_total.labels(KIND, "error").inc()
            raise
        finally:
            metrics.reconcile_seconds.labels(KIND).observe(time.monotonic() - started)
        metrics.reconciles_total.labels(KIND, "changed" if outcome.patched or outcome.writes else "unchanged").inc()
        phases.set(key, outcome.status.phase)
        for kind, reason, message in outcome.events:
            kopf.event(body, type=kind, reason=reason, message=message)
        if outcome.patched or outcome.writes:
            log.info(
                "reconciled %s/%s: phase %s, %d writes, status %s in %.3f s",
                body.metadata.namespace,
                body.metadata.name,
                outcome.status.phase,
                outcome.writes,
                "patched" if outcome.patched else "unchanged",
                time.monotonic() - started,
            )

    @kopf.on.delete(GROUP, VERSION, "rljobs", registry=registry, id="cleanup")  # type: ignore[untyped-decorator,unused-ignore]
    def cleanup(body: kopf.Body, **_: Any) -> None:
        namespace, name = str(body.metadata.namespace), str(body.metadata.name)
        selector = names.label_selector(name)
        for item in api.list("WeightVersion", namespace, selector):
            api.delete("WeightVersion", namespace, item["metadata"]["name"])
        phases.set((namespace, name), None)

    @kopf.on.probe(id="rljobs", registry=registry)  # type: ignore[untyped-decorator,unused-ignore]
    def alive(**_: Any) -> str:
        return "ok"

    return registry
