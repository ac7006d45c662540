"""From what the cluster shows to the RLJob's status: conditions first, the phase derived from them.

Pure functions over plain observations, so every rule is unit-tested without an
API server:

- Terminal states are sticky: once Succeeded or Failed, nothing moves the job
  out of it (a user re-creates the RLJob to run again).
- A trainer rank that failed restarts the whole gang (ranks rendezvous
  together) while ``status.restarts < spec.failurePolicy.maxRestarts``; then the
  job is Failed. The count lives in status and only grows. Each rank is
  created with the count of its time (annotation ``weightsync.io/restart``), so
  a failure is counted once: a failed rank created before the last counted
  restart (the operator died between counting it and deleting the gang, or its
  cache of pods lags the status it wrote) is deleted without counting again.
- Every rank Succeeded means training finished: the job Succeeded.
- Running is True when the coordinator, every trainer rank and every replica is
  ready; a pod the scheduler cannot place turns Scheduled False with the
  scheduler's own words (e.g. "0/3 nodes are available: 3 Insufficient
  nvidia.com/gpu").
- The trainer's ranks are created only once every replica has a node: a job
  whose replicas cannot be placed holds no trainer GPUs while it waits (ranks
  that already run are left alone; a gang restart waits again).
- A job the gang admission has not admitted (``Admitted`` False: the built-in
  gate, or Kueue) has no pods and says why (``Running`` False, reason Queued).
- A child the API server refused (``Applied`` False) says so in ``Running`` too.
- ``Scheduled`` is True only when every pod the job should have exists and has a
  node: a job without pods (suspended, queued, refused) is not "scheduled".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from weightsync.resources.conditions import ConditionStatus, find, is_true, set_condition
from weightsync.resources.rljob import ConditionType, RLJobSpec, RLJobStatus, derive_phase
from weightsync_operator import names
from weightsync_operator.admission import Decision
from weightsync_operator.refusals import Refusal
from weightsync_operator.versions import VersionSummary

TRUE, FALSE = ConditionStatus.TRUE, ConditionStatus.FALSE


@dataclass(frozen=True)
class PodView:
    """The few facts about a pod the status needs."""

    name: str
    phase: str
    ready: bool
    deleting: bool
    unschedulable: str | None  # the scheduler's message when it cannot place the pod
    rank: int | None = None
    spec_hash: str | None = None
    component: str | None = None
    placed: bool = False  # the scheduler gave it a node
    restart: int | None = None  # a trainer rank's gang: status.restarts when it was created

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodView:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        conditions = {c.get("type"): c for c in status.get("conditions", [])}
        scheduled = conditions.get("PodScheduled", {})
        unschedulable = (
            scheduled.get("message") or "unschedulable"
            if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
            else None
        )
        rank = meta.get("labels", {}).get(names.RANK_LABEL)
        restart = meta.get("annotations", {}).get(names.RESTART_ANNOTATION)
        return cls(
            name=meta.get("name", ""),
            phase=status.get("phase", "Pending"),
            ready=conditions.get("Ready", {}).get("status") == "True",
            deleting=bool(meta.get("deletionTimestamp")),
            unschedulable=unschedulable,
            rank=int(rank) if rank is not None else None,
            spec_hash=meta.get("annotations", {}).get(names.HASH_ANNOTATION),
            component=meta.get("labels", {}).get(names.COMPONENT_LABEL),
            placed=bool(pod.get("spec", {}).get("nodeName")),
            restart=int(restart) if restart is not None and str(restart).isdigit() else None,
        )


class Verdict(enum.StrEnum):
    """What to do with the trainer gang."""

    RUN = "Run"  # create missing ranks
    WAIT = "Wait"  # no rank yet and a replica without a node: hold no trainer GPUs until the replicas have theirs
    QUEUE = "Queue"  # not admitted (gang admission): no pods at all until the whole job fits
    PARK = "Park"  # suspended or finished: no ranks
    RESTART = "Restart"  # a rank failed and budget is left: delete all, count one restart
    CLEAR = "Clear"  # only ranks of a gang whose failure is counted already failed: delete all, count nothing
    FAIL = "Fail"  # a rank failed and the budget is spent
    SUCCEED = "Succeed"  # every rank exited 0


def terminal(status: RLJobStatus) -> bool:
    return is_true(status.conditions, ConditionType.FAILED) or is_true(status.conditions, ConditionType.SUCCEEDED)


def decide_trainer(spec: RLJobSpec, status: RLJobStatus, trainer: list[PodView], replicas_placed: int) -> Verdict:
    if terminal(status) or spec.suspend:
        return Verdict.PARK
    live = [p for p in trainer if not p.deleting]
    if not live and replicas_placed < spec.inference.replicas:
        return Verdict.WAIT
    failed = [p for p in live if p.phase == "Failed"]
    if failed and all(p.restart is not None and p.restart < status.restarts for p in failed):
        return Verdict.CLEAR
    if failed:
        return Verdict.RESTART if status.restarts < spec.failure_policy.max_restarts else Verdict.FAIL
    ranks = {p.rank for p in live if p.phase == "Succeeded"}
    if len(ranks) == spec.trainer.world_size:
        return Verdict.SUCCEED
    return Verdict.RUN


@dataclass
class Observed:
    generation: int
    coordinator_ready: int = 0
    inference_ready: int = 0
    trainer: list[PodView] = field(default_factory=list)
    pods: list[PodView] = field(default_factory=list)  # every pod of the job
    admission: Decision | None = None  # the gang admission's answer (None: no gate decides for this job)
    refusal: Refusal | None = None  # a child the API server refused


def expected_pods(spec: RLJobSpec) -> dict[str, int]:
    """The pods a running job has, by component."""
    return {
        names.Component.COORDINATOR: 1,
        names.Component.INFERENCE: spec.inference.replicas,
        names.Component.TRAINER: spec.trainer.world_size,
    }


def _scheduled(spec: RLJobSpec, seen: Observed, verdict: Verdict, done: bool) -> tuple[ConditionStatus, str, str]:
    """Status, reason and message of ``Scheduled``: True only when every pod the job should have has a node."""
    if done:
        return FALSE, "Finished", "the job has finished: it holds no nodes"
    if spec.suspend:
        return FALSE, "Suspended", "spec.suspend is true: the job has no pods"
    if verdict == Verdict.QUEUE:
        return FALSE, "Queued", "the job is not admitted yet: it has no pods"
    stuck = sorted((p for p in seen.pods if p.unschedulable and not p.deleting), key=lambda p: p.name)
    if stuck:
        return FALSE, "Unschedulable", "; ".join(f"pod {p.name}: {p.unschedulable}" for p in stuck[:3])
    expected = expected_pods(spec)
    placed = {
        component: min(count, sum(1 for p in seen.pods if p.component == component and p.placed and not p.deleting))
        for component, count in expected.items()
    }
    # no counts in the messages: each pod placed would be one more status write (Running has the counts)
    if sum(placed.values()) >= sum(expected.values()):
        return TRUE, "AllScheduled", f"every pod has a node ({sum(expected.values())} pods)"
    if seen.refusal is not None:
        return FALSE, "Refused", f"not every pod has a node: {seen.refusal.text}"
    return FALSE, "Waiting", "not every pod has a node yet (created, not placed yet, or not created yet)"


def next_status(
    spec: RLJobSpec, old: RLJobStatus, seen: Observed, verdict: Verdict, versions: VersionSummary
) -> RLJobStatus:
    """The status the job should have now; equal to ``old`` when nothing changed."""
    gen = seen.generation
    new = old.model_copy(deep=True)
    conds = new.conditions
    restarts = old.restarts + (1 if verdict == Verdict.RESTART else 0)
    if verdict == Verdict.FAIL:
        conds = set_condition(
            conds,
            ConditionType.FAILED,
            TRUE,
            "RestartBudgetExhausted",
            f"a trainer rank failed after {old.restarts} restarts "
            f"(spec.failurePolicy.maxRestarts={spec.failure_policy.max_restarts})",
            gen,
        )
    elif verdict == Verdict.SUCCEED:
        conds = set_condition(
            conds,
            ConditionType.SUCCEEDED,
            TRUE,
            "TrainerCompleted",
            f"all {spec.trainer.world_size} trainer ranks exited 0",
            gen,
        )

    done = verdict in (Verdict.FAIL, Verdict.SUCCEED) or terminal(old)
    if spec.suspend and not done:
        conds = set_condition(conds, ConditionType.SUSPENDED, TRUE, "Suspended", "spec.suspend is true", gen)
    elif find(conds, ConditionType.SUSPENDED) is not None:
        conds = set_condition(conds, ConditionType.SUSPENDED, FALSE, "Resumed", "spec.suspend is false", gen)

    trainer_ready = sum(1 for p in seen.trainer if p.phase == "Running" and p.ready and not p.deleting)
    running = (
        not done
        and not spec.suspend
        and seen.coordinator_ready >= 1
        and seen.inference_ready >= spec.inference.replicas
        and trainer_ready >= spec.trainer.world_size
    )
    if running:
        conds = set_condition(
            conds, ConditionType.RUNNING, TRUE, "AllReady", "coordinator, trainer ranks and replicas are ready", gen
        )
    else:
        reason = "Finished" if done else "Suspended" if spec.suspend else "Starting"
        message = (
            f"coordinator {seen.coordinator_ready}/1, trainer {trainer_ready}/{spec.trainer.world_size}, "
            f"replicas {seen.inference_ready}/{spec.inference.replicas} ready"
        )
        if verdict == Verdict.WAIT:
            reason, message = "WaitingForReplicas", f"{message}; the trainer starts once every replica has a node"
        if verdict == Verdict.QUEUE and seen.admission is not None:
            reason, message = "Queued", seen.admission.message
        if seen.refusal is not None and not done and not spec.suspend:
            reason, message = "Refused", seen.refusal.text
        conds = set_condition(conds, ConditionType.RUNNING, FALSE, reason, message, gen)

    conds = set_condition(conds, ConditionType.SCHEDULED, *_scheduled(spec, seen, verdict, done), gen)
    if seen.refusal is not None:
        conds = set_condition(conds, ConditionType.APPLIED, FALSE, "Refused", seen.refusal.text, gen)
    else:
        conds = set_condition(conds, ConditionType.APPLIED, TRUE, "AllApplied", "the API server took every child", gen)
    if seen.admission is not None:
        admitted = TRUE if seen.admission.admitted else FALSE
        reason = "Admitted" if seen.admission.admitted else "Queued"
        conds = set_condition(conds, ConditionType.ADMITTED, admitted, reason, seen.admission.message, gen)
    elif find(conds, ConditionType.ADMITTED) is not None and (done or spec.suspend):
        why = "Finished" if done else "Suspended"
        conds = set_condition(conds, ConditionType.ADMITTED, FALSE, why, "the job holds no room", gen)

    if versions.newest is not None:
        synced = versions.newest_phase == "Ready"
        conds = set_condition(
            conds,
            ConditionType.SYNCED,
            TRUE if synced else FALSE,
            versions.newest_phase,
            f"version {versions.newest} is {versions.newest_phase}",
            gen,
        )

    new.conditions = conds
    new.restarts = restarts
    new.observed_generation = gen
    new.replicas = spec.inference.replicas
    new.ready_replicas = seen.inference_ready
    new.ready = f"{seen.inference_ready}/{spec.inference.replicas}"
    new.trainer_ready = trainer_ready
    new.current_version = versions.current
    new.replicas_loaded = versions.replicas_loaded
    new.replicas_failed = versions.replicas_failed
    new.last_sync_seconds = versions.last_sync_seconds
    new.last_failed_version = versions.last_failed
    new.phase = derive_phase(new)
    return new
