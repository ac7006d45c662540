"""Weights reach every replica across hosts, through pod deletions: examples/rljob.yaml on the real control plane,
each pod on its own host.

What runs where:

- the control plane (kube-apiserver on 127.0.0.1, kine, scheduler, controller-manager, KWOK nodes;
  ``e2e/cluster.sh``) and the operator (the chart helm-installed, the operator process run here under
  the chart's ServiceAccount) run on the test's host network;
- the RLJob is examples/rljob.yaml on the CPU: 2 vLLM CPU replicas, 1 trainer rank, channels
  ``[cpu, volume]``, retention 2. The operator makes its children; the scheduler binds the pods to
  KWOK's nodes, which run no containers;
- so each of the job's pods -- the coordinator Deployment's pod, the two StatefulSet replicas and the
  trainer rank -- is played by its own network namespace (``tests.netns``, named after the pod; one more,
  the spare host, plays the coordinator pod the Deployment makes after the first one is deleted), and
  its containers run there as processes started from the *Pod object* by ``tests/e2e/pods.py``
  (a stand-in kubelet): command, args and env as the operator wrote them (secrets from the API server,
  the downward API resolved: ``POD_IP`` is the namespace's address, ``NODE_NAME`` the node the
  scheduler chose). A replica's three containers (vLLM on its 127.0.0.1, the agent, the OpenAI proxy)
  share the replica's namespace, as a pod's containers share its network;
- names resolve as cluster DNS would: the coordinator Service ``<job>-coordinator.<ns>.svc``, the
  trainer's headless name in ``MASTER_ADDR`` (the trainer's gloo group rendezvouses through it), the
  replicas' headless names, each to the namespace playing that pod (so the Service's name moves to the
  new address when its pod is replaced: re-resolved by the clients' gRPC channels, which re-resolve at
  most every 30 s, a delay a ClusterIP would not add); ``kubernetes.default.svc`` to the
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
on a model it trains with AdamW, ``publish(step)`` every step (``everySteps`` 1) for 20 steps, each step
1.5 s longer (a sleep, ``STEP_SECONDS`` in its env) so that the faults land while it publishes; it
saves its final weights under its pod's /tmp. The test process reaches each replica's proxy at the
replica's address and the proxy's containerPort, through the bridge.

The faults, while the trainer publishes (each triggered by a WeightVersion appearing, i.e. as a version
is opened; whether that version is still in flight when the pod goes is up to timing):

1. when v4 is opened, ``kubectl delete pod`` of the coordinator: the test's kubelet stops it as a kubelet
   does (SIGTERM, SIGKILL after the grace period; on SIGTERM the coordinator flushes its WeightVersion
   writes); the Deployment makes a new pod under a new name, played on the spare host (a new address);
   the Service's name is pointed at it, and the new coordinator starts with no state but the checkpoint
   volume and the API server. The trainer's publish waits for it (the client retries; the new coordinator
   holds opens for one lease TTL), the agents register again (one whose channel re-resolved the name late
   is left out of the versions opened meanwhile and catches up from the volume);
2. at the next version opened once a version after the restart went Ready, ``kubectl delete pod
   <job>-inference-1``: the kubelet stops the pod's three processes (vLLM outlives SIGTERM: the grace
   period of 30 s runs out); the StatefulSet makes the pod again under its name (a new uid), and once the
   scheduler bound it the kubelet starts its containers on the same host with fresh volumes. The fleet
   goes on with one replica meanwhile (the dead one is dropped from a version it was planned for when its
   lease expires), and the replica catches up when its vLLM is up (usually after the trainer finished).

Checked:

- before the faults, v1..v3: greedy generations through both proxies are the base model's; each version
  became a WeightVersion that reached Ready and durable with both replicas loaded on the cpu channel
  (``status.replicas`` / ``replicaStates``), written a few times each (not once per ack);
- the new coordinator recovered the WeightVersions the old one left: their newest Ready version is its
  newest READY, a version left Staging is written back Failed, the version counter goes on; both agents
  registered with it again, and so did the trainer: every step was published, and every version the new
  coordinator opened is READY, those after the replica's deletion too (the one in flight at the
  coordinator's deletion may be FAILED or have no verdict; versions opened after the trainer was back but
  before any agent was fail, planned for no replica: the agents' channels may wait out gRPC's 30 s between
  re-resolutions, the new coordinator holds opens for one lease TTL only; volume copies the trainer could
  not report durable are listed by it and are of those versions only);
- the re-created replica comes back and catches up (from the volume, or live when it is back before the
  trainer ends): both replicas report serving the newest version to the coordinator, and their greedy
  generations changed to what transformers gives for the trainer's final weights;
- what they serve is what the API says: the newest WeightVersion is Ready and durable with both replicas
  loaded (and the REPLICAS column of ``kubectl get wv``), the RLJob's status and ``kubectl get rljobs``
  show it as current with both replicas loaded and READY 2/2; retention (2) left the two newest
  WeightVersions and volume copies (besides a copy whose durable mark reached no coordinator: nothing
  prunes those; the test prints them).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from dataclasses import dataclass
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
from weightsync.coordinator.kubestore import RESTARTED

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
JOB = "sync-e2e"
REPLICAS = 2
VERSIONS = 3  # versions published before the faults (checked in full)
STEPS = 20  # the trainer publishes every step
STEP_SECONDS = 1.5  # how much longer each training step takes (a sleep): the faults land while it publishes
COORDINATOR_FAULT_AT = VERSIONS + 1  # the coordinator's pod is deleted when this version is opened
AFTER_REPLICA_FAULT = 3  # versions, at least, the trainer publishes after the replica's pod is deleted
SPARE_HOST = "spare-host"  # plays the coordinator's replacement pod: a new address
RETENTION = 2
GROUP, API = "weightsync.io", "v1alpha1"
FINAL_WEIGHTS = "/tmp/final-weights"  # in the trainer pod's /tmp (an emptyDir)
# The trainer rank's command, as a user would put it in the RLJob (README, "Using it from a trainer"): everything
# it needs comes from the pod's env the operator wrote.
TRAINER = """
import json, os, time
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
    time.sleep(float(os.environ["STEP_SECONDS"]))  # a longer step of a real trainer
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
        env=[{"name": "STEPS", "value": str(STEPS)}, {"name": "STEP_SECONDS", "value": str(STEP_SECONDS)},
             {"name": "FINAL_WEIGHTS", "value": FINAL_WEIGHTS}],
    )  # fmt: skip
    spec["inference"].update(
        model=str(model), gpusPerReplica=0, resources=small,
        vllmArgs=["--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.06",
                  "--max-model-len", "256", "--seed", "0"],
    )  # fmt: skip
    # a transfer to a replica whose pod is deleted mid-stream is abandoned after 30 s, well inside the version's 120
    spec["sync"].update(
        everySteps=1, channels=["cpu", "volume"], timeoutSeconds=120, transferTimeoutSeconds=30, retention=RETENTION
    )
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
            kube.custom.list_namespaced_custom_object, GROUP, API, namespace, "weightversions", timeout_seconds=1500
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
    return httpx.Client(base_url=f"http://{kubelet.address(replica)}:{port}", trust_env=False)


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
) -> Any:
    """The replicas registered (and, given ``serving``, report serving that version), asked from the test's host
    network: the coordinator pod's address, TLS verified against the job's CA under the Service's name. Returns
    the job as the coordinator then saw it (a ``JobInfo``)."""
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.coordinator.tls import TlsConfig

    env = kubelet.env(coordinator, kubelet.container(coordinator, "coordinator"))
    service, port = env["WEIGHTSYNC_COORDINATOR"].rsplit(":", 1)
    ca = kubelet.volume(coordinator, "config") / "tls" / "ca.crt"
    tls = TlsConfig(ca_file=str(ca), server_name=service)
    address = f"{kubelet.address(coordinator)}:{port}"
    with CoordinatorClient(address, token=env["WEIGHTSYNC_TOKEN"], tls=tls, timeout_s=5.0) as c:

        def registered() -> Any:
            _alive(kubelet)
            job = c.get_job(JOB)
            members = {m.member_id: m.current_version for m in job.members}
            return job if all(r in members and serving in (None, members[r]) for r in replicas) else None

        what = f"replicas {replicas} registered with {coordinator}" + (f", serving v{serving}" if serving else "")
        return Kube.wait_for(registered, timeout, what, interval=1.0)


Greedy = list[tuple[list[int], list[float]]]


def _generate(kubelet: Kubelet, replica: str) -> Greedy:
    from weightsync_inference.http_engine import greedy

    with _proxy(kubelet, replica) as client:
        return greedy(client, support.PROMPTS, support.TOKENS)


def _agrees(model: Any, got: Greedy, what: str) -> None:
    from weightsync_trainer import reference

    result = reference.agreement(model, support.PROMPTS, got, support.LOGPROB_TOLERANCE)
    assert result.ok, f"{what}:\n" + "\n".join(result.mismatches)


# --------------------------------------------------------------------- the faults


@dataclass
class Fleet:
    """The job's pods as the test plays them, and what the faults need to find them again."""

    kube: Kube
    namespace: str
    hosts: netns.Hosts
    kubelet: Kubelet
    watch: VersionWatch
    work: Path
    apiserver_port: int
    coordinator: str  # the coordinator pod now played (a new name after its pod was deleted)
    replicas: list[str]
    trainer: str

    def start_coordinator(self) -> None:
        """The coordinator container of the current coordinator pod: its kubeconfig stands in for the in-cluster
        credentials of that pod's ServiceAccount volume; -v for the test's log checks."""
        pod = self.coordinator
        kubeconfig = self.kubelet.in_cluster_kubeconfig(
            pod, "coordinator", self.work / f"{pod}.kubeconfig", self.apiserver_port
        )
        self.kubelet.start(pod, "coordinator", extra_args=("-v",), extra_env={"KUBECONFIG": str(kubeconfig)})

    def resolve(self) -> dict[str, str]:
        """Point the Services' names at the pods played now (cluster DNS after an endpoint change)."""
        names = self.kubelet.service_names()
        self.hosts.resolve({**names, "kubernetes.default.svc": self.hosts.bridge_address})
        return names

    def versions(self) -> dict[int, dict[str, Any]]:
        """The job's WeightVersions in the API server now, by version."""
        items = self.kube.custom.list_namespaced_custom_object(GROUP, API, self.namespace, "weightversions")["items"]
        return {int(i["spec"]["version"]): i for i in items}


def _number(name: str) -> int:
    return int(name.rsplit("-v", 1)[1])


def _opened(watch: VersionWatch) -> list[int]:
    """Versions whose WeightVersion the watch saw created, in order."""
    return sorted({_number(o["metadata"]["name"]) for t, o in watch.events if t == "ADDED"})


def _status(watch: VersionWatch, version: int) -> dict[str, Any]:
    """The newest status the watch saw for ``version`` (empty before any)."""
    seen = watch.seen(f"{JOB}-v{version}")
    return dict(seen[-1][1].get("status", {})) if seen else {}


def _phase(watch: VersionWatch, version: int) -> str:
    return str(_status(watch, version).get("phase", ""))


def _next_opened(fleet: Fleet, timeout: float) -> int:
    """The first version opened after those the watch saw so far."""
    after = max(_opened(fleet.watch), default=0)

    def opened() -> int:
        return next((v for v in _opened(fleet.watch) if v > after), 0)

    return fleet.kube.wait_for(opened, timeout, f"a version opened after v{after}")


def _delete_replica_pod(fleet: Fleet, replica: str) -> Any:
    """``kubectl delete pod``; the kubelet stops its processes; the StatefulSet makes it again under its name, and
    the kubelet starts the new pod on the same host. Returns the new V1Pod."""
    kube, kubelet = fleet.kube, fleet.kubelet
    old = kubelet.pod(replica).metadata.uid
    kube.kubectl("delete", "pod", replica, "-n", fleet.namespace, "--wait=false")
    stopped = kubelet.terminate(replica)
    assert sorted(p.container for p in stopped) == ["agent", "proxy", "vllm"], [p.name for p in stopped]

    def recreated() -> Any:
        pod = kube.core.read_namespaced_pod(replica, fleet.namespace)
        fresh = pod.metadata.uid != old and pod.spec.node_name and not pod.metadata.deletion_timestamp
        return pod if fresh else None

    pod = kube.wait_for(recreated, Timeouts.POD_SCHEDULED, f"{replica} made again by its StatefulSet and bound")
    kubelet.add(pod)
    kubelet.start_pod(replica)
    return pod


def _delete_coordinator_pod(fleet: Fleet) -> dict[int, dict[str, Any]]:
    """``kubectl delete pod`` of the coordinator; the kubelet stops it (on SIGTERM it flushes its WeightVersion
    writes); the Deployment makes a new pod under a new name, played on the spare host; the Service's name is
    pointed at it and the new coordinator starts. Returns the WeightVersions the old coordinator left, as the new
    one finds them."""
    kube, kubelet = fleet.kube, fleet.kubelet
    old = fleet.coordinator
    kube.kubectl("delete", "pod", old, "-n", fleet.namespace, "--wait=false")
    assert [p.container for p in kubelet.terminate(old)] == ["coordinator"]

    def replacement() -> Any:
        fresh = [p for p in _pods(kube, fleet.namespace, "coordinator") if p.metadata.name != old]
        return fresh[0] if fresh else None

    pod = kube.wait_for(replacement, Timeouts.POD_SCHEDULED, "the coordinator Deployment's new pod bound")
    fleet.coordinator = pod.metadata.name
    kubelet.add(pod, host=SPARE_HOST)
    names = fleet.resolve()
    service = kubelet.env(fleet.coordinator, kubelet.container(fleet.coordinator, "coordinator"))
    assert names[service["WEIGHTSYNC_COORDINATOR"].rsplit(":", 1)[0]] == SPARE_HOST, names
    left = fleet.versions()
    fleet.start_coordinator()
    return left


def _recovered(fleet: Fleet, left: dict[int, dict[str, Any]], timeout: float) -> int:
    """The new coordinator recovered what the old one left in the API server: the newest READY version and the
    version counter; versions left Staging come back Failed (and are written so). Returns the newest READY."""
    phases = {v: o.get("status", {}).get("phase") for v, o in left.items()}
    ready = max(v for v, phase in phases.items() if phase == "Ready")
    staging = [v for v, phase in phases.items() if phase == "Staging"]
    proc = fleet.kubelet.proc(fleet.coordinator, "coordinator")
    pattern = re.compile(rf"job {JOB}: recovered (\d+) WeightVersions from namespace {fleet.namespace}")

    def recovered() -> int:
        _alive(fleet.kubelet)
        log = proc.log_path.read_text(errors="replace")
        found = pattern.search(log)
        return int(found.group(1)) if found and f"recovered job {JOB}: newest READY version " in log else 0

    count = fleet.kube.wait_for(recovered, timeout, "the new coordinator's recovery from the API server")
    assert count <= len(left), (count, sorted(left))
    assert f"recovered job {JOB}: newest READY version {ready}\n" in proc.tail(100_000), (phases, proc.tail())
    for v in staging:  # written back Failed, so the operator's retention can prune it

        def failed(v: int = v) -> bool:
            status = fleet.versions().get(v, {}).get("status", {})
            return status.get("phase") == "Failed" and RESTARTED in status.get("message", "")

        fleet.kube.wait_for(failed, 30, f"v{v}, left Staging, written back Failed")
    return ready


# --------------------------------------------------------------------- the test


def test_weights_reach_every_replica_across_hosts_through_pod_deletions(
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
            netns.Hosts([coordinator, *replicas, trainer, SPARE_HOST]) as hosts,
            TcpForwarder((hosts.bridge_address, apiserver_port), ("127.0.0.1", apiserver_port)) as apiserver,
            Kubelet(kube, namespace, hosts, [p for ps in pods.values() for p in ps], tmp_path / "pods") as kubelet,
        ):
            fleet = Fleet(
                kube, namespace, hosts, kubelet, watch, tmp_path, apiserver_port, coordinator, replicas, trainer
            )
            names = fleet.resolve()
            trainer_env = kubelet.env(trainer, kubelet.container(trainer, "trainer"))
            service = trainer_env["WEIGHTSYNC_COORDINATOR"].rsplit(":", 1)[0]
            assert names[service] == coordinator, names
            assert names[trainer_env["MASTER_ADDR"]] == trainer, names

            # the pods' processes: the coordinator, then each replica's vllm, agent and proxy
            fleet.start_coordinator()
            for replica in replicas:
                kubelet.start_pod(replica)
            _wait_serving(kubelet, replicas, timeout=600)
            _wait_registered(kubelet, coordinator, replicas, timeout=120)
            assert "(TLS)" in kubelet.proc(coordinator, "coordinator").tail()
            for replica in replicas:  # vLLM's development-mode port is on the replica's loopback only
                command = kubelet.container(replica, "vllm").command
                vllm_port = int(command[command.index("--port") + 1])
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((kubelet.address(replica), vllm_port), timeout=5).close()
            t_fleet = time.monotonic()

            base = support.hf_trainer(model, steps=0)
            before = {r: _generate(kubelet, r) for r in replicas}
            for replica, got in before.items():
                _agrees(base, got, f"{replica} before any sync")

            # the trainer rank: its pod's one container, the command from the RLJob; it publishes every step
            proc = kubelet.start(trainer, "trainer")

            # fault 1: the coordinator pod deleted as a version is opened, while the trainer publishes
            kube.wait_for(lambda: COORDINATOR_FAULT_AT in _opened(watch), 180, f"v{COORDINATOR_FAULT_AT} opened")
            t_coordinator = time.monotonic()
            left = _delete_coordinator_pod(fleet)
            cut = max(left)  # the newest version the old coordinator opened
            ready_at_cut = _recovered(fleet, left, timeout=60)
            t_recovered = time.monotonic()
            # the agents registered with it again (their gRPC channels re-resolved the Service's name; the
            # replica's pod is deleted only then, or versions would find no replica) ...
            _wait_registered(kubelet, fleet.coordinator, replicas, timeout=120)
            rejoined = max(_opened(watch))  # the versions after this one were opened with both agents back
            # ... and so did the trainer's publisher: versions opened by the new coordinator go READY
            kube.wait_for(lambda: any(_phase(watch, v) in ("Ready", "Superseded") for v in _opened(watch)
                                      if v > cut), 180, f"a version after v{cut} Ready")  # fmt: skip
            t_resumed = time.monotonic()

            # fault 2: a replica pod deleted as the next version is opened; it comes back while the trainer
            # goes on with the other replica (or after the trainer finished)
            victim = replicas[1]
            at_replica = _next_opened(fleet, 60)
            assert at_replica <= STEPS - AFTER_REPLICA_FAULT, (
                f"the trainer reached v{at_replica} of {STEPS} before the replica's pod was deleted: "
                "raise STEPS or STEP_SECONDS"
            )
            t_replica = time.monotonic()
            _delete_replica_pod(fleet, victim)
            t_replica_made = time.monotonic()

            proc.popen.wait(timeout=420)
            out = proc.tail(100_000)
            assert proc.popen.returncode == 0, out[-4000:]
            t_trained = time.monotonic()
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            reports, durable = lines[:-1], lines[-1]
            published = [(r["version"], r["state"]) for r in reports]
            assert len(reports) == STEPS and all(v > 0 for v, _ in published), published  # every step published
            assert [v for v, _ in published] == sorted({v for v, _ in published}), published
            # before the faults, every version READY on the cpu channel with both replicas
            assert published[:VERSIONS] == [(v, "READY") for v in range(1, VERSIONS + 1)], published
            for r in reports[:VERSIONS]:
                assert r["channels"] == dict.fromkeys(replicas, "cpu") and not r["failed"], r
            # around the coordinator's deletion a version may fail or have no verdict; after it, all READY (the
            # replica's deletion costs no version: the dead one is dropped from those it was planned for) but
            # those the new coordinator opened before any agent was back, which fail planned for no replica
            final = published[-1][0]
            for r in reports:
                v, state = r["version"], r["state"]
                if v > cut and state != "READY":
                    message = _status(watch, v).get("message", "")
                    # the trainer's report says where its time went (seconds per phase) and what failed
                    assert v <= rejoined and "planned for no replica" in message, (v, state, message, r, published)
            assert all(s == "READY" for v, s in published if v > rejoined), (rejoined, published)
            assert published[-1][1] == "READY", published
            assert min(v for v, _ in published if v > cut) == cut + 1, (cut, published)  # the counter went on
            assert all(s in ("READY", "FAILED", "STAGING") for _, s in published), published
            assert final >= cut + RETENTION, (cut, published)
            errors = durable["durable_errors"]  # a volume copy the coordinator could not be told of, if any
            named = [int(m.group(1)) for e in errors if (m := re.match(r"version (\d+):", e))]
            assert len(named) == len(errors) and all(v <= cut for v in named), (cut, errors)

            # the re-created replica came back and caught up; both serve the newest version, as they report
            _wait_serving(kubelet, [victim], timeout=600)
            job = _wait_registered(kubelet, fleet.coordinator, replicas, timeout=180, serving=final)
            assert job.newest_ready == final, job
            t_caught_up = time.monotonic()

            # greedy generations through each proxy changed to what the trainer's final weights give
            weights = transformers.AutoModelForCausalLM.from_pretrained(
                kubelet.volume(trainer, "tmp") / Path(FINAL_WEIGHTS).name, dtype=torch.float32
            )
            for replica in replicas:
                after = _generate(kubelet, replica)
                assert [ids for ids, _ in after] != [ids for ids, _ in before[replica]], (replica, before, after)
                _agrees(weights, after, f"{replica} after v{final}")

            # v1..v3, before the faults: Ready and durable with both replicas loaded, a few writes each
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

            kube.wait_for(lambda: all(settled(n) for n in wv), 30, "v1..v3 Ready, durable, loaded by both")
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

            # the newest version, as the WeightVersion says: Ready, durable, both replicas loaded
            newest = f"{JOB}-v{final}"

            def both_loaded() -> Any:
                status = fleet.versions()[final].get("status", {})
                states = {e["name"]: e["state"] for e in status.get("replicas", [])}
                return status if states == dict.fromkeys(replicas, "loaded") else None

            status = kube.wait_for(both_loaded, 60, f"{newest} showing both replicas loaded")
            assert status["phase"] == "Ready" and status["durable"] is True, status
            assert status["replicasLoaded"] == REPLICAS and status["replicasFailed"] == 0, status
            assert status["laggingReplicas"] == [] and status["phaseSeconds"]["total"] > 0, status
            table = kube.kubectl("get", "wv", "-n", namespace).stdout
            header, *rows = table.splitlines()
            assert "REPLICAS" in header.split(), table
            row = next(r for r in rows if r.split()[0] == newest).split()
            assert all(any(t.startswith(f"{r}=loaded/") for t in row) for r in replicas), table

            # the operator reflects it in the RLJob's status and printer columns: what both replicas serve
            kube.wait_for(lambda: (s := _rljob(kube, namespace)["status"]).get("currentVersion") == final
                          and s.get("replicasLoaded") == REPLICAS, Timeouts.POD_RUNNING,
                          f"currentVersion {final} loaded by both")  # fmt: skip
            job_status = _rljob(kube, namespace)["status"]
            assert job_status["lastSyncSeconds"] > 0, job_status
            jobs = kube.kubectl("get", "rljobs", JOB, "-n", namespace).stdout
            columns = dict(zip(*(line.split() for line in jobs.splitlines()[:2]), strict=False))
            assert columns["PHASE"] == "Running" and columns["VERSION"] == str(final), jobs
            assert columns["READY"] == f"{REPLICAS}/{REPLICAS}", jobs

            # retention (2) prunes the older WeightVersions; the coordinator prunes the volume likewise
            keep = list(range(final - RETENTION + 1, final + 1))
            kube.wait_for(lambda: sorted(fleet.versions()) == keep, Timeouts.DELETE, f"retention keeps {keep}")
            volume = kubelet.volume(fleet.coordinator, "checkpoints")
            copies = [f"v{v:08d}" for v in keep]
            # a copy whose durable mark never reached a coordinator (the trainer lists it) is not the
            # coordinator's to prune: it knows no such copy
            unmarked = {f"v{v:08d}" for v in named}

            def pruned() -> bool:
                return sorted({p.name for p in volume.iterdir() if p.name.startswith("v")} - unmarked) == copies

            kube.wait_for(pruned, 30, f"the volume keeps {copies} (besides unmarked copies {sorted(unmarked)})")
            left_over = sorted(p.name for p in volume.iterdir() if p.name in unmarked)
            assert apiserver.connections > 0

            planned = {e["name"]: e.get("channel", "-") for e in status["replicas"]}
            print(
                f"\ntimings: fleet up {t_fleet - t0:.0f}s; from the trainer's start: coordinator pod deleted "
                f"(v{COORDINATOR_FAULT_AT} opened) {t_coordinator - t_fleet:.0f}s, new one recovered "
                f"+{t_recovered - t_coordinator:.0f}s (newest READY v{ready_at_cut}, old one's newest v{cut}), "
                f"a later version Ready +{t_resumed - t_recovered:.0f}s; replica pod deleted (v{at_replica} "
                f"opened) +{t_replica - t_resumed:.0f}s, made again and started +{t_replica_made - t_replica:.0f}s"
                f"; trainer done +{t_trained - t_replica_made:.0f}s; {victim} on v{final} "
                f"+{t_caught_up - t_trained:.0f}s (newest version's channels {planned}); "
                f"total {time.monotonic() - t0:.0f}s\npublished {published}\ndurable errors {errors} (copies left "
                f"on the volume: {left_over})\n{table}"
            )
    finally:
        watch.stop()
        kube.kubectl("delete", "pv", f"{namespace}-{JOB}", "--wait=false", check=False)
