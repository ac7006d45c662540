"""Weights reach every replica across hosts: examples/rljob.yaml on the real control plane, each pod on its own host.

What runs where:

- the control plane (kube-apiserver on 127.0.0.1, kine, scheduler, controller-manager, KWOK nodes;
  ``e2e/cluster.sh``) and the operator (the chart helm-installed, the operator process run here under
  the chart's ServiceAccount) run on the test's host network;
- the RLJob is examples/rljob.yaml on the CPU: 2 vLLM CPU replicas, 1 trainer rank, channels
  ``[cpu, volume]``, retention 2. The operator makes its children; the scheduler binds the pods to
  KWOK's nodes, which run no containers;
- so each of the job's pods -- the coordinator Deployment's pod, the two StatefulSet replicas and the
  trainer rank -- is played by its own network namespace (``tests.netns``, named after the pod), and
  its containers run there as processes started from the *Pod object* by ``tests/e2e/pods.py``
  (a stand-in kubelet): command, args and env as the operator wrote them (secrets from the API server,
  the downward API resolved: ``POD_IP`` is the namespace's address, ``NODE_NAME`` the node the
  scheduler chose). A replica's three containers (vLLM on its 127.0.0.1, the agent, the OpenAI proxy)
  share the replica's namespace, as a pod's containers share its network;
- names resolve as cluster DNS would: the coordinator Service ``<job>-coordinator.<ns>.svc``, the
  trainer's headless name in ``MASTER_ADDR`` (the trainer's gloo group rendezvouses through it), the
  replicas' headless names, each to the namespace playing that pod; ``kubernetes.default.svc`` to the
  bridge address, where a forwarder in the test process carries the coordinator's KubeStore traffic
  to the apiserver's loopback port (TLS end to end: the apiserver's certificate names
  kubernetes.default.svc). The coordinator authenticates as its ServiceAccount with the token of its
  pod's ServiceAccount volume (a TokenRequest token bound to the pod).
  Every pod keeps its own ports; TLS to the coordinator is verified against the job's CA by the
  Service name;
- only what a laptop cannot have is rewritten: the container image (the first word ``weightsync`` /
  ``python`` runs this repository's packages with this interpreter) and mounted paths: every volume
  becomes a folder per pod (job.json and the TLS files from the ConfigMap and Secret as the projected
  volume lists them -- only the coordinator gets the key --, emptyDirs, and the checkpoint claim as a
  per-pod symlink to its PersistentVolume's hostPath, so no process can assume another's path).

The trainer's command (in the RLJob, as a user writes it) follows the README: ``Publisher.from_env``
on a model it trains with AdamW, ``publish(step)`` every ``everySteps``; it saves its final weights
under its pod's /tmp. The test process reaches each replica's proxy at the replica's address and the
proxy's containerPort, through the bridge.

Checked: greedy generations through both proxies change after the syncs to what transformers gives
for the trainer's final weights; every version became a WeightVersion that reached Ready and durable
with both replicas loaded on the cpu channel (``status.replicas`` / ``replicaStates``, and the
REPLICAS column of ``kubectl get wv``), written a few times each (not once per ack); the RLJob's status
and ``kubectl get rljobs`` show the newest one; retention (2) pruned the oldest WeightVersion and
volume copy; and a coordinator restarted with no local state recovers the newest READY version from
the API server.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch
import yaml

from tests import netns, support
from tests.e2e.chart import Operator
from tests.e2e.conftest import Kube, Timeouts
from tests.e2e.pods import Kubelet, TcpForwarder

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
JOB = "sync-e2e"
REPLICAS = 2
VERSIONS = 3
RETENTION = 2
GROUP, API = "weightsync.io", "v1alpha1"
FINAL_WEIGHTS = "/tmp/final-weights"  # in the trainer pod's /tmp (an emptyDir)
# The trainer rank's command, as a user would put it in the RLJob (README, "Using it from a trainer"): everything
# it needs comes from the pod's env the operator wrote.
TRAINER = """
import json, os
from pathlib import Path
import torch, torch.distributed as dist, transformers
from weightsync_trainer import reference
from weightsync_trainer.publisher import Publisher
from weightsync_trainer.sources import ModuleSource

dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR (rank 0's Service name), MASTER_PORT
cfg = json.loads(Path(os.environ["WEIGHTSYNC_CONFIG"]).read_text())
model = transformers.AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
publisher = Publisher.from_env(ModuleSource(model))
for step in range(1, int(os.environ["STEPS"]) + 1):
    loss = reference.train_step(model, optimizer, model.config.vocab_size, seed=step)
    if step % publisher.every_steps == 0:
        report = publisher.publish(step)
        print(json.dumps({"step": step, "loss": loss, "version": report.version, "state": report.state.value,
                          "channels": report.channels, "failed": report.failed, "seconds": report.seconds}),
              flush=True)
model.save_pretrained(os.environ["FINAL_WEIGHTS"])
publisher.close()
print(json.dumps({"durable_errors": publisher.durable_errors}), flush=True)
dist.destroy_process_group()
"""


# --------------------------------------------------------------------- the operator and the job


def _cpu_job(model: Path) -> dict[str, Any]:
    """examples/rljob.yaml on the CPU: 2 vLLM CPU replicas, one trainer rank, the cpu channel + volume, retention 2."""
    body: dict[str, Any] = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    body["metadata"]["name"] = JOB
    spec = body["spec"]
    assert spec["inference"]["replicas"] == REPLICAS, spec["inference"]
    small = {"cpu": "1", "memory": "2Gi"}
    spec["trainer"].update(
        command=["python", "-c", TRAINER], worldSize=1, gpusPerWorker=0, resources=small,
        env=[{"name": "STEPS", "value": str(VERSIONS)}, {"name": "FINAL_WEIGHTS", "value": FINAL_WEIGHTS}],
    )  # fmt: skip
    spec["inference"].update(
        model=str(model), gpusPerReplica=0, resources=small,
        vllmArgs=["--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.06",
                  "--max-model-len", "256", "--seed", "0"],
    )  # fmt: skip
    spec["sync"].update(everySteps=1, channels=["cpu", "volume"], timeoutSeconds=120, retention=RETENTION)
    return body


def _rljob(kube: Kube, namespace: str) -> dict[str, Any]:
    obj: dict[str, Any] = kube.custom.get_namespaced_custom_object(GROUP, API, namespace, "rljobs", JOB)
    return obj


def _pods(kube: Kube, namespace: str, component: str) -> list[Any]:
    """The job's pods of ``component``, bound to a node, by name."""
    selector = f"weightsync.io/job={JOB},app.kubernetes.io/component={component}"
    pods = kube.core.list_namespaced_pod(namespace, label_selector=selector).items
    return sorted((p for p in pods if p.spec.node_name and not p.metadata.deletion_timestamp),
                  key=lambda p: p.metadata.name)  # fmt: skip


SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def _in_cluster_kubeconfig(kubelet: Kubelet, pod: str, container: str, path: Path, apiserver_port: int) -> Path:
    """What in-cluster config reads, as a kubeconfig: the token and CA of the pod's ServiceAccount volume (a
    TokenRequest token bound to the pod), the API server by its in-cluster name. In-cluster config itself reads
    fixed paths and a ClusterIP from the environment, which a process here cannot have."""
    account = kubelet.local_path(pod, container, SERVICE_ACCOUNT_DIR)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "in-cluster",
                "cluster": {
                    "server": f"https://kubernetes.default.svc:{apiserver_port}",
                    "certificate-authority": str(account / "ca.crt"),
                },
            }
        ],
        "users": [{"name": "pod", "user": {"tokenFile": str(account / "token")}}],
        "contexts": [{"name": "pod", "context": {"cluster": "in-cluster", "user": "pod"}}],
        "current-context": "pod",
    }
    path.write_text(yaml.safe_dump(config))
    return path


# --------------------------------------------------------------------- what the test observes


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


def _proxy(kubelet: Kubelet, replica: str) -> httpx.Client:
    """A client of the replica's OpenAI proxy: the replica's address, the proxy's containerPort."""
    ports = kubelet.container(replica, "proxy").ports
    port = next(p.container_port for p in ports if p.name == "openai")
    return httpx.Client(base_url=f"http://{kubelet.hosts.address(replica)}:{port}", trust_env=False)


def _alive(kubelet: Kubelet) -> None:
    dead = kubelet.crashed()
    assert not dead, f"{[p.name for p in dead]} exited:\n" + "\n".join(f"== {p.name}\n{p.tail()}" for p in dead)


def _wait_serving(kubelet: Kubelet, replicas: list[str], timeout: float) -> None:
    for replica in replicas:
        with _proxy(kubelet, replica) as client:

            def healthy(c: httpx.Client = client) -> bool:
                _alive(kubelet)
                return c.get("/health", timeout=2).status_code == 200

            Kube.wait_for(healthy, timeout, f"{replica} serving through its proxy", interval=1.0)


def _wait_registered(
    kubelet: Kubelet, coordinator: str, replicas: list[str], timeout: float, serving: int | None = None
) -> None:
    """The replicas registered (and, given ``serving``, report serving that version), asked from the test's host
    network: the coordinator pod's address, TLS verified against the job's CA under the Service's name."""
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.coordinator.tls import TlsConfig

    env = kubelet.env(coordinator, kubelet.container(coordinator, "coordinator"))
    service, port = env["WEIGHTSYNC_COORDINATOR"].rsplit(":", 1)
    ca = kubelet.volume(coordinator, "config") / "tls" / "ca.crt"
    tls = TlsConfig(ca_file=str(ca), server_name=service)
    address = f"{kubelet.hosts.address(coordinator)}:{port}"
    with CoordinatorClient(address, token=env["WEIGHTSYNC_TOKEN"], tls=tls, timeout_s=5.0) as c:

        def registered() -> bool:
            _alive(kubelet)
            members = {m.member_id: m.current_version for m in c.get_job(JOB).members}
            return all(r in members and serving in (None, members[r]) for r in replicas)

        Kube.wait_for(registered, timeout, f"replicas {replicas} registered with the coordinator", interval=1.0)


Greedy = list[tuple[list[int], list[float]]]


def _generate(kubelet: Kubelet, replica: str) -> Greedy:
    from weightsync_inference.http_engine import greedy

    with _proxy(kubelet, replica) as client:
        return greedy(client, support.PROMPTS, support.TOKENS)


def _agrees(model: Any, got: Greedy, what: str) -> None:
    from weightsync_trainer import reference

    result = reference.agreement(model, support.PROMPTS, got, support.LOGPROB_TOLERANCE)
    assert result.ok, f"{what}:\n" + "\n".join(result.mismatches)


# --------------------------------------------------------------------- the test


def test_weights_reach_every_replica_across_hosts(
    kube: Kube, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    import transformers

    netns.require()
    t0 = time.monotonic()
    model = support.tiny_model()
    kube.prebind_checkpoint_volume(namespace, JOB)
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_cpu_job(model)))
    kube.wait_for(lambda: _rljob(kube, namespace).get("status", {}).get("phase") == "Running",
                  Timeouts.POD_RUNNING, "RLJob Running")  # fmt: skip
    kube.wait_for(lambda: kube.rbac.read_namespaced_role_binding(f"{JOB}-coordinator", namespace),
                  Timeouts.POD_RUNNING, "the coordinator's RoleBinding")  # fmt: skip
    kube.wait_for(
        lambda: (
            kube.core.read_namespaced_persistent_volume_claim(f"{JOB}-checkpoints", namespace).status.phase == "Bound"
        ),
        Timeouts.POD_RUNNING,
        "the checkpoint claim bound",
    )
    pods: dict[str, list[Any]] = {}

    def scheduled() -> bool:
        pods.update({c: _pods(kube, namespace, c) for c in ("coordinator", "inference", "trainer")})
        return [len(pods[c]) for c in ("coordinator", "inference", "trainer")] == [1, REPLICAS, 1]

    kube.wait_for(scheduled, Timeouts.POD_SCHEDULED, "the job's pods bound to nodes")
    coordinator = pods["coordinator"][0].metadata.name
    replicas = [p.metadata.name for p in pods["inference"]]
    trainer = pods["trainer"][0].metadata.name
    apiserver_port = urlsplit(
        yaml.safe_load(kube.cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    ).port
    assert apiserver_port is not None

    watch = VersionWatch(kube, namespace)
    try:
        with (
            netns.Hosts([coordinator, *replicas, trainer]) as hosts,
            TcpForwarder((hosts.bridge_address, apiserver_port), ("127.0.0.1", apiserver_port)) as apiserver,
        ):
            kubelet = Kubelet(kube, namespace, hosts, [p for ps in pods.values() for p in ps], tmp_path / "pods")
            passed = False
            try:
                names = kubelet.service_names()
                trainer_env = kubelet.env(trainer, kubelet.container(trainer, "trainer"))
                assert names[trainer_env["WEIGHTSYNC_COORDINATOR"].rsplit(":", 1)[0]] == coordinator, names
                assert names[trainer_env["MASTER_ADDR"]] == trainer, names
                hosts.resolve({**names, "kubernetes.default.svc": hosts.bridge_address})
                kubeconfig = _in_cluster_kubeconfig(
                    kubelet, coordinator, "coordinator", tmp_path / "coordinator-kubeconfig", apiserver_port
                )

                # the pods' processes: the coordinator (its kubeconfig stands in for the in-cluster credentials; -v
                # for the test's log checks), then each replica's vllm, agent and proxy
                def start_coordinator() -> None:
                    kubelet.start(
                        coordinator, "coordinator", extra_args=("-v",), extra_env={"KUBECONFIG": str(kubeconfig)}
                    )

                start_coordinator()
                for replica in replicas:
                    kubelet.start_pod(replica)
                _wait_serving(kubelet, replicas, timeout=600)
                _wait_registered(kubelet, coordinator, replicas, timeout=120)
                assert "(TLS)" in kubelet.proc(coordinator, "coordinator").tail()
                for replica in replicas:  # vLLM's development-mode port is on the replica's loopback only
                    command = kubelet.container(replica, "vllm").command
                    vllm_port = int(command[command.index("--port") + 1])
                    with pytest.raises(ConnectionRefusedError):
                        socket.create_connection((hosts.address(replica), vllm_port), timeout=5).close()
                t_fleet = time.monotonic()

                base = support.hf_trainer(model, steps=0)
                before = {r: _generate(kubelet, r) for r in replicas}
                for replica, got in before.items():
                    _agrees(base, got, f"{replica} before any sync")

                # the trainer rank: its pod's one container, the command from the RLJob
                proc = kubelet.start(trainer, "trainer")
                proc.popen.wait(timeout=600)
                out = proc.tail(100_000)
                assert proc.popen.returncode == 0, out[-4000:]
                lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
                reports, durable = lines[:-1], lines[-1]
                assert [(r["version"], r["state"]) for r in reports] == [
                    (v, "READY") for v in range(1, VERSIONS + 1)
                ], out
                assert all(r["channels"] == dict.fromkeys(replicas, "cpu") and not r["failed"] for r in reports), (
                    reports
                )
                assert durable == {"durable_errors": []}, durable
                t_synced = time.monotonic()

                # greedy generations through each proxy changed to what the trainer's final weights give
                final = transformers.AutoModelForCausalLM.from_pretrained(
                    kubelet.volume(trainer, "tmp") / Path(FINAL_WEIGHTS).name, dtype=torch.float32
                )
                for replica in replicas:
                    after = _generate(kubelet, replica)
                    assert [ids for ids, _ in after] != [ids for ids, _ in before[replica]], (replica, before, after)
                    _agrees(final, after, f"{replica} after v{VERSIONS}")

                # the coordinator wrote every version: Ready and durable with both replicas loaded, a few writes each
                wv = [f"{JOB}-v{v}" for v in range(1, VERSIONS + 1)]
                loaded = sorted(f"{r}=loaded/cpu" for r in replicas)

                def settled(name: str) -> dict[str, Any] | None:
                    """The first status that says Ready, durable, loaded by both replicas on the cpu channel."""
                    for _, o in watch.seen(name):
                        status = o.get("status", {})
                        ready = status.get("phase") == "Ready" and status.get("durable")
                        if ready and sorted(status.get("replicaStates", "").split()) == loaded:
                            return dict(status)
                    return None

                kube.wait_for(lambda: all(settled(n) for n in wv), 30, "every version Ready, durable, loaded by both")
                digest = r"sha256:[0-9a-f]{64}"
                for step, name in enumerate(wv, start=1):
                    events = watch.seen(name)
                    assert events[0][0] == "ADDED", events
                    spec = events[0][1]["spec"]
                    assert spec["job"] == JOB and spec["step"] == step, spec
                    assert spec["channelPlan"] == [{"channel": "cpu", "replicas": REPLICAS}], spec
                    assert re.fullmatch(digest, spec["layoutDigest"]), spec
                    status = settled(name) or {}
                    assert re.fullmatch(digest, status["manifestChecksum"]), status
                    assert re.fullmatch(digest, status["contentDigest"]), status
                    owners = events[0][1]["metadata"]["ownerReferences"]
                    assert owners[0]["kind"] == "RLJob" and owners[0]["name"] == JOB, owners
                    modified = sum(t == "MODIFIED" for t, _ in events)
                    assert modified <= 5, f"{name}: {modified} writes (expected a few per version, not one per ack)"
                newest = kube.custom.get_namespaced_custom_object(GROUP, API, namespace, "weightversions", wv[-1])
                status = newest["status"]
                assert status["phase"] == "Ready" and status["durable"] is True, status
                assert status["replicasLoaded"] == REPLICAS and status["replicasFailed"] == 0, status
                assert sorted(status["replicas"], key=lambda e: e["name"]) == [
                    {"name": r, "channel": "cpu", "state": "loaded"} for r in replicas
                ], status
                assert status["laggingReplicas"] == [] and status["phaseSeconds"]["total"] > 0, status
                table = kube.kubectl("get", "wv", "-n", namespace).stdout
                header, *rows = table.splitlines()
                assert "REPLICAS" in header.split(), table
                row = next(r for r in rows if r.split()[0] == wv[-1])
                assert all(token in row.split() for token in loaded), table

                # the operator reflects the newest version in the RLJob's status and printer columns ...
                kube.wait_for(lambda: _rljob(kube, namespace)["status"].get("currentVersion") == VERSIONS,
                              Timeouts.POD_RUNNING, f"currentVersion {VERSIONS}")  # fmt: skip
                job_status = _rljob(kube, namespace)["status"]
                assert job_status["replicasLoaded"] == REPLICAS and job_status["lastSyncSeconds"] > 0, job_status
                jobs = kube.kubectl("get", "rljobs", JOB, "-n", namespace).stdout
                columns = dict(zip(*(line.split() for line in jobs.splitlines()[:2]), strict=False))
                assert columns["PHASE"] == "Running" and columns["VERSION"] == str(VERSIONS), jobs
                assert columns["READY"] == f"{REPLICAS}/{REPLICAS}", jobs

                # ... and retention (2) prunes the oldest WeightVersion; the coordinator prunes the volume likewise
                def kept() -> list[str]:
                    items = kube.custom.list_namespaced_custom_object(GROUP, API, namespace, "weightversions")["items"]
                    return sorted(i["metadata"]["name"] for i in items)

                kube.wait_for(lambda: kept() == wv[-RETENTION:], Timeouts.DELETE, f"retention keeps {wv[-RETENTION:]}")
                volume = kubelet.volume(coordinator, "checkpoints")
                copies = [f"v{v:08d}" for v in range(VERSIONS - RETENTION + 1, VERSIONS + 1)]
                kube.wait_for(lambda: sorted(p.name for p in volume.iterdir() if p.name.startswith("v")) == copies,
                              30, f"the volume keeps {copies}")  # fmt: skip
                assert apiserver.connections > 0

                # a coordinator restarted with no local state recovers READY from the API server (through the forwarder)
                old = kubelet.proc(coordinator, "coordinator")
                old.stop()
                seen = len(old.log_path.read_bytes())
                start_coordinator()

                def recovered() -> bool:
                    _alive(kubelet)
                    log = kubelet.proc(coordinator, "coordinator").log_path.read_bytes()[seen:].decode(errors="replace")
                    return (
                        f"job {JOB}: recovered {RETENTION} WeightVersions from namespace {namespace}" in log
                        and f"recovered job {JOB}: newest READY version {VERSIONS}" in log
                    )

                kube.wait_for(recovered, 60, "the restarted coordinator's recovery from the API server")
                # the agents (still running) registered again with it, serving the newest version
                _wait_registered(kubelet, coordinator, replicas, timeout=60, serving=VERSIONS)
                print(
                    f"\ntimings: fleet up {t_fleet - t0:.0f}s, {VERSIONS} syncs {t_synced - t_fleet:.1f}s, "
                    f"total {time.monotonic() - t0:.0f}s; "
                    f"sync seconds {[round(r['seconds']['total'], 2) for r in reports]}\n{table}"
                )
                passed = True
            finally:
                if not passed or os.environ.get("WEIGHTSYNC_E2E_PRINT_LOGS") == "1":
                    print(kubelet.tails())
                kubelet.close()
    finally:
        watch.stop()
        kube.kubectl("delete", "pv", f"{namespace}-{JOB}", "--wait=false", check=False)
