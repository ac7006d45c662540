"""Real syncs on the real control plane: the coordinator writes WeightVersions, the operator reflects them.

KWOK runs no containers, so after the operator has made the RLJob's children,
this test runs what those pods would run as local processes, each from its
*Pod object* (command and environment as the operator wrote them, the token read
from the job's Secret, ``job.json`` from its ConfigMap): the coordinator (with
``--kubernetes-namespace``, authenticated as the job's coordinator
ServiceAccount through a TokenRequest token), one vLLM CPU replica with its
agent, and a trainer rank whose command (in the RLJob, like a user's) publishes
three versions with ``FleetPublisher``. Only what a laptop cannot have is
rewritten: ports (free loopback ports instead of the pod ports), the
coordinator's address (loopback instead of the Service name), and the paths of
mounted files: the checkpoint volume (a temporary folder) and the job's TLS
Secret (its files written to a temporary folder, the paths in ``--tls-cert``,
``--tls-key``, ``--tls-ca`` and ``$WEIGHTSYNC_TLS_CA`` pointed there). Every
connection to the coordinator is TLS, verified against the job's CA; the
certificate names ``127.0.0.1`` besides the Service's DNS names, so the loopback
address verifies.

Then: every version was a WeightVersion that reached Ready and durable, written
a few times each (not once per ack); the RLJob's status and ``kubectl get rljobs``
show the newest one; retention (2) pruned the oldest; and a restarted coordinator
recovers the newest READY version from the API server alone.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import Kube, Timeouts
from weightsync.cli._localfleet import Proc, free_port, spawn

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
JOB = "sync-e2e"
VERSIONS = 3
RETENTION = 2
GROUP, API = "weightsync.io", "v1alpha1"
RUN_OPERATOR = (
    "import argparse, sys; from weightsync.cli import operator as o; p = argparse.ArgumentParser(); "
    "o.add_arguments(p); sys.exit(o.run(p.parse_args(sys.argv[1:])))"
)
# The trainer rank's command, as a user would put it in the RLJob: everything it needs comes from the pod's env.
TRAINER = """
import json, os, sys
from pathlib import Path
import torch, transformers
from weightsync.coordinator import models
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.tls import TlsConfig
from weightsync.vocabulary import Channel
from weightsync_trainer.fleet import FleetPublisher
from weightsync_trainer.sources import ModuleSource

cfg = json.loads(Path(os.environ["WEIGHTSYNC_CONFIG"]).read_text())
volume = Path(os.environ["WEIGHTSYNC_CHECKPOINT_DIR"])
model = transformers.AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
client = CoordinatorClient(os.environ["WEIGHTSYNC_COORDINATOR"], token=os.environ["WEIGHTSYNC_TOKEN"],
                           tls=TlsConfig(ca_file=os.environ["WEIGHTSYNC_TLS_CA"]))
publisher = FleetPublisher(ModuleSource(model), client, volume=volume, keep=cfg["sync"]["retention"])
policy = models.JobPolicy(tuple(Channel.parse(c) for c in cfg["sync"]["channels"]),
                          version_timeout_s=cfg["sync"]["timeoutSeconds"])
caps = models.Capabilities(host="localhost", channels=(Channel.CPU, Channel.VOLUME), volume_id="shared",
                           volume_mount=str(volume))
client.register_trainer(cfg["job"], os.environ["POD_NAME"], caps, policy=policy, offers=publisher.offers)
for i in range(int(os.environ["VERSIONS"])):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    report = publisher.publish((i + 1) * cfg["sync"]["everySteps"])
    publisher.wait_durable()
    print(json.dumps({"version": report.version, "state": report.state.value, "seconds": report.seconds,
                      "durable_errors": publisher.durable_errors}), flush=True)
publisher.close()
client.close()
"""


# --------------------------------------------------------------------- the operator and the job


@pytest.fixture(scope="module")
def operator(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """helm install the chart; run the operator locally under the chart's ServiceAccount. Yields the release."""
    release = f"wsync-{uuid.uuid4().hex[:5]}"
    system = f"{release}-system"
    kube.helm("install", release, str(REPO / "helm" / "weightsync"), "-n", system, "--create-namespace", "--wait=false")
    kube.wait_for(lambda: kube.core.read_namespaced_service_account(f"{release}-weightsync", system),
                  Timeouts.NAMESPACE_READY, "the chart's ServiceAccount")  # fmt: skip
    tmp = tmp_path_factory.mktemp("operator")
    kubeconfig = kube.service_account_kubeconfig(system, f"{release}-weightsync", tmp / "kubeconfig")
    args = ["--resync-seconds", "1", "--coordinator-role", f"{release}-weightsync-coordinator"]
    args += ["--metrics-port", "0", "--liveness-port", str(free_port())]
    env = {"KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(REPO)}
    proc = spawn("operator", [sys.executable, "-c", RUN_OPERATOR, *args], tmp, env)
    try:
        yield release
    finally:
        proc.stop()
        print((tmp / "operator.log").read_text()[-3000:])
        kube.helm("uninstall", release, "-n", system, check=False)
        kube.core.delete_namespace(system)


def _cpu_job(model: Path) -> dict[str, Any]:
    """examples/rljob.yaml on the CPU: one trainer rank, one vLLM CPU replica, the cpu channel, retention 2."""
    body: dict[str, Any] = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    body["metadata"]["name"] = JOB
    spec = body["spec"]
    small = {"cpu": "1", "memory": "2Gi"}
    spec["trainer"].update(
        command=["python", "-c", TRAINER], worldSize=1, gpusPerWorker=0, resources=small,
        env=[{"name": "VERSIONS", "value": str(VERSIONS)}],
    )  # fmt: skip
    spec["inference"].update(
        model=str(model), replicas=1, gpusPerReplica=0, resources=small,
        vllmArgs=["--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.05",
                  "--max-model-len", "256", "--seed", "0"],
    )  # fmt: skip
    spec["sync"].update(everySteps=1, channels=["cpu", "volume"], timeoutSeconds=120, retention=RETENTION)
    spec["placement"] = {"mode": "Spread"}
    return body


def _rljob(kube: Kube, namespace: str) -> dict[str, Any]:
    obj: dict[str, Any] = kube.custom.get_namespaced_custom_object(GROUP, API, namespace, "rljobs", JOB)
    return obj


def _pod(kube: Kube, namespace: str, component: str) -> Any:
    pods = kube.core.list_namespaced_pod(
        namespace, label_selector=f"weightsync.io/job={JOB},app.kubernetes.io/component={component}"
    ).items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


# --------------------------------------------------------------------- pods as local processes


class Pods:
    """Turns the containers of the job's Pod objects into local processes."""

    def __init__(self, kube: Kube, namespace: str, work: Path) -> None:
        self.kube, self.namespace, self.work = kube, namespace, work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.volume = work / "checkpoints"
        self.volume.mkdir()
        self.config = work / "etc" / "job.json"
        self.config.parent.mkdir()
        cm = kube.core.read_namespaced_config_map(f"{JOB}-config", namespace)
        self.config.write_text(cm.data["job.json"])
        self.tls = work / "etc" / "tls"  # the TLS Secret's files, as the pods mount them
        self.tls.mkdir()
        secret = kube.core.read_namespaced_secret(f"{JOB}-tls", namespace)
        assert secret.type == "kubernetes.io/tls", secret.type
        for key in ("tls.crt", "tls.key", "ca.crt"):
            (self.tls / key).write_bytes(base64.b64decode(secret.data[key]))
        self.coordinator_port = free_port()
        self.procs: list[Proc] = []

    @property
    def coordinator(self) -> str:
        return f"127.0.0.1:{self.coordinator_port}"

    def env(self, pod: Any, container: Any) -> dict[str, str]:
        """The container's environment as the kubelet would resolve it, with local addresses and paths."""
        out: dict[str, str] = {}
        for e in container.env or []:
            if e.value_from is None:
                out[e.name] = e.value or ""
            elif e.value_from.secret_key_ref is not None:
                ref = e.value_from.secret_key_ref
                secret = self.kube.core.read_namespaced_secret(ref.name, self.namespace)
                out[e.name] = base64.b64decode(secret.data[ref.key]).decode()
            elif e.value_from.field_ref is not None:
                path = e.value_from.field_ref.field_path
                out[e.name] = {"metadata.name": pod.metadata.name, "spec.nodeName": pod.spec.node_name}[path]
        local = {
            "WEIGHTSYNC_COORDINATOR": self.coordinator,
            "WEIGHTSYNC_CONFIG": str(self.config),
            "WEIGHTSYNC_CHECKPOINT_DIR": str(self.volume),
            "WEIGHTSYNC_TLS_CA": str(self.tls / "ca.crt"),
        }
        out.update({k: v for k, v in local.items() if k in out})
        out.pop("HOME", None)  # the pod's HOME=/tmp: keep this machine's caches
        return out

    @staticmethod
    def command(container: Any, swaps: dict[str, str], extra: tuple[str, ...] = ()) -> list[str]:
        """The container's command with ``swaps`` (flag -> new value; each flag must be there) and ``extra``."""
        cmd = list(container.command)
        head = {"weightsync": [sys.executable, "-m", "weightsync.cli.main"], "python": [sys.executable]}
        cmd = head.get(cmd[0], cmd[:1]) + cmd[1:]
        for flag, value in swaps.items():
            assert flag in cmd, f"{container.name}: the operator's command lost {flag}: {container.command}"
            cmd[cmd.index(flag) + 1] = value
        return cmd + list(extra)

    def start(self, name: str, pod: Any, container: str, swaps: dict[str, str], extra: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> Proc:  # fmt: skip
        c = next(c for c in pod.spec.containers if c.name == container)
        proc = spawn(name, self.command(c, swaps, extra), self.logs, {**self.env(pod, c), **(env or {})})
        self.procs.append(proc)
        return proc

    def start_coordinator(self, kubeconfig: Path) -> Proc:
        pod = _pod(self.kube, self.namespace, "coordinator")
        swaps = {"--host": "127.0.0.1", "--port": str(self.coordinator_port), "--metrics-port": str(free_port()),
                 "--metrics-host": "127.0.0.1", "--kubernetes-namespace": self.namespace,
                 "--tls-cert": str(self.tls / "tls.crt"), "--tls-key": str(self.tls / "tls.key")}  # fmt: skip
        return self.start("coordinator", pod, "coordinator", swaps, ("-v",), {"KUBECONFIG": str(kubeconfig)})

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs = []


class VersionWatch:
    """Every event of the namespace's WeightVersions (a watch, so no short-lived state is missed)."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        from kubernetes import watch

        self.events: list[tuple[str, dict[str, Any]]] = []
        self.error: Exception | None = None
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(kube, namespace), daemon=True)
        self._thread.start()

    def _run(self, kube: Kube, namespace: str) -> None:
        stream = self._watch.stream(
            kube.custom.list_namespaced_custom_object, GROUP, API, namespace, "weightversions", timeout_seconds=600
        )
        try:
            for event in stream:
                self.events.append((event["type"], event["object"]))
        except Exception as e:  # noqa: BLE001 - the stream ends when the test stops it or the namespace goes
            self.error = e

    def seen(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        return [(t, o) for t, o in self.events if o["metadata"]["name"] == name]

    def stop(self) -> None:
        self._watch.stop()


def _wait_replica_registered(pods: Pods, replica: str, timeout: float) -> None:
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.coordinator.tls import TlsConfig

    secret = pods.kube.core.read_namespaced_secret(f"{JOB}-token", pods.namespace)
    token = base64.b64decode(secret.data["token"]).decode()
    tls = TlsConfig(ca_file=str(pods.tls / "ca.crt"))
    with CoordinatorClient(pods.coordinator, token=token, tls=tls, timeout_s=5.0) as c:

        def registered() -> bool:
            return any(m.member_id == replica for m in c.get_job(JOB).members)

        def alive() -> bool:
            dead = [p.name for p in pods.procs if p.popen.poll() is not None]
            assert not dead, f"{dead} exited:\n" + "\n".join(pods.log(n)[-3000:] for n in dead)
            return registered()

        Kube.wait_for(alive, timeout, f"replica {replica} registered with the coordinator", interval=1.0)


# --------------------------------------------------------------------- the test


def test_real_syncs_write_weightversions(kube: Kube, namespace: str, operator: str, tmp_path: Path) -> None:
    from weightsync_trainer import tiny_models

    t0 = time.monotonic()
    model = tiny_models.generate("tiny-qwen2")
    kube.prebind_checkpoint_volume(namespace, JOB)
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_cpu_job(model)))
    kube.wait_for(lambda: _rljob(kube, namespace).get("status", {}).get("phase") == "Running",
                  Timeouts.POD_RUNNING, "RLJob Running")  # fmt: skip
    kube.wait_for(lambda: kube.rbac.read_namespaced_role_binding(f"{JOB}-coordinator", namespace),
                  Timeouts.POD_RUNNING, "the coordinator's RoleBinding")  # fmt: skip
    coordinator_kubeconfig = kube.service_account_kubeconfig(
        namespace, f"{JOB}-coordinator", tmp_path / "coordinator-kubeconfig"
    )

    pods = Pods(kube, namespace, tmp_path)
    watch = VersionWatch(kube, namespace)
    try:
        pods.start_coordinator(coordinator_kubeconfig)
        replica = _pod(kube, namespace, "inference")
        vllm_port = free_port()
        pods.start("vllm", replica, "vllm", {"--port": str(vllm_port)})
        vllm_url = f"http://127.0.0.1:{vllm_port}"
        agent_swaps = {"--vllm-url": vllm_url, "--metrics-port": str(free_port()), "--metrics-host": "127.0.0.1",
                       "--checkpoint-dir": str(pods.volume), "--tls-ca": str(pods.tls / "ca.crt")}  # fmt: skip
        pods.start("agent", replica, "agent", agent_swaps)
        _wait_replica_registered(pods, replica.metadata.name, timeout=600)
        assert "(TLS)" in pods.log("coordinator"), pods.log("coordinator")[-2000:]
        t_fleet = time.monotonic()

        trainer = pods.start("trainer", _pod(kube, namespace, "trainer"), "trainer", {})
        trainer.popen.wait(timeout=300)
        out = pods.log("trainer")
        assert trainer.popen.returncode == 0, out[-4000:]
        reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [(r["version"], r["state"]) for r in reports] == [(v, "READY") for v in range(1, VERSIONS + 1)], out
        assert all(not r["durable_errors"] for r in reports), reports
        t_synced = time.monotonic()

        # the coordinator wrote every version: Ready and durable at some point, a few writes each
        names = [f"{JOB}-v{v}" for v in range(1, VERSIONS + 1)]

        def durable_ready(name: str) -> bool:
            return any(
                o.get("status", {}).get("phase") == "Ready" and o["status"].get("durable") for _, o in watch.seen(name)
            )

        kube.wait_for(lambda: all(durable_ready(n) for n in names), 30, "every version seen Ready and durable")
        for name in names:
            events = watch.seen(name)
            assert events[0][0] == "ADDED", events
            spec = events[0][1]["spec"]
            assert spec["job"] == JOB and spec["channelPlan"] == [{"channel": "cpu", "replicas": 1}], spec
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", spec["manifestChecksum"]), spec
            owners = events[0][1]["metadata"]["ownerReferences"]
            assert owners[0]["kind"] == "RLJob" and owners[0]["name"] == JOB, owners
            modified = sum(t == "MODIFIED" for t, _ in events)
            assert modified <= 4, f"{name}: {modified} writes (expected a few per version, not one per ack)"
        newest = kube.custom.get_namespaced_custom_object(GROUP, API, namespace, "weightversions", names[-1])
        status = newest["status"]
        assert status["phase"] == "Ready" and status["durable"] is True, status
        assert status["replicasLoaded"] == 1 and status["replicasFailed"] == 0, status
        assert status["laggingReplicas"] == [] and status["phaseSeconds"]["total"] > 0, status

        # the operator reflects the newest version in the RLJob's status and printer columns ...
        kube.wait_for(lambda: _rljob(kube, namespace)["status"].get("currentVersion") == VERSIONS,
                      Timeouts.POD_RUNNING, f"currentVersion {VERSIONS}")  # fmt: skip
        job_status = _rljob(kube, namespace)["status"]
        assert job_status["replicasLoaded"] == 1 and job_status["lastSyncSeconds"] > 0, job_status
        table = kube.kubectl("get", "rljobs", JOB, "-n", namespace).stdout
        header, row = table.splitlines()[:2]
        columns = dict(zip(header.split(), row.split(), strict=False))
        assert columns["PHASE"] == "Running" and columns["READY"] == "1/1" and columns["VERSION"] == str(VERSIONS), (
            table
        )
        listed = kube.kubectl("get", "weightversions", "-n", namespace).stdout
        assert f"{JOB}-v{VERSIONS}" in listed, listed

        # ... and prunes what is beyond the retention (2): the oldest version goes
        def kept() -> list[str]:
            items = kube.custom.list_namespaced_custom_object(GROUP, API, namespace, "weightversions")["items"]
            return sorted(i["metadata"]["name"] for i in items)

        kube.wait_for(lambda: kept() == names[-RETENTION:], Timeouts.DELETE, f"retention keeps {names[-RETENTION:]}")

        # a coordinator restarted in a fresh pod (no local state) recovers READY from the API server
        pods.procs[0].stop()
        coordinator = pods.start_coordinator(coordinator_kubeconfig)
        kube.wait_for(lambda: f"recovered job {JOB}: newest READY version {VERSIONS}" in pods.log("coordinator"),
                      60, "the restarted coordinator's recovery")  # fmt: skip
        assert coordinator.popen.poll() is None
        print(
            f"\ntimings: fleet up {t_fleet - t0:.0f}s, {VERSIONS} syncs {t_synced - t_fleet:.1f}s, "
            f"total {time.monotonic() - t0:.0f}s; sync seconds {[round(r['seconds']['total'], 2) for r in reports]}"
        )
    finally:
        watch.stop()
        pods.stop()
        if os.environ.get("WEIGHTSYNC_E2E_PRINT_LOGS") == "1":
            for name in ("coordinator", "agent", "trainer"):
                print(f"===== {name}\n{pods.log(name)[-3000:]}")
        kube.kubectl("delete", "pv", f"{namespace}-{JOB}", "--wait=false", check=False)
