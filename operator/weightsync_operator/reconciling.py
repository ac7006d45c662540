"""One reconcile of one RLJob: read the world, write what differs, derive the status.

Level-triggered and idempotent: every step reads the current state and acts on
the difference, so a replayed event, a second reconcile racing the first, or an
operator restarted halfway through converge on the same children (names are
fixed, writes are server-side apply) and never count a restart twice (the status
patch that counts one carries the resourceVersion it was computed from).

Reads and writes are apart: ``reads`` answers get/list (the watches' caches, or
the API itself on a resync), ``api`` takes every write. ``Memory`` is what the
operator keeps between reconciles: Secrets it knows exist (it may not watch
Secrets) and children whose live form the server normalises so that it never
looks like what was applied (compared by hash only, logged once, never re-applied
in a loop).

A pass's writes that do not depend on each other go out side by side (the
status patch beside the children's applies, the ranks' deletes); the children are
applied in order (a pod's claim and config exist before the pod). Order matters in one
place: the status patch that records a gang restart is
written before the trainer pods are deleted. If the operator dies in between,
the next reconcile sees the failed pod again but the count is already there and
the pods are deleted then (the pod was created under the previous count, so it
is not counted twice: ``status.Verdict.CLEAR``); the reverse order could lose a
restart from the budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from weightsync.resources.rljob import RLJobSpec, RLJobStatus
from weightsync_operator import children, names, status, versions
from weightsync_operator.kubeapi import Api, Obj
from weightsync_operator.names import Component

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class Reads(Protocol):
    def get(self, kind: str, namespace: str, name: str) -> Obj | None: ...

    def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]: ...


@dataclass
class Memory:
    secrets: set[tuple[str, str, str]] = field(default_factory=set)
    """(namespace, name, owner uid) of the token and TLS Secrets known to exist."""
    hash_only: set[tuple[str, str, str, str | None]] = field(default_factory=set)
    """(namespace, kind, name, spec hash) of children compared by hash alone (see the module docstring)."""
    announced: dict[tuple[str, str], RLJobStatus] = field(default_factory=dict)
    """(namespace, job) -> the status its events were last computed against, set only when a pass completes: a
    pass that fails after its status patch landed (a write that timed out but was applied, a later delete) loses its
    events, and the next pass, which reads that status back as its old one, must still say what changed."""

    def forget(self, namespace: str, job: str) -> None:
        gone = {(namespace, names.token_secret(job)), (namespace, names.tls_secret(job))}
        self.secrets = {s for s in self.secrets if s[:2] not in gone}
        self.announced.pop((namespace, job), None)


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


def reconcile(
    api: Api, body: dict[str, Any], settings: Settings, reads: Reads | None = None, memory: Memory | None = None
) -> Outcome:
    """One pass over ``body`` (the RLJob as last seen); ``reads`` defaults to the API itself."""
    reads = reads if reads is not None else api
    memory = memory if memory is not None else Memory()
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    owner = children.Owner(name, namespace, meta["uid"])
    spec = RLJobSpec.model_validate(body["spec"])
    old = RLJobStatus.model_validate(body.get("status") or {})
    pods = reads.list("Pod", namespace, names.label_selector(name))
    views = [status.PodView.of(p) for p in pods]
    trainer_pods = [p for p, v in zip(pods, views, strict=True) if v.component == Component.TRAINER]
    trainer = [v for v in views if v.component == Component.TRAINER]
    placed = sum(1 for p in views if p.component == Component.INFERENCE and p.placed and not p.deleting)
    verdict = status.decide_trainer(spec, old, trainer, placed)
    parked = verdict in (status.Verdict.PARK, status.Verdict.FAIL, status.Verdict.SUCCEED)

    seen = status.Observed(generation=int(meta.get("generation", 0)))
    seen.coordinator_ready = _ready(reads.get("Deployment", namespace, names.child(name, Component.COORDINATOR)))
    seen.inference_ready = _ready(reads.get("StatefulSet", namespace, names.child(name, Component.INFERENCE)))
    seen.trainer = trainer
    seen.pods = views
    found = versions.parse(name, reads.list("WeightVersion", namespace, names.label_selector(name)), owner.uid)
    summary = versions.summarize(found)
    new = status.next_status(spec, old, seen, verdict, summary)
    patching = None
    if new.to_wire() != old.to_wire():
        # Only a restart must not be counted twice; other fields are recomputed every time. The status is what was
        # read, not what the children's writes return, so it goes out beside them: on a busy API server one write
        # takes hundreds of milliseconds.
        guard = meta.get("resourceVersion") if verdict == status.Verdict.RESTART else None
        patching = _WRITES.submit(api.patch_status, "RLJob", namespace, name, new.to_wire(), guard)

    writes = _ensure_children(api, reads, memory, owner, spec, settings, parked)
    for stale in versions.beyond_retention(found, spec.sync.retention):
        writes += api.delete("WeightVersion", namespace, stale)
    told = memory.announced.get((namespace, name), old)
    outcome = Outcome(
        status=new, writes=writes, events=versions.events(told.current_version, told.last_failed_version, summary)
    )
    if patching is not None:
        patching.result()  # before the trainer's deletes (see the module docstring)
        outcome.patched = True
    outcome.events += _transition_events(told, new, verdict)
    outcome.writes += _drive_trainer(api, owner, spec, verdict, trainer, trainer_pods, new.restarts)
    memory.announced[(namespace, name)] = new
    return outcome


_WRITES = ThreadPoolExecutor(max_workers=32, thread_name_prefix="write")
"""Where a pass's independent writes run side by side: on a busy API server each takes hundreds of milliseconds,
and one after the other they made a suspend's pass several times one write."""


def _each(write: Callable[[T], R], items: list[T]) -> list[R]:
    """``write`` of every item, concurrently when there are several; the first error is raised."""
    if len(items) < 2:
        return [write(item) for item in items]
    return list(_WRITES.map(write, items))


def _ready(obj: dict[str, Any] | None) -> int:
    return int((obj or {}).get("status", {}).get("readyReplicas", 0) or 0)


def _ensure_children(
    api: Api, reads: Reads, memory: Memory, owner: children.Owner, spec: RLJobSpec, settings: Settings, parked: bool
) -> int:
    """Apply each child that is missing, differs from the spec or drifted; create the token and TLS Secrets once.

    The Secrets are made only when a read finds them missing, and ``create``
    keeps whatever exists (a racing reconcile's): never regenerated, never
    applied over. Returns writes."""
    writes = 0
    for secret_name, secret in (
        (names.token_secret(owner.name), children.token_secret),
        (names.tls_secret(owner.name), children.tls_secret),
    ):
        known = (owner.namespace, secret_name, owner.uid)
        if known in memory.secrets:
            continue
        if reads.get("Secret", owner.namespace, secret_name) is None:
            writes += api.create(secret(owner))
        memory.secrets.add(known)
    stale = []
    for obj in children.desired(owner, spec, settings.coordinator_image, settings.coordinator_role, parked):
        meta = obj["metadata"]
        current = reads.get(obj["kind"], owner.namespace, meta["name"])
        key = (owner.namespace, obj["kind"], meta["name"], children.current_hash(obj))
        if key in memory.hash_only and current is not None:
            if children.current_hash(current) == key[3]:
                continue
        elif not children.drifted(obj, current):
            continue
        stale.append((obj, key))
    for obj, key in stale:  # in order: a workload's PersistentVolumeClaim and ConfigMap exist before its pods
        applied = api.apply(obj)
        meta = obj["metadata"]
        writes += 1
        if applied is not None and not children.covers(applied, obj):
            log.warning(
                "%s %s/%s: the server's form never matches what is applied; compared by hash from now on",
                obj["kind"],
                owner.namespace,
                meta["name"],
            )
            memory.hash_only.add(key)
    return writes


def _drive_trainer(
    api: Api,
    owner: children.Owner,
    spec: RLJobSpec,
    verdict: status.Verdict,
    pods: list[status.PodView],
    live: list[Obj],
    restarts: int,
) -> int:
    """Create missing ranks (RUN), each marked with ``restarts`` (the count it is created under), or delete every
    rank (any other verdict but SUCCEED and WAIT)."""
    writes = 0
    if verdict in (status.Verdict.SUCCEED, status.Verdict.WAIT):
        return 0
    if verdict != status.Verdict.RUN:
        doomed = [pod.name for pod in pods if not pod.deleting]
        return sum(_each(lambda name: api.delete("Pod", owner.namespace, name), doomed))
    by_name = {p.name: p for p in pods}
    bodies = {p["metadata"]["name"]: p for p in live}
    for desired in children.trainer_pods(owner, spec):
        existing = by_name.get(desired["metadata"]["name"])
        if existing is None:
            desired["metadata"].setdefault("annotations", {})[names.RESTART_ANNOTATION] = str(restarts)
            writes += api.create(desired)
        elif not existing.deleting and (
            existing.spec_hash != children.current_hash(desired)
            or children.containers(bodies[existing.name]) != children.containers(desired)
        ):
            # a pod's spec is immutable but for its images: replace it (the next reconcile creates it again)
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
