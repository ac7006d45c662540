"""Faults of a running RLJob on the real control plane, with the failing process run for real.

KWOK marks pods Running but runs nothing, so this test plays the kubelet for the job's trainer pods only (the
coordinator and the vLLM replicas stay KWOK's fakes): once the operator's trainer pod is bound to a node, its one
container (the RLJob's command: a Python one-liner that prints and exits 3) runs through
:class:`tests.e2e.pods.Kubelet` in the pod's own network namespace, and its end is reported to the API server as a
kubelet reports it (:meth:`Kubelet.report_exit`): a strategic-merge patch of the pod's ``status`` subresource,
preconditioned on the pod's uid, with phase Failed, Ready/ContainersReady False (PodCompleted) and the container's
``state.terminated`` (exitCode 3, reason Error).

KWOK leaves that status alone: of its Stages (e2e/README.md) ``pod-ready`` plays only Pending pods whose Ready
condition is not True, ``pod-complete`` only Running pods owned by a Job, and ``pod-delete`` only pods being deleted,
so a Failed trainer pod matches none of them until the operator deletes it. The exit is reported only after KWOK
marked the pod Running (its pod-ready play is done, none is in flight), and a watch on the trainer pods checks that
no later state of a failed pod is anything but Failed with exit code 3.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests import netns
from tests.e2e.chart import Operator, example, rljob, wait_phase
from tests.e2e.conftest import Kube, Timeouts
from tests.e2e.pods import Kubelet

pytestmark = pytest.mark.e2e

JOB = "crashy"
MAX_RESTARTS = 1
EXIT_CODE = 3
COMMAND = ["python", "-c", f"import sys; print('training'); sys.exit({EXIT_CODE})"]
TRAINER = f"weightsync.io/job={JOB},app.kubernetes.io/component=trainer"
PROCESS_S = 60  # a Python one-liner, on a loaded 2-core machine
QUIET_S = 10  # how long the failed job is watched for anything restarting


def _job() -> dict[str, Any]:
    body = example(JOB)
    body["spec"]["trainer"].update(worldSize=1, command=COMMAND)
    body["spec"]["failurePolicy"] = {"maxRestarts": MAX_RESTARTS}
    return body


class PodWatch:
    """Every event of the job's trainer pods (a watch: a pod deleted a moment after it failed is seen too)."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        from kubernetes import watch

        self.events: list[tuple[str, Any]] = []
        self.error: Exception | None = None
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(kube, namespace), daemon=True)
        self._thread.start()

    def _run(self, kube: Kube, namespace: str) -> None:
        pods = kube.core.list_namespaced_pod
        stream = self._watch.stream(pods, namespace, label_selector=TRAINER, timeout_seconds=600)
        try:
            for event in stream:
                self.events.append((event["type"], event["object"]))
        except Exception as e:  # noqa: BLE001 - the stream ends when the test stops it or the namespace goes
            self.error = e

    def uids(self) -> list[str]:
        """The trainer pods created so far, oldest first."""
        return list(dict.fromkeys(o.metadata.uid for t, o in self.events if t == "ADDED"))

    def of(self, uid: str) -> list[tuple[str, Any]]:
        return [(t, o) for t, o in self.events if o.metadata.uid == uid]

    def stop(self) -> None:
        self._watch.stop()
        self._thread.join(5)


def _columns(table: str, name: str) -> dict[str, str]:
    """``kubectl get`` output as header -> value for the row of ``name`` (headers may hold one space: LAST SYNC)."""
    header, *rows = table.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)]
    row = next(r for r in rows if r.split()[0] == name)
    cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    keys = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return dict(zip(keys, cells, strict=True))


def _events(kube: Kube, namespace: str) -> list[dict[str, Any]]:
    """The RLJob's events, as ``kubectl get events`` lists them."""
    out = kube.kubectl(
        "get", "events", "-n", namespace, "-o", "json",
        "--field-selector", f"involvedObject.kind=RLJob,involvedObject.name={JOB}",
    ).stdout  # fmt: skip
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def _event(kube: Kube, namespace: str, kind: str, reason: str) -> bool:
    return any(e["type"] == kind and e["reason"] == reason for e in _events(kube, namespace))


def _claim_bound(kube: Kube, namespace: str) -> bool:
    claim = kube.core.read_namespaced_persistent_volume_claim(f"{JOB}-checkpoints", namespace)
    return bool(claim.status.phase == "Bound")


def _trainer_pods(kube: Kube, namespace: str) -> list[Any]:
    return list(kube.core.list_namespaced_pod(namespace, label_selector=TRAINER).items)


def _bound_trainer(kube: Kube, namespace: str, played: set[str]) -> Any | None:
    """The trainer pod not played yet, once the scheduler gave it a node."""
    fresh = [p for p in _trainer_pods(kube, namespace) if p.metadata.uid not in played]
    assert len(fresh) <= 1, [p.metadata.name for p in fresh]
    pod = fresh[0] if fresh else None
    return pod if pod is not None and pod.spec.node_name and not pod.metadata.deletion_timestamp else None


def _marked_running(kube: Kube, namespace: str, pod: Any) -> bool:
    """KWOK's pod-ready stage played this pod (phase Running, Ready True), so nothing of KWOK's is left in flight."""
    live = kube.core.read_namespaced_pod(pod.metadata.name, namespace)
    ready = kube.pod_condition(live, "Ready")
    return bool(
        live.metadata.uid == pod.metadata.uid
        and live.status.phase == "Running"
        and ready is not None
        and ready.status == "True"
    )


def _history(watch: PodWatch, uid: str) -> str:
    """Pod ``uid``'s states as the watch saw them, e.g. ``ADDED Pending, MODIFIED Running, ..., DELETED Failed``."""
    return ", ".join(
        f"{kind} {pod.status.phase}{' (deleting)' if pod.metadata.deletion_timestamp else ''}"
        for kind, pod in watch.of(uid)
    )


def _stays_failed(watch: PodWatch, uid: str) -> list[str]:
    """What the watch saw of pod ``uid`` from its first Failed state on: every state Failed with exit code 3."""
    events = watch.of(uid)
    first = next(i for i, (_, o) in enumerate(events) if o.status.phase == "Failed")
    seen = []
    for kind, pod in events[first:]:
        terminated = pod.status.container_statuses[0].state.terminated
        assert pod.status.phase == "Failed" and terminated is not None, (kind, pod.status)
        assert terminated.exit_code == EXIT_CODE and terminated.reason == "Error", (kind, terminated)
        seen.append(kind)
    return seen


def test_a_trainer_that_exits_non_zero_counts_against_the_restart_budget_and_the_job_fails_when_it_is_spent(
    kube: Kube, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    """A trainer that exits non-zero counts against the restart budget, and the job ends Failed with the reason
    when the budget is spent."""
    netns.require()
    t0 = time.monotonic()
    watch = PodWatch(kube, namespace)
    kube.prebind_checkpoint_volume(namespace, JOB)
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_job()))
    try:
        kube.wait_for(lambda: _claim_bound(kube, namespace), Timeouts.POD_RUNNING, "the checkpoint claim bound")
        # the trainer rank is created once both replicas have a node, then bound to a GPU node itself
        first = kube.wait_for(lambda: _bound_trainer(kube, namespace, set()), Timeouts.POD_RUNNING, "a bound trainer")
        name = first.metadata.name
        played: list[str] = []
        with netns.Hosts([name]) as hosts, Kubelet(kube, namespace, hosts, [], tmp_path / "pods") as kubelet:
            for attempt in (1, 2):
                pod = first if attempt == 1 else kube.wait_for(
                    lambda: _bound_trainer(kube, namespace, set(played)),
                    Timeouts.POD_RUNNING,
                    f"trainer pod {attempt} bound to a node",
                )  # fmt: skip
                assert pod.metadata.name == name and pod.spec.restart_policy == "Never", pod.spec
                assert pod.spec.node_name.startswith("gpu-node-"), pod.spec.node_name
                # the gang it belongs to: status.restarts when the operator created it (a failure counts once)
                assert pod.metadata.annotations["weightsync.io/restart"] == str(attempt - 1), pod.metadata
                played.append(pod.metadata.uid)

                # the kubelet's part: run the container, wait for it to end, report the end
                kubelet.add(pod)
                proc = kubelet.start(name, "trainer")
                assert proc.popen.wait(timeout=PROCESS_S) == EXIT_CODE, proc.tail()
                assert proc.tail().strip() == "training", proc.tail()
                kube.wait_for(lambda p=pod: _marked_running(kube, namespace, p), Timeouts.POD_RUNNING,
                              f"KWOK marking trainer pod {attempt} Running")  # fmt: skip
                reported = kubelet.report_exit(name)
                assert reported.metadata.uid == pod.metadata.uid and reported.status.phase == "Failed"
                terminated = reported.status.container_statuses[0].state.terminated
                assert terminated.exit_code == EXIT_CODE and terminated.reason == "Error", terminated

                # the operator takes the failed pod away (KWOK never turned it back: it stays Failed, exit 3)
                kube.wait_for(lambda u=pod.metadata.uid: any(t == "DELETED" for t, _ in watch.of(u)),
                              Timeouts.DELETE, f"trainer pod {attempt} deleted")  # fmt: skip
                assert _stays_failed(watch, pod.metadata.uid)[-1] == "DELETED"

                if attempt == 1:
                    # within the budget: the gang restarts, counted once, and the job goes on
                    job = kube.wait_for(
                        lambda: (j := rljob(kube, namespace, JOB)).get("status", {}).get("restarts") == 1 and j,
                        Timeouts.POD_RUNNING,
                        "status.restarts 1",
                    )
                    assert job["status"]["phase"] != "Failed", job["status"]
                    restarted = kube.wait_for(
                        lambda: [e for e in _events(kube, namespace) if e["reason"] == "TrainerRestarted"],
                        Timeouts.POD_RUNNING,
                        "a TrainerRestarted event",
                    )
                    assert [(e["type"], e["message"]) for e in restarted] == [
                        ("Warning", "a trainer rank failed; restarting the gang (restart 1)")
                    ], restarted
                    wide = _columns(kube.kubectl("get", "rlj", JOB, "-n", namespace, "-o", "wide").stdout, JOB)
                    assert wide["RESTARTS"] == "1" and wide["PHASE"] != "Failed", wide

            # the budget is spent: Failed, with the reason and the budget named; nothing of the trainer is left
            job = wait_phase(kube, namespace, JOB, "Failed")
            status = job["status"]
            failed = next(c for c in status["conditions"] if c["type"] == "Failed")
            assert failed["status"] == "True" and failed["reason"] == "RestartBudgetExhausted", failed
            assert f"maxRestarts={MAX_RESTARTS}" in failed["message"], failed
            assert status["restarts"] == MAX_RESTARTS, status
            kube.wait_for(lambda: not _trainer_pods(kube, namespace), Timeouts.DELETE, "no trainer pods left")
            table = kube.kubectl("get", "rlj", JOB, "-n", namespace, "-o", "wide").stdout
            wide = _columns(table, JOB)
            assert wide["PHASE"] == "Failed" and wide["RESTARTS"] == str(MAX_RESTARTS), table
            kube.wait_for(lambda: _event(kube, namespace, "Warning", "PhaseFailed"), Timeouts.POD_RUNNING,
                          "a PhaseFailed Warning event")  # fmt: skip

            # and it stays so: no trainer pod comes back, the count does not move
            time.sleep(QUIET_S)
            assert watch.uids() == played, (played, watch.uids())
            assert not _trainer_pods(kube, namespace)
            later = rljob(kube, namespace, JOB)["status"]
            assert later["phase"] == "Failed" and later["restarts"] == MAX_RESTARTS, later
            reasons = [e["reason"] for e in _events(kube, namespace)]
            assert reasons.count("TrainerRestarted") == 1, reasons
            assert watch.error is None, watch.error
            histories = "\n".join(f"  trainer pod {i}: {_history(watch, u)}" for i, u in enumerate(played, 1))
            print(f"\ntook {time.monotonic() - t0:.0f}s\n{histories}\n{table}")
    finally:
        watch.stop()
        kube.kubectl("delete", "pv", f"{namespace}-{JOB}", "--wait=false", check=False)
