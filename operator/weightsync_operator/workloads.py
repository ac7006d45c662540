"""The pods of an RLJob: coordinator Deployment, one pod per trainer rank, the vLLM StatefulSet.

The commands here are the contract with the weightsync CLI each container runs
(``weightsync coordinator|agent|proxy``); every process also reads the job's
config from ``$WEIGHTSYNC_CONFIG`` and its identity from the environment
(podspecs.common_env), so the flags stay few.

Every process reads the job's sync settings from ``job.json`` (``$WEIGHTSYNC_CONFIG``):
the coordinator its policy (channels, ack policy, timeouts, retention), each agent the
channels it may receive and the job's NCCL domain, the trainer (``Publisher.from_env``)
the channels it offers. The trainer's rendezvous listens on its pod IP (``$POD_IP``);
agents learn their node from ``$NODE_NAME`` and the tensor-parallel size, devices and GPU
UUIDs from vLLM's workers (``--worker-extension-cls``). The coordinator mounts the
checkpoint volume: it hashes each version's manifest itself when the version becomes
durable and prunes the volume beyond the job's retention.

The coordinator serves TLS with the job's certificate and key
(``--tls-cert/--tls-key``, from the ``<job>-tls`` Secret); its clients verify it
with the job's CA: the agent by ``--tls-ca``, the trainer's own code through
``$WEIGHTSYNC_TLS_CA`` (a path). Only the coordinator pod mounts the key.

vLLM is started with ``VLLM_SERVER_DEV_MODE=1`` because its RL routes (pause,
weight transfer, resume) exist only in that mode, and that mode also opens other
development routes. So vLLM binds 127.0.0.1: only containers of its own pod
reach it — the agent (weight updates) and the proxy (which forwards the OpenAI
routes only and is the one port a Service exposes).

Trainer ranks are bare pods with stable names (``<job>-trainer-<rank>``) behind a
headless Service, not a Job: the operator restarts the gang itself so that the
restart budget lives in the RLJob's status, where re-creating children cannot
reset it. ``parked`` (suspended or finished) scales the others to zero; their
objects stay, so resuming is a scale-up, not a re-creation.
"""

from __future__ import annotations

from weightsync import served
from weightsync.resources.rljob import RLJobSpec
from weightsync.vocabulary import Channel
from weightsync_operator import names, podspecs
from weightsync_operator.names import Component
from weightsync_operator.podspecs import Obj


def coordinator(
    job: str, namespace: str, spec: RLJobSpec, image: str, parked: bool, node_labels: Obj | None = None
) -> Obj:
    """The coordinator: one replica (it holds the version counter), recreated, never rolled; it writes the job's
    WeightVersion objects in ``namespace`` with its ServiceAccount and recovers from them when restarted
    (``node_labels``: those of the flavor Kueue admitted it on)."""
    container = {
        "name": "coordinator",
        "image": spec.coordinator.image or image,
        "command": [
            "weightsync",
            "coordinator",
            "--host",
            "0.0.0.0",
            "--port",
            str(names.COORDINATOR_PORT),
            "--metrics-port",
            str(names.METRICS_PORT),
            "--metrics-host",
            "0.0.0.0",
            "--kubernetes-namespace",
            namespace,
            "--tls-cert",
            podspecs.tls_path(names.TLS_CERT_KEY),
            "--tls-key",
            podspecs.tls_path(names.TLS_KEY_KEY),
            "--volume",
            names.CHECKPOINT_MOUNT,
        ],
        "env": podspecs.common_env(job, namespace),
        "ports": [
            {"name": "grpc", "containerPort": names.COORDINATOR_PORT, "protocol": "TCP"},
            podspecs.metrics_port(),
        ],
        "readinessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [
            podspecs.config_mount(),
            podspecs.checkpoint_mount(read_only=False),
            podspecs.tmp_mount(),
        ],
        "securityContext": podspecs.container_security(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names.child(job, Component.COORDINATOR)},
        "spec": {
            "replicas": 0 if parked else 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": names.selector(job, Component.COORDINATOR)},
            "template": {
                "metadata": {"labels": names.labels(job, Component.COORDINATOR)},
                "spec": {
                    "serviceAccountName": names.coordinator_account(job),
                    **({"nodeSelector": dict(node_labels)} if node_labels else {}),
                    "securityContext": podspecs.pod_security(),
                    "containers": [container],
                    "volumes": [
                        podspecs.config_volume(job, server_tls=True),
                        podspecs.checkpoint_volume(job, spec),
                        podspecs.tmp_volume(),
                    ],
                },
            },
        },
    }


def trainer_pod(job: str, namespace: str, spec: RLJobSpec, rank: int, node_labels: Obj | None = None) -> Obj:
    """Rank ``rank`` of the trainer gang; rank 0 is the torch.distributed master."""
    service = names.child(job, Component.TRAINER)
    env = (
        podspecs.common_env(job, namespace)
        + [
            {"name": "RANK", "value": str(rank)},
            {"name": "WORLD_SIZE", "value": str(spec.trainer.world_size)},
            {"name": "MASTER_ADDR", "value": f"{names.trainer_pod(job, 0)}.{service}.{namespace}.svc"},
            {"name": "MASTER_PORT", "value": str(names.TRAINER_MASTER_PORT)},
            {"name": "WEIGHTSYNC_CHECKPOINT_DIR", "value": names.CHECKPOINT_MOUNT},
            {"name": names.TLS_CA_ENV, "value": podspecs.tls_path(names.TLS_CA_KEY)},
            # where rollouts go: the job's replicas behind their proxies (TRL, Atropos: weightsync_trainer.integrations)
            {"name": served.OPENAI_URL_ENV, "value": names.openai_url(job, namespace, spec.inference.port)},
        ]
        + [e.to_wire() for e in spec.trainer.env]
    )
    container = {
        "name": "trainer",
        "image": spec.trainer.image,
        "command": list(spec.trainer.command),
        "env": env,
        "ports": [
            {"name": "rendezvous", "containerPort": names.TRAINER_MASTER_PORT, "protocol": "TCP"},
            podspecs.metrics_port(),
        ],
        "resources": podspecs.resources(spec.trainer.resources, spec.trainer.gpus_per_worker, spec.sync.rdma),
        "volumeMounts": [
            podspecs.shm_mount(),
            podspecs.config_mount(),
            podspecs.checkpoint_mount(read_only=False),
            podspecs.tmp_mount(),
        ],
        "securityContext": podspecs.container_security(read_only_root=False, add=podspecs.rdma_capabilities(spec)),
    }
    labels = names.labels(job, Component.TRAINER) | {names.RANK_LABEL: str(rank)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": names.trainer_pod(job, rank), "labels": labels},
        "spec": {
            "hostname": names.trainer_pod(job, rank),
            "subdomain": service,
            "restartPolicy": "Never",
            "securityContext": podspecs.pod_security(),
            "containers": [container],
            "volumes": [
                podspecs.shm_volume(),
                podspecs.config_volume(job),
                podspecs.checkpoint_volume(job, spec),
                podspecs.tmp_volume(),
            ],
            **podspecs.placement(job, spec, Component.TRAINER, node_labels),
            **podspecs.channel_needs(spec),
        },
    }


WORKER_EXTENSION = "weightsync_inference.worker.WorkerExtension"


def vllm_command(spec: RLJobSpec) -> list[str]:
    """vLLM's server on localhost with weightsync's engine (one engine receives every channel) and the worker
    extension the agent asks what each worker is and what it computed while loading."""
    backend = Channel(spec.sync.channels[0]).engine_name
    return [
        "python", "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(names.VLLM_PORT),
        "--model", spec.inference.model,
        "--tensor-parallel-size", str(spec.inference.tensor_parallel_size),
        "--weight-transfer-config", f'{{"backend": "{backend}"}}',
        "--worker-extension-cls", WORKER_EXTENSION,
        *spec.inference.vllm_args,
    ]  # fmt: skip


def inference(job: str, namespace: str, spec: RLJobSpec, parked: bool, node_labels: Obj | None = None) -> Obj:
    """The vLLM replicas: vLLM (localhost only), the weightsync agent and the OpenAI proxy per pod."""
    inf = spec.inference
    upstream = f"http://127.0.0.1:{names.VLLM_PORT}"
    vllm = {
        "name": "vllm",
        "image": inf.image,
        "command": vllm_command(spec),
        "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}, {"name": "HOME", "value": "/tmp"}],
        "resources": podspecs.resources(inf.resources, inf.gpus_per_replica, spec.sync.rdma),
        "volumeMounts": [podspecs.shm_mount(), podspecs.checkpoint_mount(read_only=True), podspecs.tmp_mount()],
        "securityContext": podspecs.container_security(read_only_root=False, add=podspecs.rdma_capabilities(spec)),
    }
    agent = {
        "name": "agent",
        "image": inf.image,
        "command": [
            "weightsync",
            "agent",
            "--vllm-url",
            upstream,
            "--metrics-port",
            str(names.METRICS_PORT),
            "--metrics-host",
            "0.0.0.0",
            "--served-listen",
            f"127.0.0.1:{names.SERVED_PORT}",
            "--checkpoint-dir",
            names.CHECKPOINT_MOUNT,
            "--tls-ca",
            podspecs.tls_path(names.TLS_CA_KEY),
        ],
        "env": podspecs.common_env(job, namespace),
        "ports": [podspecs.metrics_port()],
        "volumeMounts": [podspecs.config_mount(), podspecs.checkpoint_mount(read_only=True), podspecs.tmp_mount()],
        "securityContext": podspecs.container_security(),
    }
    proxy = {
        "name": "proxy",
        "image": inf.image,
        "command": [
            "weightsync",
            "proxy",
            "--listen",
            f"0.0.0.0:{inf.port}",
            "--upstream",
            upstream,
            "--agent",
            f"http://127.0.0.1:{names.SERVED_PORT}",
            # a completion waits out an update at most as long as a version may stay STAGING
            "--update-wait",
            str(spec.sync.timeout_seconds),
        ],
        "ports": [{"name": "openai", "containerPort": inf.port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "openai"}, "periodSeconds": 5},
        # a read-only root: Python's tempfile (torch's import asks it) needs a writable /tmp
        "volumeMounts": [podspecs.tmp_mount()],
        "securityContext": podspecs.container_security(),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": names.child(job, Component.INFERENCE)},
        "spec": {
            "replicas": 0 if parked else inf.replicas,
            "serviceName": names.child(job, Component.INFERENCE),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": names.selector(job, Component.INFERENCE)},
            "template": {
                "metadata": {"labels": names.labels(job, Component.INFERENCE)},
                "spec": {
                    "securityContext": podspecs.pod_security(),
                    "containers": [vllm, agent, proxy],
                    "volumes": [
                        podspecs.shm_volume(),
                        podspecs.config_volume(job),
                        podspecs.checkpoint_volume(job, spec),
                        podspecs.tmp_volume(),
                    ],
                    **podspecs.placement(job, spec, Component.INFERENCE, node_labels),
                    **podspecs.channel_needs(spec),
                },
            },
        },
    }
