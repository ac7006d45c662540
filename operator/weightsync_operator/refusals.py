"""When the API server refuses a child: what the job's status and events say, and whether a retry can help.

The CRD refuses what it can check (names, quantities, tolerations, ports); what
depends on the cluster it cannot: a namespace's PodSecurity level, a ResourceQuota,
an admission policy, an object of the same name that is not the job's. Such a
refusal becomes the condition ``Applied=False`` and a ``Refused`` event, both
quoting the API server's message, within the pass that met it. A refusal of the
object itself (HTTP 400 or 422: a retry sends the same object) is not retried
until the spec changes (a new ``metadata.generation``); any other refusal (403:
quota, policy) may pass later and is retried with a growing delay.

Pods that a controller creates are refused to the controller, not to the
operator: the StatefulSet controller reports its replica pods' refusals only as
``FailedCreate`` events on the StatefulSet (read here when it has fewer pods than
it wants, and again every ``RECHECK_S`` while that lasts), the Deployment
controller as the Deployment's ``ReplicaFailure`` condition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from weightsync_operator.kubeapi import ApiError

T = TypeVar("T")

PERMANENT = (400, 422)
"""HTTP codes of a refusal of the object itself: the same object is refused again, so it waits for a new spec."""
REFUSED = (*PERMANENT, 403)
"""HTTP codes that mean "refused" (the rest is trouble to retry: 404 of a namespace going, 409, 429, 5xx)."""
RETRY_S = (5.0, 300.0)
"""First and longest delay between retries of a refusal that may pass later (403: a quota, a policy)."""
RECHECK_S = 10.0
"""How soon a StatefulSet short of pods is looked at again: its controller writes its status (which wakes the job)
before the refusal's event may be recorded, and a retry that is refused again changes no status."""


@dataclass(frozen=True)
class Refusal:
    """The API server refused ``kind``/``name`` (or a controller's pods for it) with ``message``."""

    kind: str
    name: str
    message: str
    generation: int
    permanent: bool
    by_controller: bool = False

    @property
    def text(self) -> str:
        what = (
            f"{self.kind} {self.name} could not create its pods"
            if self.by_controller
            else (f"the API server refused {self.kind} {self.name}")
        )
        then = (
            "; not retried until the spec changes"
            if self.permanent
            else "; its controller keeps trying"
            if self.by_controller
            else "; retrying"
        )
        return f"{what}: {self.message}{then}"


def of(err: ApiError, obj: dict[str, Any], generation: int) -> Refusal | None:
    """The refusal ``err`` is for ``obj``, or None when it is trouble to retry rather than a refusal."""
    if err.status not in REFUSED:
        return None
    meta = obj.get("metadata", {})
    return Refusal(obj.get("kind", ""), meta.get("name", ""), err.detail, generation, err.status in PERMANENT)


def attempt(write: Callable[[], T], obj: dict[str, Any], generation: int) -> tuple[T | None, Refusal | None]:
    """``write()`` of ``obj``, or the refusal it met instead (trouble that is no refusal propagates)."""
    try:
        return write(), None
    except ApiError as err:
        refusal = of(err, obj, generation)
        if refusal is None:
            raise
        return None, refusal


def of_statefulset(sts: dict[str, Any] | None, events: list[dict[str, Any]], generation: int) -> Refusal | None:
    """The newest ``FailedCreate`` event of a StatefulSet that has fewer pods than it wants, once its controller has
    seen its current spec (before that, missing pods are only not made yet)."""
    if sts is None or not short_of_pods(sts):
        return None
    failed = [e for e in events if e.get("reason") == "FailedCreate"]
    if not failed:
        return None
    newest = max(failed, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    name = sts["metadata"]["name"]
    return Refusal("StatefulSet", name, str(newest.get("message", "")), generation, False, by_controller=True)


def of_deployment(deploy: dict[str, Any] | None, generation: int) -> Refusal | None:
    """The Deployment's ``ReplicaFailure`` condition (copied from its ReplicaSet's), when set."""
    for cond in (deploy or {}).get("status", {}).get("conditions", []) or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            name = (deploy or {})["metadata"]["name"]
            return Refusal("Deployment", name, str(cond.get("message", "")), generation, False, by_controller=True)
    return None


def short_of_pods(sts: dict[str, Any] | None) -> bool:
    """Whether the StatefulSet's controller has seen its current spec and still has fewer pods than it wants (a
    refusal it met shows in its events then)."""
    if sts is None:
        return False
    status = sts.get("status") or {}
    observed = status.get("observedGeneration")
    seen = observed is not None and observed == sts["metadata"].get("generation")
    return bool(seen and int(status.get("replicas") or 0) < int(sts.get("spec", {}).get("replicas") or 0))


def retry_after(previous: float) -> float:
    """The next delay before retrying a refusal that may pass later."""
    return min(max(previous * 2, RETRY_S[0]), RETRY_S[1])
