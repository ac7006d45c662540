"""The chart installed with helm and the operator run under its ServiceAccount, shared by the operator e2e tests.

KWOK runs no containers, so the operator runs here as a local process with the *chart's*
ServiceAccount token: the RBAC the chart grants is exactly what it gets. It gets no short
resync, so every reaction a test waits for comes from an event.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.conftest import Kube, Timeouts
from weightsync.cli._localfleet import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob.yaml"
EXAMPLE_JOB: str = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
GROUP, API = "weightsync.io", "v1alpha1"
RUN_OPERATOR = (
    "import argparse, sys; from weightsync.cli import operator as o; p = argparse.ArgumentParser(); "
    "o.add_arguments(p); sys.exit(o.run(p.parse_args(sys.argv[1:])))"
)


class Operator:
    """The operator as a local process under the chart's ServiceAccount; stop and start it at will. It runs with
    the chart's leader election (its Lease in the release namespace), so several may run side by side."""

    def __init__(self, release: str, system: str, kubeconfig: Path, log: Path) -> None:
        self.release, self.system, self.kubeconfig, self.log = release, system, kubeconfig, log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def lease(self) -> str:
        return f"{self.release}-weightsync-leader"

    def start(self, *extra: str) -> None:
        env = {"KUBECONFIG": str(self.kubeconfig), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
        args = ["--coordinator-role", f"{self.release}-weightsync-coordinator"]
        args += ["--metrics-port", "0", "--liveness-port", str(free_port())]
        args += [f"--leader-elect-namespace={self.system}", f"--leader-elect-name={self.lease}", *extra]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", RUN_OPERATOR, *args], env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@contextmanager
def installed(kube: Kube, tmp: Path, *values: str, operator_args: tuple[str, ...] = ()) -> Iterator[Operator]:
    """helm install the chart into its own namespace (``values``: more helm arguments, e.g. ``--set``) and run the
    operator (with ``operator_args`` added); uninstall afterwards."""
    release = f"ws-{uuid.uuid4().hex[:5]}"
    system = f"{release}-system"
    chart = str(REPO / "helm" / "weightsync")
    kube.helm("install", release, chart, "-n", system, "--create-namespace", "--wait=false", *values)
    kube.wait_for(
        lambda: kube.core.read_namespaced_service_account(f"{release}-weightsync", system),
        Timeouts.NAMESPACE_READY,
        "the chart's ServiceAccount",
    )
    kubeconfig = kube.service_account_kubeconfig(system, f"{release}-weightsync", tmp / "kubeconfig")
    op = Operator(release, system, kubeconfig, tmp / "operator.log")
    op.start(*operator_args)
    try:
        yield op
    finally:
        op.stop()
        print(op.log.read_text()[-4000:])
        kube.helm("uninstall", release, "-n", system, check=False)
        kube.core.delete_namespace(system)


def children(kube: Kube, namespace: str, job: str) -> dict[str, list[str]]:
    """The names of a job's children (and pods) by kind."""
    out = kube.kubectl(
        "get", "deploy,sts,svc,netpol,pvc,cm,secret,sa,rolebinding,pods", "-n", namespace,
        "-l", f"weightsync.io/job={job}", "-o", "json",
    ).stdout  # fmt: skip
    kinds: dict[str, list[str]] = {}
    for item in json.loads(out)["items"]:
        kinds.setdefault(item["kind"], []).append(item["metadata"]["name"])
    return {k: sorted(v) for k, v in kinds.items()}


def request_counts(kube: Kube) -> Counter[str]:
    """What the API server answered so far: ``apiserver_request_total`` by verb and resource (``"PATCH
    rljobs/status"``), and API Priority and Fairness's dispatched requests by flow schema (``"flow
    service-accounts"``)."""
    counts: Counter[str] = Counter()
    for line in kube.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        if line.startswith(("apiserver_request_total{", "apiserver_flowcontrol_dispatched_requests_total{")):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if "flow_schema" in labels:
                key = f"flow {labels['flow_schema']}"
            else:
                sub = "/" + labels["subresource"] if labels.get("subresource") else ""
                key = f"{labels.get('verb', '')} {labels.get('resource', '')}{sub}"
            counts[key] += float(line.rsplit(" ", 1)[1])
    return counts


@contextmanager
def operator_requests(
    kube: Kube, operator: Operator, verbs: list[str], resources: list[str]
) -> Iterator[Callable[[], float]]:
    """Count the operator's requests of ``verbs`` on ``resources`` from now on, exactly: a FlowSchema files them
    (by its ServiceAccount) under a flow schema of their own, whose dispatched requests the API server counts."""
    name = f"{operator.release}-counted-{uuid.uuid4().hex[:5]}"
    schema = {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": name},
        "spec": {
            "matchingPrecedence": 1000,  # before the built-in "service-accounts" (9000)
            "priorityLevelConfiguration": {"name": "workload-low"},
            "rules": [
                {
                    "subjects": [
                        {
                            "kind": "ServiceAccount",
                            "serviceAccount": {"name": f"{operator.release}-weightsync", "namespace": operator.system},
                        }
                    ],
                    "resourceRules": [
                        {"verbs": verbs, "apiGroups": ["*"], "resources": resources, "namespaces": ["*"]}
                    ],
                }
            ],
        },
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(schema))
    kube.wait_for(  # the API server's flow control has taken it once it set its status
        lambda: kube.kubectl("get", "flowschema", name, "-o", "jsonpath={.status.conditions}").stdout,
        Timeouts.NAMESPACE_READY,
        f"FlowSchema {name} in effect",
    )
    key = f"flow {name}"
    start = request_counts(kube)[key]
    try:
        yield lambda: request_counts(kube)[key] - start
    finally:
        kube.kubectl("delete", "flowschema", name, "--wait=false", check=False)


def example(name: str) -> dict[str, Any]:
    """examples/rljob.yaml under another name."""
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["name"] = name
    return body


def rljob(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = kube.custom.get_namespaced_custom_object(GROUP, API, namespace, "rljobs", name)
    return obj


def wait_phase(
    kube: Kube, namespace: str, name: str, phase: str, timeout: float = Timeouts.POD_RUNNING
) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        job = rljob(kube, namespace, name)
        return job if job.get("status", {}).get("phase") == phase else None

    found: dict[str, Any] = kube.wait_for(check, timeout, f"RLJob {namespace}/{name} phase {phase}")
    return found
