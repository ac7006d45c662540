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

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from weightsync.resources.conditions import find, is_true
from weightsync.resources.rljob import ConditionType, PlacementMode, RLJobSpec, RLJobStatus
from weightsync_operator import admission, children, kueue, names, refusals, status, versions, writing
from weightsync_operator.kubeapi import Api, Obj
from weightsync_operator.names import Component
from weightsync_operator.refusals import Refusal
from weightsync_operator.writing import Urgency

log = logging.getLogger(__name__)
R = TypeVar("R")


class Reads(Protocol):
    def get(self, kind: str, namespace: str, name: str) -> Obj | None: ...

    def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]: ...


class _ReadOnce:
    """The API as one pass's ``Reads``, each object read once: a pass reads its workloads twice (for the status,
    then to compare with the spec), which the indexes answer for free but the safety-net pass paid in GETs."""

    def __init__(self, api: Api) -> None:
        self._api = api
        self._got: dict[tuple[str, str, str], Obj | None] = {}

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        key = (kind, namespace, name)
        if key not in self._got:
            self._got[key] = self._api.get(kind, namespace, name)
        return self._got[key]

    def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]:
        return self._api.list(kind, namespace, label_selector)


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
    refused: dict[tuple[str, str], tuple[str, Refusal, float]] = field(default_factory=dict)
    """(namespace, job) -> (job uid, the refusal its last pass met, seconds until the next retry): a permanent one
    holds the job's writes until its spec changes, another one is retried after that delay (``refusals``)."""
    deleted: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """(namespace, job) -> uids of its trainer pods this operator deleted that the reads do not show deleting yet:
    not deleted again. The pass after a suspend, woken by another child's event, used to read its pods before the
    watch brought their deletion and DELETE each again (60 of the operator's 256 requests suspending 30 jobs)."""

    def forget(self, namespace: str, job: str) -> None:
        gone = {(namespace, names.token_secret(job)), (namespace, names.tls_secret(job))}
        self.secrets = {s for s in self.secrets if s[:2] not in gone}
        self.announced.pop((namespace, job), None)
        self.refused.pop((namespace, job), None)
        self.deleted.pop((namespace, job), None)

    def refusal(self, key: tuple[str, str], uid: str, generation: int) -> Refusal | None:
        """The refusal the job's spec met, if it still stands: a permanent one until the spec changes."""
        held = self.refused.get(key)
        if held is None or held[0] != uid or (held[1].permanent and held[1].generation != generation):
            self.refused.pop(key, None)
            return None
        return held[1]


@dataclass(frozen=True)
class Settings:
    """What the operator adds to every job: the coordinator's default image and its ClusterRole; with ``kueue``,
    jobs labelled with a Kueue queue are admitted by Kueue (``kueue``)."""

    coordinator_image: str = "ghcr.io/weightsync/coordinator:0.1.0"
    coordinator_role: str = "weightsync-coordinator"
    kueue: bool = False


@dataclass
class Outcome:
    status: RLJobStatus
    patched: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)
    writes: int = 0
    retry_after: float | None = None
    """Seconds after which the job wants another pass without an event (queued, or a refusal to retry)."""


def reconcile(
    api: Api,
    body: dict[str, Any],
    settings: Settings,
    reads: Reads | None = None,
    memory: Memory | None = None,
    gate: admission.Gate | None = None,
) -> Outcome:
    """One pass over ``body`` (the RLJob as last seen); ``reads`` defaults to the API itself; ``gate`` admits jobs
    whole (None: every job may have its pods at once)."""
    reads = reads if reads is not None else _ReadOnce(api)
    memory = memory if memory is not None else Memory()
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    key, generation = (namespace, name), int(meta.get("generation", 0))
    owner = children.Owner(name, namespace, meta["uid"])
    spec = RLJobSpec.model_validate(body["spec"])
    old = RLJobStatus.model_validate(body.get("status") or {})
    pods = reads.list("Pod", namespace, names.label_selector(name))
    views = [status.PodView.of(p) for p in pods]
    trainer_pods = [p for p, v in zip(pods, views, strict=True) if v.component == Component.TRAINER]
    trainer = [v for v in views if v.component == Component.TRAINER]
    placed = sum(1 for p in views if p.component == Component.INFERENCE and p.placed and not p.deleting)
    verdict = status.decide_trainer(spec, old, trainer, placed)

    seen = status.Observed(generation=generation, trainer=trainer, pods=views)
    queued_writes = 0
    job = _Job(owner, spec, meta, old, views, verdict)
    if settings.kueue and kueue.queue_of(meta):
        seen.admission, queued_writes = _kueue(api, reads, job, settings)
    else:
        seen.admission = _admission(gate, job, settings)
    stops = (status.Verdict.PARK, status.Verdict.FAIL, status.Verdict.SUCCEED)
    if seen.admission is not None and not seen.admission.admitted and verdict not in stops:
        verdict = status.Verdict.QUEUE
    parked = verdict in (status.Verdict.PARK, status.Verdict.FAIL, status.Verdict.SUCCEED, status.Verdict.QUEUE)
    deployment = reads.get("Deployment", namespace, names.child(name, Component.COORDINATOR))
    statefulset = reads.get("StatefulSet", namespace, names.child(name, Component.INFERENCE))
    seen.coordinator_ready, seen.inference_ready = _ready(deployment), _ready(statefulset)
    held = memory.refusal(key, owner.uid, generation)
    seen.refusal = held or _controllers_refusal(api, deployment, statefulset, generation, parked)
    found = versions.parse(name, reads.list("WeightVersion", namespace, names.label_selector(name)), owner.uid)
    summary = versions.summarize(found)
    new = status.next_status(spec, old, seen, verdict, summary)
    patching = None
    if new.to_wire() != old.to_wire():
        # Only a restart must not be counted twice; other fields are recomputed every time. The status is what was
        # read, not what the children's writes return, so it goes out beside them, and ahead of other jobs' children
        # when it answers a spec change (``writing``).
        guard = meta.get("resourceVersion") if verdict == status.Verdict.RESTART else None
        urgency = Urgency.ANSWER if old.observed_generation != generation else Urgency.IN_TURN
        patching = LANE.submit(urgency, api.patch_status, "RLJob", namespace, name, new.to_wire(), guard)

    blocked = held is not None and held.permanent  # the same spec would be refused again: wait for a new one
    node_labels = seen.admission.node_labels if seen.admission is not None else {}
    writes, refused = (
        (0, None)
        if blocked
        else _ensure_children(api, reads, memory, owner, spec, settings, parked, generation, node_labels)
    )
    for stale in versions.beyond_retention(found, spec.sync.retention):
        writes += api.delete("WeightVersion", namespace, stale)
    told = memory.announced.get(key, old)
    outcome = Outcome(
        status=new,
        writes=writes + queued_writes,
        events=versions.events(told.current_version, told.last_failed_version, summary),
    )
    if patching is not None:
        patching.result()  # before the trainer's deletes (see the module docstring)
        outcome.patched = True
    if not blocked and refused is None:
        more, refused = _drive_trainer(
            api,
            owner,
            spec,
            verdict,
            trainer,
            trainer_pods,
            new.restarts,
            generation,
            node_labels.get(Component.TRAINER),
            memory.deleted.setdefault(key, set()),
        )
        outcome.writes += more
    if not blocked and refused != held:  # a new refusal, or a held one that passed this time
        seen.refusal = refused or _controllers_refusal(api, deployment, statefulset, generation, parked)
        outcome.status = status.next_status(spec, old, seen, verdict, summary)
        if outcome.status.to_wire() != new.to_wire():
            LANE.run(Urgency.IN_TURN, api.patch_status, "RLJob", namespace, name, outcome.status.to_wire(), None)
            outcome.patched = True
    outcome.retry_after = _remember(memory, key, owner.uid, refused if not blocked else held)
    for recheck, due in (
        (verdict == status.Verdict.QUEUE, admission.RECHECK_S),
        (not parked and refusals.short_of_pods(statefulset), refusals.RECHECK_S),
    ):
        if recheck:
            outcome.retry_after = min(outcome.retry_after or due, due)
    outcome.events += _transition_events(told, outcome.status, verdict)
    memory.announced[key] = outcome.status
    return outcome


@dataclass(frozen=True)
class _Job:
    """What a pass knows of its job before any write: what the admissions decide from."""

    owner: children.Owner
    spec: RLJobSpec
    meta: dict[str, Any]
    old: RLJobStatus
    views: list[status.PodView]
    verdict: status.Verdict


def _admission(gate: admission.Gate | None, job: _Job, settings: Settings) -> admission.Decision | None:
    """The gate's answer for a job that wants to run; a job that does not (suspended, finished) gives its room
    back."""
    key = (job.owner.namespace, job.owner.name)
    if gate is None:
        return None
    if job.verdict in (status.Verdict.PARK, status.Verdict.FAIL, status.Verdict.SUCCEED):
        gate.release(key)
        return None
    has_pods = any(v.component != Component.COORDINATOR and not v.deleting for v in job.views)
    holds = has_pods or is_true(job.old.conditions, ConditionType.ADMITTED)
    pods = children.pod_shapes(job.owner, job.spec, settings.coordinator_image)
    colocate = job.spec.placement.mode == PlacementMode.COLOCATE
    return gate.decide(key, admission.Want(str(job.meta.get("creationTimestamp", "")), pods, colocate), holds)


def _kueue(api: Api, reads: Reads, job: _Job, settings: Settings) -> tuple[admission.Decision | None, int]:
    """Kueue's answer for a job in one of its queues (None once it finished), and what the integration writes for it
    (see ``kueue``): the Workload, ``spec.suspend`` as Kueue decided, an evicted job's quota given back, a finished
    job's Workload."""
    owner, spec, verdict = job.owner, job.spec, job.verdict
    found = [
        w
        for w in reads.list("Workload", owner.namespace, names.label_selector(owner.name))
        if any(r.get("uid") == owner.uid for r in w["metadata"].get("ownerReferences") or [])
    ]
    seen = kueue.Seen.of(found[0]) if found else None
    done = verdict in (status.Verdict.FAIL, status.Verdict.SUCCEED) or status.terminal(job.old)
    writes = 0
    if seen is None and not done:
        pods = children.pod_specs(owner, spec, settings.coordinator_image)
        writes += api.create(kueue.workload(owner.reference(), owner.namespace, kueue.queue_of(job.meta), pods))
    elif seen is not None and done:
        succeeded = verdict == status.Verdict.SUCCEED or is_true(job.old.conditions, ConditionType.SUCCEEDED)
        writes += kueue.finish(api, seen, succeeded, "the RLJob " + ("succeeded" if succeeded else "failed"))
    decision = kueue.decision(seen)
    if decision.admitted and seen is not None:
        decision = admission.Decision(True, decision.message, kueue.node_labels(api, seen))
    has_pods = any(not v.deleting and v.phase not in ("Succeeded", "Failed") for v in job.views)
    if seen is not None and seen.true("Evicted") and not has_pods:
        writes += kueue.give_back(api, seen)
    if done:
        return None, writes
    if spec.suspend == decision.admitted:  # the lever: suspended exactly while not admitted
        api.patch("RLJob", owner.namespace, owner.name, {"spec": {"suspend": not decision.admitted}})
        writes += 1
    return decision, writes


def _controllers_refusal(
    api: Api, deployment: Obj | None, statefulset: Obj | None, generation: int, parked: bool
) -> Refusal | None:
    """A refusal the job's controllers met creating its pods (see ``refusals``)."""
    if parked:
        return None
    found = refusals.of_deployment(deployment, generation)
    if found is None and statefulset is not None and refusals.short_of_pods(statefulset):
        meta = statefulset["metadata"]
        events = api.list(
            "Event",
            meta["namespace"],
            "",
            field_selector=f"involvedObject.kind=StatefulSet,involvedObject.name={meta['name']},reason=FailedCreate",
        )
        found = refusals.of_statefulset(statefulset, events, generation)
    return found


def _remember(memory: Memory, key: tuple[str, str], uid: str, refused: Refusal | None) -> float | None:
    """Keep the refusal the pass met (or forget a passed one); the delay before retrying it, if it is retried."""
    if refused is None:
        memory.refused.pop(key, None)
        return None
    previous = memory.refused.get(key)
    delay = refusals.retry_after(previous[2] if previous is not None and previous[1] == refused else 0.0)
    memory.refused[key] = (uid, refused, delay)
    return None if refused.permanent else delay


LANE = writing.Lane()
"""Every reconcile's status patches and children's writes, the most urgent first (``writing``); a pass's
independent writes go out side by side: on a busy API server each takes hundreds of milliseconds, and one after
the other they made a suspend's pass several times one write."""


def _child(write: Callable[[Obj], R], obj: Obj) -> Callable[[], R]:
    """``write(obj)`` of a child, through the lane in its turn."""
    return functools.partial(LANE.run, Urgency.IN_TURN, write, obj)


def _ready(obj: dict[str, Any] | None) -> int:
    return int((obj or {}).get("status", {}).get("readyReplicas", 0) or 0)


def _ensure_children(
    api: Api,
    reads: Reads,
    memory: Memory,
    owner: children.Owner,
    spec: RLJobSpec,
    settings: Settings,
    parked: bool,
    generation: int,
    node_labels: dict[str, dict[str, str]],
) -> tuple[int, Refusal | None]:
    """Apply each child that is missing, differs from the spec or drifted; create the token and TLS Secrets once.

    The Secrets are made only when a read finds them missing, and ``create``
    keeps whatever exists (a racing reconcile's): never regenerated, never
    applied over. Returns writes, and the refusal that stopped them (the children after a refused one are not
    written: they may need it)."""
    writes = 0
    for secret_name, secret in (
        (names.token_secret(owner.name), children.token_secret),
        (names.tls_secret(owner.name), children.tls_secret),
    ):
        known = (owner.namespace, secret_name, owner.uid)
        if known in memory.secrets:
            continue
        if reads.get("Secret", owner.namespace, secret_name) is None:
            obj = secret(owner)
            created, refusal = refusals.attempt(_child(api.create, obj), obj, generation)
            if refusal is not None:
                return writes, refusal
            writes += bool(created)
        memory.secrets.add(known)
    stale = []
    for obj in children.desired(
        owner, spec, settings.coordinator_image, settings.coordinator_role, parked, node_labels
    ):
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
        applied, refusal = refusals.attempt(_child(api.apply, obj), obj, generation)
        if refusal is not None:
            return writes, refusal
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
    return writes, None


def _drive_trainer(
    api: Api,
    owner: children.Owner,
    spec: RLJobSpec,
    verdict: status.Verdict,
    pods: list[status.PodView],
    live: list[Obj],
    restarts: int,
    generation: int,
    node_labels: dict[str, str] | None,
    deleted: set[str],
) -> tuple[int, Refusal | None]:
    """Create missing ranks (RUN), each marked with ``restarts`` (the count it is created under), or delete every
    rank (any other verdict but SUCCEED, WAIT and QUEUE); ``deleted``: the uids of ranks deleted before that the
    reads do not show deleting yet (``Memory.deleted``), kept up to date. Returns writes and a refusal that stopped
    them."""
    writes = 0
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in live}
    deleted &= {uids[p.name] for p in pods if not p.deleting and p.name in uids}

    def delete(name: str) -> bool:
        uid = uids.get(name)
        if uid is not None and uid in deleted:
            return False
        done = api.delete("Pod", owner.namespace, name)
        if uid is not None:
            deleted.add(uid)
        return done

    if verdict in (status.Verdict.SUCCEED, status.Verdict.WAIT, status.Verdict.QUEUE):
        return 0, None
    if verdict != status.Verdict.RUN:
        return sum(LANE.each(Urgency.IN_TURN, delete, [pod.name for pod in pods if not pod.deleting])), None
    by_name = {p.name: p for p in pods}
    bodies = {p["metadata"]["name"]: p for p in live}
    for desired in children.trainer_pods(owner, spec, node_labels):
        existing = by_name.get(desired["metadata"]["name"])
        if existing is None:
            desired["metadata"].setdefault("annotations", {})[names.RESTART_ANNOTATION] = str(restarts)
            created, refusal = refusals.attempt(_child(api.create, desired), desired, generation)
            if refusal is not None:
                return writes, refusal
            writes += bool(created)
        elif not existing.deleting and (
            existing.spec_hash != children.current_hash(desired)
            or children.containers(bodies[existing.name]) != children.containers(desired)
        ):
            # a pod's spec is immutable but for its images: replace it (the next reconcile creates it again)
            writes += LANE.run(Urgency.IN_TURN, delete, existing.name)
    return writes, None


def _transition_events(old: RLJobStatus, new: RLJobStatus, verdict: status.Verdict) -> list[tuple[str, str, str]]:
    out = []
    if verdict == status.Verdict.RESTART:
        out.append(
            ("Warning", "TrainerRestarted", f"a trainer rank failed; restarting the gang (restart {new.restarts})")
        )
    if new.phase != old.phase:
        kind = "Warning" if new.phase == "Failed" else "Normal"
        out.append((kind, f"Phase{new.phase}", f"phase {old.phase} -> {new.phase}"))
    for ctype, reason in ((ConditionType.SCHEDULED, "Unschedulable"), (ConditionType.APPLIED, "Refused")):
        was, now = find(old.conditions, ctype), find(new.conditions, ctype)
        if now and now.status == "False" and now.reason == reason and (was is None or was.message != now.message):
            out.append(("Warning", reason, now.message))
    return out
