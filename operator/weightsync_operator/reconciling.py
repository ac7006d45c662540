"""One reconcile of one RLJob: read the world, write what differs, derive the status.

Level-triggered and idempotent: every step reads the current state and acts on
the difference, so a replayed event, a second reconcile racing the first, or an
operator restarted halfway through converge on the same children (names are
fixed, writes are server-side apply) and never count a restart twice (the status
patch that counts one carries the resourceVersion it was computed from).

Order matters in one place: the status patch that records a gang restart is
written before the trainer pods are deleted. If the operator dies in between,
the next reconcile sees the failed pod again but the count is already there and
the pods are deleted then; the reverse order could lose a restart from the
budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightsync.resources.rljob import RLJobSpec, RLJobStatus
from weightsync_operator import children, names, status, versions
from weightsync_operator.kubeapi import Api
from weightsync_operator.names import Component


@dataclass(frozen=True)
class Settings:
    """What the operator adds to every job: the coordinator's default image and its ClusterRole."""

    coordinator_image: str = "ghcr.io/weightsync/coordinator:0.1.0"
    coordinator_role: str = "weightsync-coordinator"


@dataclass
class Outcome:
    status: RLJobStatus
    patched: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)
    writes: int = 0


def reconcile(api: Api, body: dict[str, Any], settings: Settings) -> Outcome:
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    owner = children.Owner(name, namespace, meta["uid"])
    spec = RLJobSpec.model_validate(body["spec"])
    old = RLJobStatus.model_validate(body.get("status") or {})
    trainer = [status.PodView.of(p) for p in api.list("Pod", namespace, names.label_selector(name, Component.TRAINER))]
    verdict = status.decide_trainer(spec, old, trainer)
    parked = verdict in (status.Verdict.PARK, status.Verdict.FAIL, status.Verdict.SUCCEED)

    writes = _ensure_children(api, owner, spec, settings, parked)
    seen = status.Observed(generation=int(meta.get("generation", 0)))
    seen.coordinator_ready = _ready(api.get("Deployment", namespace, names.child(name, Component.COORDINATOR)))
    seen.inference_ready = _ready(api.get("StatefulSet", namespace, names.child(name, Component.INFERENCE)))
    seen.trainer = trainer
    seen.pods = [status.PodView.of(p) for p in api.list("Pod", namespace, names.label_selector(name))]

    found = versions.parse(name, api.list("WeightVersion", namespace, names.label_selector(name)))
    summary = versions.summarize(found)
    for stale in versions.beyond_retention(found, spec.sync.retention):
        writes += api.delete("WeightVersion", namespace, stale)

    new = status.next_status(spec, old, seen, verdict, summary)
    outcome = Outcome(
        status=new, writes=writes, events=versions.events(old.current_version, old.last_failed_version, summary)
    )
    if new.to_wire() != old.to_wire():
        # Only a restart must not be counted twice; other fields are recomputed every time.
        guard = meta.get("resourceVersion") if verdict == status.Verdict.RESTART else None
        api.patch_status("RLJob", namespace, name, new.to_wire(), guard)
        outcome.patched = True
        outcome.events += _transition_events(old, new, verdict)
    outcome.writes += _drive_trainer(api, owner, spec, verdict, trainer)
    return outcome


def _ready(obj: dict[str, Any] | None) -> int:
    return int((obj or {}).get("status", {}).get("readyReplicas", 0) or 0)


def _ensure_children(api: Api, owner: children.Owner, spec: RLJobSpec, settings: Settings, parked: bool) -> int:
    """Apply each child that is missing or differs from the spec; create the token and TLS Secrets once.

    The Secrets are made only when a read finds them missing, and ``create``
    keeps whatever exists (a racing reconcile's): never regenerated, never
    applied over. Returns writes."""
    writes = 0
    if api.get("Secret", owner.namespace, names.token_secret(owner.name)) is None:
        writes += api.create(children.token_secret(owner))
    if api.get("Secret", owner.namespace, names.tls_secret(owner.name)) is None:
        writes += api.create(children.tls_secret(owner))
    for obj in children.desired(owner, spec, settings.coordinator_image, settings.coordinator_role, parked):
        current = api.get(obj["kind"], owner.namespace, obj["metadata"]["name"])
        if children.current_hash(current) != children.current_hash(obj):
            api.apply(obj)
            writes += 1
    return writes


def _drive_trainer(
    api: Api, owner: children.Owner, spec: RLJobSpec, verdict: status.Verdict, pods: list[status.PodView]
) -> int:
    """Create missing ranks (RUN), or delete every rank (any other verdict but SUCCEED)."""
    writes = 0
    if verdict == status.Verdict.SUCCEED:
        return 0
    if verdict != status.Verdict.RUN:
        for pod in pods:
            if not pod.deleting:
                writes += api.delete("Pod", owner.namespace, pod.name)
        return writes
    by_name = {p.name: p for p in pods}
    for desired in children.trainer_pods(owner, spec):
        existing = by_name.get(desired["metadata"]["name"])
        if existing is None:
            writes += api.create(desired)
        elif not existing.deleting and existing.spec_hash != children.current_hash(desired):
            # a pod's spec is immutable: replace it (the next reconcile creates it again)
            writes += api.delete("Pod", owner.namespace, existing.name)
    return writes


def _transition_events(old: RLJobStatus, new: RLJobStatus, verdict: status.Verdict) -> list[tuple[str, str, str]]:
    out = []
    if verdict == status.Verdict.RESTART:
        out.append(
            ("Warning", "TrainerRestarted", f"a trainer rank failed; restarting the gang (restart {new.restarts})")
        )
    if new.phase != old.phase:
        kind = "Warning" if new.phase == "Failed" else "Normal"
        out.append((kind, f"Phase{new.phase}", f"phase {old.phase} -> {new.phase}"))
    old_sched = next((c for c in old.conditions if c.type == "Scheduled"), None)
    new_sched = next((c for c in new.conditions if c.type == "Scheduled"), None)
    if new_sched and new_sched.status == "False" and (old_sched is None or old_sched.message != new_sched.message):
        out.append(("Warning", "Unschedulable", new_sched.message))
    return out
