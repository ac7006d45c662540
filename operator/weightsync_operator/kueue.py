"""Kueue admits an RLJob labelled ``kueue.x-k8s.io/queue-name``: the operator is Kueue's job integration for RLJob.

Kueue admits Workloads, not jobs: for each kind of job an integration makes the
job's Workload and follows what Kueue decides (Kueue's ``jobframework`` does it
for its own kinds; a custom kind's controller does it for its kind, which Kueue
is told of with ``integrations.externalFrameworks: [RLJob.v1alpha1.weightsync.io]``).
As for Kueue's own jobs, ``spec.suspend`` is the lever:

- a labelled job gets one Workload (``rljob-<name>-<uid prefix>``, owned by the
  job, labelled with it), in the LocalQueue the label names, with a pod set per
  component (coordinator 1, inference ``replicas``, trainer ``worldSize``), each
  with the pod spec its pods get: Kueue admits the whole job or none of it;
- while the Workload is not admitted, the job is suspended (the operator sets
  ``spec.suspend: true``) and has no pods; ``Admitted`` False quotes Kueue;
- once Kueue admits it, the operator sets ``spec.suspend: false`` and the pods
  are created (with the node labels of the flavors Kueue assigned);
- when Kueue evicts it (preemption; ``spec.active: false`` on the Workload), the
  job is suspended, and once its pods are gone its quota is given back
  (``QuotaReserved`` False, no admission), as Kueue's own integrations do;
- a finished job (Succeeded, Failed) marks its Workload ``Finished``, which frees
  its quota.

As with Kueue's own jobs, the integration owns ``spec.suspend`` of a queued job:
a suspend by hand is undone while the Workload is admitted; deactivate the
Workload to stop the job.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from weightsync_operator import names
from weightsync_operator.admission import Decision
from weightsync_operator.kubeapi import WORKLOAD, Api, Obj

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""The label that puts a job in a Kueue LocalQueue (Kueue's own, for every kind of job)."""
FRAMEWORK = "RLJob.v1alpha1.weightsync.io"
"""What Kueue's ``integrations.externalFrameworks`` lists so that it knows the owner of these Workloads."""


def queue_of(meta: dict[str, Any]) -> str:
    """The LocalQueue a job asks for ("" when Kueue does not admit it)."""
    return str((meta.get("labels") or {}).get(QUEUE_LABEL, ""))


def workload_name(job: str, uid: str) -> str:
    """Unique per job object: a job deleted and made again under its name never finds the old one's Workload."""
    return f"rljob-{job}-{uid[:5]}"


def workload(owner: Obj, namespace: str, queue: str, pods: dict[str, list[tuple[str, Obj]]]) -> Obj:
    """The Workload of the job ``owner`` (its ownerReference): one pod set per component, from its pods' (name,
    spec) (a component's pods are alike but for their names)."""
    return {
        "apiVersion": WORKLOAD.api_version,
        "kind": WORKLOAD.kind,
        "metadata": {
            "name": workload_name(owner["name"], owner["uid"]),
            "namespace": namespace,
            "labels": names.selector(owner["name"]),
            "ownerReferences": [owner],
        },
        "spec": {
            "queueName": queue,
            "podSets": [
                {"name": component, "count": len(specs), "template": {"spec": specs[0][1]}}
                for component, specs in pods.items()
                if specs
            ],
        },
    }


@dataclass(frozen=True)
class Seen:
    """A job's Workload as the job needs it."""

    name: str
    namespace: str
    conditions: tuple[Obj, ...]
    admission: Obj | None
    resource_version: str

    @classmethod
    def of(cls, obj: Obj) -> Seen:
        status = obj.get("status") or {}
        return cls(
            obj["metadata"]["name"],
            obj["metadata"]["namespace"],
            tuple(status.get("conditions") or ()),
            status.get("admission"),
            str(obj["metadata"].get("resourceVersion", "")),
        )

    def condition(self, ctype: str) -> Obj | None:
        return next((c for c in self.conditions if c.get("type") == ctype), None)

    def true(self, ctype: str) -> bool:
        cond = self.condition(ctype)
        return cond is not None and cond.get("status") == "True"

    @property
    def admitted(self) -> bool:
        return self.true("Admitted") and not self.true("Evicted") and not self.true("Finished")

    def waiting(self) -> str:
        """Why Kueue has not admitted it, in Kueue's words."""
        for ctype in ("Evicted", "QuotaReserved", "Admitted"):
            cond = self.condition(ctype)
            if cond is not None and cond.get("message") and (ctype == "Evicted") == (cond.get("status") == "True"):
                return f"Kueue: {cond['message']}"
        return f"waiting for Kueue to admit Workload {self.name}"

    def flavors(self) -> dict[str, set[str]]:
        """The ResourceFlavors Kueue assigned, by pod set."""
        out: dict[str, set[str]] = {}
        for assignment in (self.admission or {}).get("podSetAssignments") or []:
            out[assignment.get("name", "")] = set((assignment.get("flavors") or {}).values())
        return out


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _set(conditions: list[Obj], ctype: str, status: str, reason: str, message: str) -> list[Obj]:
    old = next((c for c in conditions if c.get("type") == ctype), None)
    if old is not None and old.get("status") == status and old.get("reason") == reason:
        return conditions
    moved = old is None or old.get("status") != status
    new = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": _now() if moved else old.get("lastTransitionTime", _now()),  # type: ignore[union-attr]
    }
    return [c for c in conditions if c.get("type") != ctype] + [new]


def finish(api: Api, seen: Seen, succeeded: bool, message: str) -> int:
    """Mark the Workload Finished (its quota goes back), as Kueue's integrations do when their job ends."""
    if seen.true("Finished"):
        return 0
    reason = "Succeeded" if succeeded else "Failed"
    conditions = _set(list(seen.conditions), "Finished", "True", reason, message)
    api.patch_status(WORKLOAD.kind, seen.namespace, seen.name, {"conditions": conditions}, seen.resource_version)
    return 1


def give_back(api: Api, seen: Seen) -> int:
    """An evicted job's pods are gone: clear its quota reservation so that Kueue may admit it again (Kueue's own
    integrations do this once their job is inactive)."""
    if not seen.true("QuotaReserved") and seen.admission is None:
        return 0
    evicted = seen.condition("Evicted") or {}
    why = str(evicted.get("message") or "evicted")
    conditions = _set(list(seen.conditions), "QuotaReserved", "False", "Pending", why)
    conditions = _set(conditions, "Admitted", "False", "NoReservation", "The workload has no reservation")
    requeued = evicted.get("reason") in ("Preempted", "NodeFailures")
    conditions = _set(conditions, "Requeued", "True" if requeued else "False", str(evicted.get("reason", "")), why)
    status = {"conditions": conditions, "admission": None}
    api.patch_status(WORKLOAD.kind, seen.namespace, seen.name, status, seen.resource_version)
    return 1


def node_labels(api: Api, seen: Seen) -> dict[str, dict[str, str]]:
    """The node labels of the flavors Kueue assigned, by pod set: pods of a pod set go where its flavors are."""
    out: dict[str, dict[str, str]] = {}
    for pod_set, flavors in seen.flavors().items():
        labels: dict[str, str] = {}
        for flavor in sorted(flavors):
            found = api.get("ResourceFlavor", "", flavor)
            labels.update(((found or {}).get("spec") or {}).get("nodeLabels") or {})
        if labels:
            out[pod_set] = labels
    return out


def decision(seen: Seen | None) -> Decision:
    if seen is None:
        return Decision(False, "waiting for Kueue: the job's Workload is being made")
    if seen.admitted:
        return Decision(True, f"admitted by Kueue (Workload {seen.name})")
    return Decision(False, seen.waiting())
