"""Shared support for weightsync's end-to-end tests on a real control plane.

The control plane (kube-apiserver + kine + kube-scheduler +
kube-controller-manager + KWOK, fake GPU nodes) is brought up by
``e2e/cluster.sh``; see ``e2e/README.md``.

Fixtures (reuse them in later e2e tests: operator, helm install, ...):

- ``e2e_cluster`` (session): reuses a cluster that ``e2e/cluster.sh status``
  reports up, else runs ``e2e/cluster.sh up`` and tears it down at the end of
  the session (unless ``WEIGHTSYNC_E2E_KEEP=1``).
- ``kube`` (session): :class:`Kube`, typed API clients plus ``kubectl`` /
  ``helm`` runners and polling helpers.
- ``namespace`` (function): a fresh namespace per test, deleted afterwards.
- ``timeouts``: :class:`Timeouts`, named timeouts in seconds.
- ``operator`` (module): the chart helm-installed and the operator running under its
  ServiceAccount (:mod:`tests.e2e.chart`).

On a failing e2e test the report gets a section with the namespace's pods,
events and the tail of every component's log, and the same text is written
under ``$WEIGHTSYNC_E2E_ARTIFACTS`` (default ``<cache>/e2e-artifacts``).

e2e tests run when selected with ``-m e2e`` (or ``WEIGHTSYNC_E2E=1``);
otherwise they are skipped, so a plain ``pytest`` never starts a cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "e2e" / "cluster.sh"
E2E_LABEL = "weightsync.io/e2e"

T = TypeVar("T")


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(f"WEIGHTSYNC_E2E_TIMEOUT_{name}")
    return float(value) if value else default


class Timeouts:
    """Named timeouts (seconds); each can be overridden with
    ``WEIGHTSYNC_E2E_TIMEOUT_<NAME>``, e.g. ``WEIGHTSYNC_E2E_TIMEOUT_POD_RUNNING=120``."""

    # `cluster.sh up` with binaries cached (a cold build is much longer; run
    # `e2e/cluster.sh tools` first, see BUILD).
    CLUSTER_UP = _env_seconds("CLUSTER_UP", 300)
    # `cluster.sh up` when binaries must be built first (cold: ~tens of minutes).
    BUILD = _env_seconds("BUILD", 3600)
    NAMESPACE_READY = _env_seconds("NAMESPACE_READY", 60)
    POD_SCHEDULED = _env_seconds("POD_SCHEDULED", 60)
    POD_RUNNING = _env_seconds("POD_RUNNING", 90)
    POD_UNSCHEDULABLE = _env_seconds("POD_UNSCHEDULABLE", 60)
    # how long a pod that must not be scheduled is watched to stay Pending
    STAYS_PENDING = _env_seconds("STAYS_PENDING", 5)
    DELETE = _env_seconds("DELETE", 120)
    KUBECTL = _env_seconds("KUBECTL", 120)
    HELM = _env_seconds("HELM", 300)


# --------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class ClusterInfo:
    kubeconfig: Path
    state_dir: Path
    kubectl: Path
    helm: Path
    started_here: bool

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    def env(self) -> dict[str, str]:
        """Environment for subprocesses that must talk to this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.kubectl.parent}{os.pathsep}{env.get('PATH', '')}"
        return env


def _cluster_sh(*args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    if not CLUSTER_SH.exists():
        raise RuntimeError(f"{CLUSTER_SH} is missing")
    return subprocess.run(
        ["bash", str(CLUSTER_SH), *args],
        text=True,
        capture_output=True,
        timeout=timeout,
        check=check,
    )


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def _parse_env(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        m = re.match(r"export (\w+)=(.*)$", line.strip())
        if m:
            env[m.group(1)] = m.group(2)
    return env


def _tools_built() -> bool:
    try:
        out = _cluster_sh("paths", timeout=30).stdout
    except (subprocess.SubprocessError, RuntimeError):
        return False
    paths = [line.split("=", 1)[1] for line in out.splitlines() if "=" in line]
    return bool(paths) and all(os.access(p, os.X_OK) for p in paths)


def _bring_up() -> ClusterInfo:
    status = _cluster_sh("status", timeout=60, check=False)
    started = False
    if status.returncode != 0:
        timeout = Timeouts.CLUSTER_UP if _tools_built() else Timeouts.BUILD
        try:
            up = _cluster_sh("up", timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"e2e/cluster.sh up did not finish within {timeout:.0f}s\n{_text(exc.stderr)}") from exc
        if up.returncode != 0:
            logs = _cluster_sh("logs", "40", timeout=60, check=False).stdout
            _cluster_sh("down", timeout=120, check=False)
            raise RuntimeError(f"e2e/cluster.sh up failed (exit {up.returncode}):\n{up.stderr}\n{logs}")
        sys.stderr.write(up.stderr)
        started = True
    env = _parse_env(_cluster_sh("env", timeout=30).stdout)
    return ClusterInfo(
        kubeconfig=Path(env["KUBECONFIG"]),
        state_dir=Path(env["WEIGHTSYNC_E2E_STATE"]),
        kubectl=Path(env["WEIGHTSYNC_KUBECTL"]),
        helm=Path(env["WEIGHTSYNC_HELM"]),
        started_here=started,
    )


@pytest.fixture(scope="session")
def e2e_cluster() -> Iterator[ClusterInfo]:
    info = _bring_up()
    yield info
    if info.started_here and os.environ.get("WEIGHTSYNC_E2E_KEEP") != "1":
        _cluster_sh("down", timeout=120, check=False)


# --------------------------------------------------------------------- clients


class WaitTimeout(AssertionError):
    pass


class Kube:
    """API clients for the e2e cluster plus small helpers."""

    def __init__(self, cluster: ClusterInfo) -> None:
        from kubernetes import client, config

        self.cluster = cluster
        self.api_client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.batch = client.BatchV1Api(self.api_client)
        self.rbac = client.RbacAuthorizationV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.apiext = client.ApiextensionsV1Api(self.api_client)
        self.coordination = client.CoordinationV1Api(self.api_client)

    # -- shared fixtures of the job tests
    def service_account_kubeconfig(self, namespace: str, account: str, path: Path, pod: str | None = None) -> Path:
        """A kubeconfig that authenticates as ``account`` with a token from the TokenRequest API; with ``pod``, a
        token bound to that pod (what the kubelet mounts in a pod of the ServiceAccount)."""
        import yaml
        from kubernetes import client

        bound = None
        if pod is not None:
            uid = self.core.read_namespaced_pod(pod, namespace).metadata.uid
            bound = client.V1BoundObjectReference(api_version="v1", kind="Pod", name=pod, uid=uid)
        spec = client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600, bound_object_ref=bound)
        request = client.AuthenticationV1TokenRequest(spec=spec)
        token = self.core.create_namespaced_service_account_token(account, namespace, request).status.token
        cluster = yaml.safe_load(self.cluster.kubeconfig.read_text())["clusters"][0]
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [cluster],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": cluster["name"], "user": account}}],
            "current-context": "sa",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def coordinator_kubeconfig(self, namespace: str, job: str, path: Path) -> Path:
        """What the job's coordinator authenticates with: its ServiceAccount's token bound to its pod (the chart's
        admission policy refuses a WeightVersion written with any other)."""

        def pod() -> str | None:
            selector = f"weightsync.io/job={job},app.kubernetes.io/component=coordinator"
            pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
            return next((p.metadata.name for p in pods if not p.metadata.deletion_timestamp), None)

        name = self.wait_for(pod, Timeouts.POD_SCHEDULED, f"the coordinator pod of {job}")
        return self.service_account_kubeconfig(namespace, f"{job}-coordinator", path, pod=name)

    def prebind_checkpoint_volume(self, namespace: str, job: str) -> None:
        """A static volume pre-bound to the job's checkpoint claim (no provisioner runs here)."""
        import json

        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{namespace}-{job}"},
            "spec": {
                "capacity": {"storage": "200Gi"},
                "accessModes": ["ReadWriteMany"],
                "hostPath": {"path": f"/tmp/{namespace}-{job}"},
                "claimRef": {"namespace": namespace, "name": f"{job}-checkpoints"},
            },
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(pv))

    # -- subprocess tools
    def kubectl(
        self,
        *args: str,
        check: bool = True,
        timeout: float = Timeouts.KUBECTL,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.cluster.kubectl), *args], check, timeout, input)

    def helm(
        self,
        *args: str,
        check: bool = True,
        timeout: float = Timeouts.HELM,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return self._run([str(self.cluster.helm), *args], check, timeout, input)

    def _run(self, cmd: list[str], check: bool, timeout: float, input: str | None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            cmd,
            check=False,
            text=True,
            capture_output=True,
            timeout=timeout,
            env=self.cluster.env(),
            input=input,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    # -- waiting
    @staticmethod
    def wait_for(fn: Callable[[], T], timeout: float, what: str, interval: float = 0.25) -> T:
        """Poll ``fn`` until it returns something truthy; return that value.

        Exceptions from ``fn`` count as "not yet" and are reported on timeout."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            try:
                value = fn()
                if value:
                    return value
                last = value
            except Exception as exc:  # noqa: BLE001 - reported on timeout
                last = exc
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
            time.sleep(interval)

    def pod_condition(self, pod: Any, ctype: str) -> Any | None:
        for cond in (pod.status.conditions or []) if pod.status else []:
            if cond.type == ctype:
                return cond
        return None

    def wait_pod_phase(self, namespace: str, name: str, phase: str, timeout: float) -> Any:
        def check() -> Any:
            pod = self.core.read_namespaced_pod(name, namespace)
            return pod if pod.status and pod.status.phase == phase else None

        return self.wait_for(check, timeout, f"pod {namespace}/{name} phase {phase}")

    def wait_pod_condition(
        self,
        namespace: str,
        name: str,
        ctype: str,
        status: str,
        timeout: float,
        reason: str | None = None,
    ) -> Any:
        def check() -> Any:
            pod = self.core.read_namespaced_pod(name, namespace)
            cond = self.pod_condition(pod, ctype)
            if cond and cond.status == status and (reason is None or cond.reason == reason):
                return pod
            return None

        return self.wait_for(
            check,
            timeout,
            f"pod {namespace}/{name} condition {ctype}={status} reason={reason}",
        )

    # -- diagnostics
    def dump(self, namespace: str | None) -> str:
        """Text for a failure report: cluster and namespace state, component logs."""
        parts: list[str] = []

        def section(title: str, *args: str) -> None:
            proc = self.kubectl(*args, check=False, timeout=30)
            parts.append(f"===== {title}\n{proc.stdout}{proc.stderr}")

        section("nodes", "get", "nodes", "-o", "wide", "--show-labels")
        if namespace:
            section(f"pods in {namespace}", "get", "pods", "-n", namespace, "-o", "wide")
            section(f"describe pods in {namespace}", "describe", "pods", "-n", namespace)
            section(
                f"events in {namespace}",
                "get",
                "events",
                "-n",
                namespace,
                "--sort-by=.lastTimestamp",
            )
            self._dump_container_logs(namespace, parts)
        section(
            "events (all namespaces, warnings)",
            "get",
            "events",
            "-A",
            "--field-selector=type=Warning",
        )
        logs = self.cluster.logs_dir
        for name in (
            "kube-apiserver",
            "kwok",
            "kube-scheduler",
            "kube-controller-manager",
            "kine",
        ):
            path = logs / f"{name}.log"
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-60:]
                parts.append(f"===== {path} (last {len(lines)} lines)\n" + "\n".join(lines))
        return "\n".join(parts)

    def _dump_container_logs(self, namespace: str, parts: list[str]) -> None:
        """The logs of every container of the pods a real kubelet runs (e2e/node.sh), the previous run's too
        where one restarted: the node's pod logs go with ``node.sh down``, and a container that died (vLLM's
        engine) is otherwise seen only as a restart count. KWOK's pods have no kubelet to ask."""
        kwok = {n.metadata.name for n in self.core.list_node(label_selector="type=kwok").items}
        for pod in self.core.list_namespaced_pod(namespace).items:
            if not pod.spec.node_name or pod.spec.node_name in kwok:
                continue
            for status in pod.status.container_statuses or []:
                runs = ["--previous"] if status.restart_count else []
                for run in [*runs, None]:
                    args = ["logs", pod.metadata.name, "-c", status.name, "-n", namespace, "--tail", "150"]
                    proc = self.kubectl(*args, *([run] if run else []), check=False, timeout=30)
                    which = "previous run" if run else "current run"
                    parts.append(f"===== logs {pod.metadata.name}/{status.name} ({which})\n{proc.stdout}{proc.stderr}")


@pytest.fixture(scope="session")
def kube(e2e_cluster: ClusterInfo) -> Kube:
    return Kube(e2e_cluster)


@pytest.fixture(scope="session")
def timeouts() -> type[Timeouts]:
    return Timeouts


@pytest.fixture(scope="module")
def operator(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.e2e.chart import installed

    with installed(kube, tmp_path_factory.mktemp("operator")) as op:
        yield op


def _slug(text: str, limit: int = 40) -> str:
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return s[:limit].strip("-") or "test"


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount) for one test."""
    from kubernetes import client

    name = f"e2e-{_slug(request.node.name)}-{uuid.uuid4().hex[:5]}"
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={E2E_LABEL: "true"})))
    # Pods are refused until the controller-manager made the default SA.
    kube.wait_for(
        lambda: kube.core.read_namespaced_service_account("default", name),
        Timeouts.NAMESPACE_READY,
        f"default ServiceAccount in {name}",
    )
    request.node._e2e_namespace = name
    yield name
    if os.environ.get("WEIGHTSYNC_E2E_KEEP_NAMESPACES") != "1":
        try:
            kube.core.delete_namespace(name, propagation_policy="Background")
        except Exception as exc:  # noqa: BLE001 - cleanup is best effort
            sys.stderr.write(f"deleting namespace {name} failed: {exc}\n")


# --------------------------------------------------------------------- hooks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "e2e: needs the real control plane from e2e/cluster.sh (select with -m e2e)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = "e2e" in (config.getoption("markexpr", "") or "") or os.environ.get("WEIGHTSYNC_E2E") == "1"
    if selected:
        return
    skip = pytest.mark.skip(reason="e2e test: run with `-m e2e` (brings up e2e/cluster.sh)")
    for item in items:
        if item.get_closest_marker("e2e"):
            item.add_marker(skip)


def _artifacts_dir() -> Path:
    base = os.environ.get("WEIGHTSYNC_E2E_ARTIFACTS")
    if base:
        return Path(base)
    cache = os.environ.get("WEIGHTSYNC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "weightsync"
    )
    return Path(cache) / "e2e-artifacts"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    _attach_dump(item, rep)
    return rep


def _attach_dump(item: pytest.Item, rep: pytest.TestReport) -> None:
    if not rep.failed or rep.when not in ("setup", "call"):
        return
    funcargs = getattr(item, "funcargs", {})
    kube_obj = funcargs.get("kube")
    cluster = funcargs.get("e2e_cluster")
    if not isinstance(kube_obj, Kube):
        if not isinstance(cluster, ClusterInfo):
            return
        kube_obj = Kube(cluster)
    try:
        text = kube_obj.dump(getattr(item, "_e2e_namespace", None))
    except Exception as exc:  # noqa: BLE001 - never mask the test's own failure
        text = f"(dump failed: {exc!r})"
    rep.sections.append(("e2e cluster dump", text))
    try:
        out = _artifacts_dir()
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{_slug(item.nodeid, 120)}-{int(time.time())}.txt"
        path.write_text(text)
        rep.sections.append(("e2e cluster dump file", str(path)))
    except OSError:
        pass
