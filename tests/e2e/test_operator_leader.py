"""Two operators, one leader, on the real control plane: the Lease, a leader that cannot renew, a kill -9 mid-reconcile.

The operators run as local processes under the chart's ServiceAccount (:mod:`tests.e2e.chart`), so
the Lease rights they use are the chart's Role. The faults are real: the leader's renewals are
refused by the API server (its RoleBinding deleted), another holder is written into the Lease, and
the leading process is killed with SIGKILL between the creations of one reconcile pass.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import config, watch

from tests.e2e.chart import EXAMPLE_JOB, REPO, Operator, children, rljob, wait_phase
from tests.e2e.conftest import Kube, Timeouts
from weightsync_operator.kubeapi import Api
from weightsync_operator.leader import Lease, Timing

pytestmark = pytest.mark.e2e

JOB = EXAMPLE_JOB
FAST = Timing(lease_s=4.0, renew_deadline_s=2.5, retry_s=0.5)
DEFAULT = Timing()


def _lease(kube: Kube, operator: Operator) -> dict[str, Any]:
    """The Lease's spec; {} while there is none."""
    out = kube.kubectl("get", "lease", operator.lease, "-n", operator.system, "-o", "json", check=False).stdout
    spec: dict[str, Any] = json.loads(out)["spec"] if out else {}
    return spec


def _time(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _holder(kube: Kube, operator: Operator, identity: str) -> dict[str, Any]:
    return kube.wait_for(
        lambda: (spec := _lease(kube, operator)).get("holderIdentity") == identity and spec,
        Timeouts.POD_RUNNING,
        f"{identity} holds the Lease",
    )


def test_one_holder_at_a_time_and_a_leader_that_cannot_renew_stops_before_another_takes_over(
    kube: Kube, operator: Operator, tmp_path: Path
) -> None:
    kube.wait_for(lambda: _lease(kube, operator).get("holderIdentity"), Timeouts.POD_RUNNING, "the operator leads")
    operator.stop()  # a clean stop gives the Lease up
    assert not _lease(kube, operator).get("holderIdentity")
    api = Api(config.new_client_from_config(config_file=str(operator.kubeconfig)))
    a, b = (Lease(api, operator.system, operator.lease, name, FAST) for name in ("a", "b"))

    # two candidates race for the free Lease: the API server takes exactly one write
    with ThreadPoolExecutor(2) as pool:
        won = list(pool.map(lambda c: c.attempt(5.0), (a, b)))
    assert sorted(won) == [False, True]
    leader, standby = (a, b) if won[0] else (b, a)
    lost: queue.Queue[tuple[float, str]] = queue.Queue()
    stop = threading.Event()
    leader.keep(lambda why: lost.put((time.monotonic(), why)), stop)
    try:
        # renewals keep the standby out, for longer than a lease
        deadline = time.monotonic() + FAST.lease_s + 1.5
        while time.monotonic() < deadline:
            assert not standby.attempt(5.0) and standby.holder == leader.identity
            time.sleep(FAST.retry_s)
        assert lost.empty()

        # the leader's renewals refused by the API server: it gives up within its deadline
        binding = operator.lease  # the chart's Role and RoleBinding share the Lease's name
        saved = json.loads(kube.kubectl("get", "rolebinding", binding, "-n", operator.system, "-o", "json").stdout)
        last_renewal = _time(_lease(kube, operator)["renewTime"])
        revoked = time.monotonic()
        kube.kubectl("delete", "rolebinding", binding, "-n", operator.system)
        at, why = lost.get(timeout=FAST.renew_deadline_s + 5)
        assert why == f"the Lease was not renewed for {FAST.renew_deadline_s:g}s", why
        assert at - revoked <= FAST.renew_deadline_s + FAST.retry_s + 1.0
        for field in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            saved["metadata"].pop(field, None)
        kube.kubectl("create", "-f", "-", input=json.dumps(saved))

        # the standby takes over only after the Lease went a whole lease unrenewed
        assert standby.acquire(threading.Event())
        took = _lease(kube, operator)
        assert took["holderIdentity"] == standby.identity and took["leaseTransitions"] >= 1
        assert _time(took["acquireTime"]) - last_renewal >= FAST.lease_s, (took, last_renewal)
    finally:
        stop.set()

    # another holder written into the Lease (as after a partition): the leader stops at its next renewal
    stop = threading.Event()
    standby.keep(lambda why: lost.put((time.monotonic(), why)), stop)
    try:
        kube.kubectl(
            "patch", "lease", operator.lease, "-n", operator.system, "--type", "merge",
            "-p", json.dumps({"spec": {"holderIdentity": "intruder"}}),
        )  # fmt: skip
        stolen = time.monotonic()
        at, why = lost.get(timeout=FAST.renew_deadline_s + 5)
        assert why == f"the Lease {operator.system}/{operator.lease} is held by intruder", why
        assert at - stolen <= FAST.retry_s + 2.0
    finally:
        stop.set()
    # free again, as the chart made it (the operators may not create it: they may only get and update this one)
    free = json.dumps({"spec": {"holderIdentity": None, "leaseDurationSeconds": 1}})
    kube.kubectl("patch", "lease", operator.lease, "-n", operator.system, "--type", "merge", "-p", free)


def _standing_by(log: Path, identity: str, leader: str) -> bool:
    return f"standing by as {identity}: {leader} leads" in log.read_text(errors="replace")


def _reconciled(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if " reconciled " in line]


def test_two_operators_one_reconciles_and_a_kill_mid_reconcile_converges(
    kube: Kube, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    first, second = operator, Operator(operator.release, operator.system, operator.kubeconfig, tmp_path / "second.log")
    first.stop()
    first.log.write_text("")
    first.start("--leader-elect-identity=first")
    _holder(kube, operator, "first")
    second.start("--leader-elect-identity=second")
    kube.wait_for(lambda: _standing_by(second.log, "second", "first"), Timeouts.POD_RUNNING, "second stands by")
    try:
        kube.prebind_checkpoint_volume(namespace, JOB)
        kube.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "rljob.yaml"))
        wait_phase(kube, namespace, JOB, "Running")
        before = children(kube, namespace, JOB)
        tls = kube.core.read_namespaced_secret(f"{JOB}-tls", namespace)
        assert _reconciled(first.log) and not _reconciled(second.log)

        # a pass with many creations: the leader paused while its children go, then killed -9 as soon as the
        # pass has created its first one (the job's ConfigMap comes first in the pass)
        assert first.proc is not None
        os.kill(first.proc.pid, signal.SIGSTOP)
        doomed = ["sts", f"{JOB}-inference", "deploy", f"{JOB}-coordinator"]
        kube.kubectl("delete", *doomed[:2], "-n", namespace, "--wait=false")
        kube.kubectl("delete", *doomed[2:], "-n", namespace, "--wait=false")
        kube.kubectl("delete", "netpol,svc,cm", "-n", namespace, "-l", f"weightsync.io/job={JOB}", "--wait=false")
        gone = children(kube, namespace, JOB)
        assert "ConfigMap" not in gone and "StatefulSet" not in gone, gone
        config_maps = kube.core.list_namespaced_config_map(namespace, label_selector=f"weightsync.io/job={JOB}")
        events = watch.Watch().stream(
            kube.core.list_namespaced_config_map,
            namespace,
            label_selector=f"weightsync.io/job={JOB}",
            resource_version=config_maps.metadata.resource_version,
            timeout_seconds=60,
        )
        os.kill(first.proc.pid, signal.SIGCONT)
        for event in events:
            if event["type"] == "ADDED":
                os.kill(first.proc.pid, signal.SIGKILL)
                break
        first.proc.wait(10)
        killed = time.monotonic()
        mid_pass = children(kube, namespace, JOB)
        assert "ConfigMap" in mid_pass, mid_pass
        assert {"StatefulSet", "Deployment"} - set(mid_pass), f"the kill landed after the pass: {mid_pass}"

        # the standby takes over once the dead leader's Lease expires, and finishes the pass
        took = _holder(kube, operator, "second")
        takeover = time.monotonic() - killed
        print(f"kill -9 mid-pass: missing {sorted(set(before) - set(mid_pass))}; standby led after {takeover:.1f} s")
        assert takeover <= DEFAULT.lease_s + DEFAULT.retry_s + 5, took
        kube.wait_for(
            lambda: (
                {k: v for k, v in children(kube, namespace, JOB).items() if k != "Pod"}
                == {k: v for k, v in before.items() if k != "Pod"}
            ),
            Timeouts.POD_RUNNING,
            "every child back",
        )
        wait_phase(kube, namespace, JOB, "Running")
        after = children(kube, namespace, JOB)
        assert len(after["Pod"]) == len(before["Pod"]), after  # no duplicate, none orphaned
        kept = kube.core.read_namespaced_secret(f"{JOB}-tls", namespace)
        assert kept.metadata.uid == tls.metadata.uid and kept.data == tls.data
        assert rljob(kube, namespace, JOB)["status"]["restarts"] == 0
        log = second.log.read_text(errors="replace")
        leading = log.index("leading as second")
        assert not any(line in log[:leading] for line in _reconciled(second.log)), "second reconciled while standing by"

        # the killed one comes back as a standby; a clean stop of the leader hands over at the next try
        first.start("--leader-elect-identity=first-again")
        kube.wait_for(
            lambda: _standing_by(first.log, "first-again", "second"), Timeouts.POD_RUNNING, "first-again stands by"
        )
        second.stop()
        handed = time.monotonic()
        _holder(kube, operator, "first-again")
        handover = time.monotonic() - handed
        print(f"SIGTERM of the leader: the standby led after {handover:.1f} s")
        assert handover <= DEFAULT.retry_s + 3
        kube.kubectl("delete", "rlj", JOB, "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")
        kube.wait_for(lambda: not children(kube, namespace, JOB), Timeouts.DELETE, "children deleted")
    finally:
        second.stop()
        print(second.log.read_text(errors="replace")[-4000:])
        kube.kubectl("delete", "pv", f"{namespace}-{JOB}", "--wait=false", check=False)
