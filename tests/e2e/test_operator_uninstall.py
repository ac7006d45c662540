"""``helm uninstall`` on the real control plane, with the chart's pre-delete check run for real.

KWOK would end the hook Job's pod with exit 0 at once, so the check would never run: the release here annotates its
pods ``weightsync.io/e2e-kubelet`` (the chart's ``podAnnotations``), which e2e/cluster.sh's KWOK leaves to the test,
and the test plays that pod as :class:`tests.e2e.pods.Kubelet` plays the others: its container (``weightsync
operator --check-uninstall``, as the chart's Job writes it) runs as a process in the pod's own network namespace,
authenticated as the pod's ServiceAccount (the chart's operator account) with a token bound to the pod, and its exit
is reported to the API server as a kubelet reports it. The Job controller and helm take it from there.

With an RLJob present, the check names it and exits 1: the Job fails, helm uninstall fails, the release, the
operator and the job stay. Once the job is deleted the check passes and helm removes everything, the leader's
Lease included (the chart makes it), so a next install does not wait out a dead leader's lease.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests import netns
from tests.e2e.chart import Operator, example, installed, wait_phase
from tests.e2e.conftest import Kube, Timeouts
from tests.e2e.pods import Kubelet, TcpForwarder

pytestmark = pytest.mark.e2e

PLAYED = {"weightsync.io/e2e-kubelet": "uninstall-check"}
CHECK_S = 60  # the check: a Python process that lists RLJobs, on a loaded 2-core machine


def _hook_pod(kube: Kube, op: Operator, seen: set[str]) -> Any | None:
    """The uninstall check's pod (not one played before), once KWOK marked it Running on its node."""
    pods = kube.core.list_namespaced_pod(op.system, label_selector="app.kubernetes.io/component=uninstall-check")
    fresh = [p for p in pods.items if p.metadata.uid not in seen and p.spec.node_name]
    return next((p for p in fresh if p.status.phase == "Running"), None)


def _uninstall(kube: Kube, op: Operator, work: Path, seen: set[str]) -> tuple[subprocess.CompletedProcess[str], str]:
    """``helm uninstall`` with its hook's pod played here: helm's answer and what the check printed."""
    port = urlsplit(yaml.safe_load(kube.cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]).port
    assert port is not None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        helm = pool.submit(kube.helm, "uninstall", op.release, "-n", op.system, "--timeout", "180s", check=False)
        pod = kube.wait_for(lambda: _hook_pod(kube, op, seen), Timeouts.POD_RUNNING, "the uninstall check's pod")
        seen.add(pod.metadata.uid)
        name = pod.metadata.name
        assert pod.metadata.annotations == PLAYED and pod.spec.service_account_name == f"{op.release}-weightsync"
        with (
            netns.Hosts([name]) as hosts,
            TcpForwarder((hosts.bridge_address, port), ("127.0.0.1", port)),
            Kubelet(kube, op.system, hosts, [pod], work / name) as kubelet,
        ):
            hosts.resolve({"kubernetes.default.svc": hosts.bridge_address})
            kubeconfig = kubelet.in_cluster_kubeconfig(name, "uninstall-check", work / f"{name}.kubeconfig", port)
            proc = kubelet.start(name, "uninstall-check", extra_env={"KUBECONFIG": str(kubeconfig)})
            proc.popen.wait(timeout=CHECK_S)
            printed = proc.tail()
            kubelet.report_exit(name)
        return helm.result(), printed


def _lease(kube: Kube, op: Operator) -> Any | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return kube.coordination.read_namespaced_lease(op.lease, op.system)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def test_uninstall_is_refused_while_jobs_exist_and_clean_after(kube: Kube, namespace: str, tmp_path: Path) -> None:
    netns.require()
    annotations = json.dumps(PLAYED)
    watch = f"operator.watchNamespaces={{{namespace}}}"  # the check looks at this test's namespace only
    with installed(kube, tmp_path, "--set-json", f"podAnnotations={annotations}", "--set", watch) as op:
        kube.prebind_checkpoint_volume(namespace, "kept")
        kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(example("kept")))
        wait_phase(kube, namespace, "kept", "Running")
        lease = _lease(kube, op)
        assert lease is not None and lease.spec.holder_identity, "the operator leads on the chart's Lease"
        seen: set[str] = set()

        refused, printed = _uninstall(kube, op, tmp_path, seen)
        assert refused.returncode != 0, refused.stdout
        assert f"1 RLJob(s) still exist: {namespace}/kept" in printed and "Delete them first" in printed, printed
        assert kube.helm("status", op.release, "-n", op.system, check=False).returncode == 0
        assert op.proc is not None and op.proc.poll() is None, "the operator still runs"
        assert _lease(kube, op) is not None

        kube.kubectl("delete", "rlj", "kept", "-n", namespace, "--timeout", f"{Timeouts.DELETE:.0f}s")
        passed, printed = _uninstall(kube, op, tmp_path, seen)
        assert passed.returncode == 0, passed.stdout + passed.stderr
        assert "no RLJobs left" in printed, printed
        assert kube.helm("status", op.release, "-n", op.system, check=False).returncode != 0
        kube.wait_for(lambda: _lease(kube, op) is None, Timeouts.DELETE, "the leader's Lease gone with the release")
    kube.kubectl("delete", "pv", f"{namespace}-kept", "--wait=false", check=False)
