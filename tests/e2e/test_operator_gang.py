"""Ten RLJobs on 16 GPUs: each runs whole or waits whole, none deadlocks, and they run in turn as others finish.

Each job is ``examples/rljob.yaml``: 2 trainer ranks and 2 vLLM replicas of 1 GPU each, and a coordinator; the
e2e cluster has two nodes of 8 GPUs, so four jobs fit at once. All ten are applied in one ``kubectl apply``. The
operator's built-in gang admission creates a job's pods only once all of them fit, so the others are queued with no
pod at all (``Admitted`` False, saying what is short), and no pod ever waits for a node with room (the deadlock the
issue saw: three jobs holding 8 GPUs between them, none able to run).

A running job finishes when its trainer ranks exit 0. KWOK runs no container, so the test reports that end for each
rank as a kubelet would (:func:`tests.e2e.pods.report_end`; no process runs: what the ranks do is not what this test
is about); the operator then marks the job Succeeded and scales its replicas and coordinator to zero, its room goes
back, and the oldest queued jobs are admitted.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import pytest

from tests.e2e.chart import Operator, example, rljob
from tests.e2e.conftest import Kube, Timeouts
from tests.e2e.pods import End, report_end

pytestmark = pytest.mark.e2e

JOBS = 10
GPUS, PER_JOB = 16, 4
TURN_S = 180  # a batch admitted, its pods bound and Running, on a loaded 2-core machine


class PodWatch:
    """Every pod event in the namespace (a watch: nothing between two polls is missed)."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        from kubernetes import watch

        self.events: list[tuple[str, Any]] = []
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(kube, namespace), daemon=True)
        self._thread.start()

    def _run(self, kube: Kube, namespace: str) -> None:
        stream = self._watch.stream(kube.core.list_namespaced_pod, namespace, timeout_seconds=1800)
        try:
            for event in stream:
                self.events.append((event["type"], event["object"]))
        except Exception:  # noqa: BLE001 - the stream ends when the test stops it or the namespace goes
            pass

    def short_of_room(self) -> list[str]:
        """Pods the scheduler ever found no node with room for (``Insufficient ...``: the deadlock's symptom; a pod
        that waits a moment for its checkpoint claim to be bound is not one)."""
        out = []
        for _, pod in self.events:
            for cond in pod.status.conditions or []:
                if cond.type == "PodScheduled" and cond.status == "False" and "Insufficient" in (cond.message or ""):
                    out.append(f"{pod.metadata.name}: {cond.message}")
        return out

    def stop(self) -> None:
        self._watch.stop()


def _gpu_pods(kube: Kube, namespace: str) -> dict[str, list[Any]]:
    """The GPU pods (trainer ranks, replicas) that hold a GPU now, by job."""
    out: dict[str, list[Any]] = {}
    for pod in kube.core.list_namespaced_pod(namespace).items:
        labels = pod.metadata.labels or {}
        if labels.get("app.kubernetes.io/component") in ("trainer", "inference") and pod.status.phase not in (
            "Succeeded",
            "Failed",
        ):
            out.setdefault(labels["weightsync.io/job"], []).append(pod)
    return out


def _phases(kube: Kube, namespace: str, names: list[str]) -> dict[str, str]:
    return {n: rljob(kube, namespace, n).get("status", {}).get("phase", "") for n in names}


def _admitted(job: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in job["status"]["conditions"] if c["type"] == "Admitted")


def _finish(kube: Kube, namespace: str, job: str) -> None:
    """Every trainer rank of ``job`` exits 0 (reported as its kubelet would)."""
    selector = f"weightsync.io/job={job},app.kubernetes.io/component=trainer"
    for pod in kube.core.list_namespaced_pod(namespace, label_selector=selector).items:
        report_end(kube, namespace, pod, [End("trainer", 0, pod.status.start_time.strftime("%Y-%m-%dT%H:%M:%SZ"))])


def run_ten_jobs(
    kube: Kube, namespace: str, labels: dict[str, str], queued_phase: str, queued_says: str, in_order: bool
) -> None:
    """The scenario: ten jobs (with ``labels``) at once; each turn, the running ones hold all their GPU pods and the
    others none (in ``queued_phase``, ``Admitted`` False with ``queued_says`` in its message), then the running ones
    finish and the next ones run (with ``in_order``, the oldest queued first)."""
    names = [f"gang-{i}" for i in range(JOBS)]
    for name in names:
        kube.prebind_checkpoint_volume(namespace, name)
    watch = PodWatch(kube, namespace)
    jobs = [example(n) for n in names]
    for job in jobs:
        job["metadata"]["labels"] = dict(labels)
    kube.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": jobs})
    )
    done: list[str] = []
    order: list[list[str]] = []
    try:
        while len(done) < JOBS:
            expected = min(GPUS // PER_JOB, JOBS - len(done))
            waiting = [n for n in names if n not in done]

            def settled(waiting: list[str] = waiting, expected: int = expected) -> list[str] | None:
                phases = _phases(kube, namespace, waiting)
                running = [n for n in waiting if phases[n] == "Running"]
                queued = [n for n in waiting if phases[n] == queued_phase]
                return running if len(running) == expected and len(queued) == len(waiting) - expected else None

            running = kube.wait_for(settled, TURN_S, f"{expected} of the waiting jobs Running", interval=1.0)
            # whole or nothing: each running job holds all of its 4 GPU pods, each waiting job none, 16 GPUs at most
            pods = _gpu_pods(kube, namespace)
            for name in waiting:
                held = len(pods.get(name, []))
                assert held == (PER_JOB if name in running else 0), (name, held, sorted(pods))
            assert sum(len(p) for p in pods.values()) <= GPUS
            for name in waiting:
                if name not in running:
                    admitted = _admitted(rljob(kube, namespace, name))
                    assert admitted["status"] == "False" and admitted["reason"] == "Queued", admitted
                    assert queued_says in admitted["message"], admitted
            if order and in_order:  # after the first batch every job is queued: the oldest go first
                assert running == waiting[:expected], (running, waiting)
            order.append(running)
            for name in running:
                _finish(kube, namespace, name)
            kube.wait_for(
                lambda running=running: all(p == "Succeeded" for p in _phases(kube, namespace, running).values()),
                TURN_S,
                f"{running} Succeeded",
            )
            done += running
        assert watch.short_of_room() == [], "no pod ever waited for a node with room"
        assert [len(b) for b in order] == [4, 4, 2], order
    finally:
        watch.stop()
        kube.kubectl("delete", "rlj", "--all", "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s", check=False)
        for name in names:
            kube.kubectl("delete", "pv", f"{namespace}-{name}", "--wait=false", check=False)


def test_ten_jobs_on_sixteen_gpus_run_whole_or_wait_whole_and_in_turn(
    kube: Kube, namespace: str, operator: Operator
) -> None:
    """The built-in gang admission: a queued job is Pending with no pod, and says what is short."""
    run_ten_jobs(kube, namespace, {}, "Pending", "the whole job does not fit now", in_order=True)


def test_a_job_deleted_out_of_the_operators_sight_gives_its_room_back(
    kube: Kube, namespace: str, operator: Operator
) -> None:
    """An admitted RLJob deleted with no finalizer left (taken off while the operator was stopped, then the job
    deleted): kopf forgets a finalizer-less object on its deletion without stopping its daemon or calling the
    cleanup, as when a namespace is deleted under an operator that has just listed its jobs (seen in CI on
    2026-11-30: such a ghost held 4 of 16 GPUs through the whole of the next test). The job's loop finds the RLJob
    gone on its next pass and releases its admission: the queued job is admitted into its room."""
    names = [f"ghost-{i}" for i in range(GPUS // PER_JOB + 1)]
    for name in names:
        kube.prebind_checkpoint_volume(namespace, name)
    jobs = {"apiVersion": "v1", "kind": "List", "items": [example(n) for n in names]}
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(jobs))
    try:

        def split() -> tuple[list[str], list[str]] | None:
            conditions = {n: _admission(kube, namespace, n) for n in names}
            granted = [n for n, c in conditions.items() if c is not None and c["status"] == "True"]
            queued = [n for n, c in conditions.items() if c is not None and c.get("reason") == "Queued"]
            return (granted, queued) if len(granted) == GPUS // PER_JOB and len(queued) == 1 else None

        granted, (queued,) = kube.wait_for(split, TURN_S, "4 jobs admitted and 1 queued", interval=1.0)
        ghost = granted[0]
        assert operator.proc is not None
        pid = operator.proc.pid
        os.kill(pid, signal.SIGSTOP)  # a few seconds, well inside its leader lease
        try:
            kube.kubectl("patch", "rlj", ghost, "-n", namespace, "--type=json", "-p",
                         '[{"op": "remove", "path": "/metadata/finalizers"}]')  # fmt: skip
            kube.kubectl("delete", "rlj", ghost, "-n", namespace, "--timeout", "30s")
        finally:
            os.kill(pid, signal.SIGCONT)

        def admitted() -> bool:
            condition = _admission(kube, namespace, queued)
            return condition is not None and condition["status"] == "True"

        kube.wait_for(admitted, TURN_S, f"{queued} admitted into the room of the deleted {ghost}", interval=1.0)
        assert "is gone" in operator.log.read_text()
    finally:
        kube.kubectl("delete", "rlj", "--all", "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s", check=False)
        for name in names:
            kube.kubectl("delete", "pv", f"{namespace}-{name}", "--wait=false", check=False)


def _admission(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    conditions = rljob(kube, namespace, name).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "Admitted"), None)
