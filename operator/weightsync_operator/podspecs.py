"""Pieces every pod of an RLJob shares: security, placement, GPUs, volumes and environment.

Each workload builder composes these, so the rules they encode hold for every
pod at once: containers run as a non-root user with no privilege escalation and
no capabilities; GPU pods request ``nvidia.com/gpu`` as a limit (the device
plugin's contract) and carry the job's nodeSelector and tolerations; Colocate
pins the trainer and its replicas to one node (required pod affinity on the
job's label: the first pod satisfies it by itself), Spread spreads the replicas
across nodes.
"""

from __future__ import annotations

from typing import Any

from weightsync.resources.rljob import PlacementMode, Rdma, Resources, RLJobSpec
from weightsync.vocabulary import Channel
from weightsync_operator import names

RUN_AS_USER = 1000
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
GPU_RESOURCE = "nvidia.com/gpu"
SHM_VOLUME = "dshm"

Obj = dict[str, Any]


def channel_needs(spec: RLJobSpec) -> Obj:
    """Pod-level settings the job's channels need (merged into the trainer and inference pod specs).

    CUDA IPC between two pods needs a shared IPC namespace: ``hostIPC`` when the job lists ipc and
    colocates its pods (the only placement where a replica shares the trainer's GPUs); the GPUs must
    then be shareable (time-slicing or MPS), since the device plugin gives each GPU to one pod.
    """
    colocated_ipc = spec.placement.mode == PlacementMode.COLOCATE and Channel.IPC in spec.sync.channels
    return {"hostIPC": True} if colocated_ipc else {}


def rdma_capabilities(spec: RLJobSpec) -> list[str]:
    """IPC_LOCK for containers that register memory for RDMA (NCCL over IB/RoCE, NIXL), when the job asks for RDMA."""
    return ["IPC_LOCK"] if spec.sync.rdma is not None else []


def pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(read_only_root: bool = True, add: list[str] | None = None) -> Obj:
    """No privilege escalation, every capability dropped but the few ``add`` names (IPC_LOCK for RDMA)."""
    capabilities: Obj = {"drop": ["ALL"]}
    if add:
        capabilities["add"] = list(add)
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": capabilities,
    }


def resources(spec: Resources, gpus: int = 0, rdma: Rdma | None = None) -> Obj:
    """Requests equal limits (a GPU pod must not be squeezed); GPUs and RDMA devices only as limits."""
    amounts: dict[str, str] = {}
    if spec.cpu:
        amounts["cpu"] = spec.cpu
    if spec.memory:
        amounts["memory"] = spec.memory
    limits = dict(amounts)
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
    if rdma is not None:
        limits[rdma.resource] = str(rdma.count)
    out: Obj = {}
    if amounts:
        out["requests"] = amounts
    if limits:
        out["limits"] = limits
    return out


def placement(job: str, spec: RLJobSpec, component: names.Component, node_labels: Obj | None = None) -> Obj:
    """nodeSelector, tolerations and affinity of a GPU pod (trainer or inference); ``node_labels``: those of the
    flavors Kueue admitted the pod's pod set on (they win over the job's nodeSelector: Kueue counted the quota
    there)."""
    out: Obj = {}
    selector = {**spec.placement.node_selector, **(node_labels or {})}
    if selector:
        out["nodeSelector"] = selector
    if spec.placement.tolerations:
        out["tolerations"] = [t.to_wire() for t in spec.placement.tolerations]
    if spec.placement.mode == PlacementMode.COLOCATE:
        term = {"labelSelector": {"matchLabels": names.selector(job)}, "topologyKey": HOSTNAME_TOPOLOGY}
        out["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    elif component == names.Component.INFERENCE:
        out["topologySpreadConstraints"] = [
            {
                "maxSkew": 1,
                "topologyKey": HOSTNAME_TOPOLOGY,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": names.selector(job, component)},
            }
        ]
    return out


def shm_volume() -> Obj:
    """/dev/shm as memory: vLLM and NCCL need more than the runtime's 64 MiB default."""
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}


def shm_mount() -> Obj:
    return {"name": SHM_VOLUME, "mountPath": "/dev/shm"}


KEY_MODE = 0o440
"""The server key's file mode: owner root, group the pod's fsGroup (the process's group), nobody else."""


def config_volume(job: str, server_tls: bool = False) -> Obj:
    """``job.json`` from the job's ConfigMap and, under ``tls/``, files of the job's TLS Secret.

    Every pod gets the CA (``tls/ca.crt``) to verify the coordinator; only the
    coordinator (``server_tls``) gets its certificate and private key. One
    projected volume rather than a Secret volume mounted inside the ConfigMap's:
    a mount point cannot be created inside a read-only mount.
    """
    keys = [names.TLS_CERT_KEY, names.TLS_KEY_KEY, names.TLS_CA_KEY] if server_tls else [names.TLS_CA_KEY]
    items: list[Obj] = []
    for key in keys:
        item: Obj = {"key": key, "path": f"{names.TLS_DIR}/{key}"}
        if key == names.TLS_KEY_KEY:
            item["mode"] = KEY_MODE
        items.append(item)
    return {
        "name": "config",
        "projected": {
            "sources": [
                {"configMap": {"name": names.config_map(job)}},
                {"secret": {"name": names.tls_secret(job), "items": items}},
            ]
        },
    }


def tls_path(key: str) -> str:
    """Where file ``key`` of the TLS Secret is in a container that mounts ``config_mount``."""
    return f"{names.TLS_MOUNT}/{key}"


def config_mount() -> Obj:
    return {"name": "config", "mountPath": names.CONFIG_MOUNT, "readOnly": True}


def checkpoint_volume(job: str, spec: RLJobSpec) -> Obj:
    claim = spec.sync.checkpoint_volume.existing_claim or names.checkpoint_claim(job)
    return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}}


def checkpoint_mount(read_only: bool) -> Obj:
    return {"name": "checkpoints", "mountPath": names.CHECKPOINT_MOUNT, "readOnly": read_only}


def tmp_volume() -> Obj:
    return {"name": "tmp", "emptyDir": {}}


def tmp_mount() -> Obj:
    return {"name": "tmp", "mountPath": "/tmp"}


def common_env(job: str, namespace: str) -> list[Obj]:
    """What every weightsync process needs: who it is, where the coordinator is, the shared token."""
    return [
        {"name": "WEIGHTSYNC_JOB", "value": job},
        {"name": "WEIGHTSYNC_NAMESPACE", "value": namespace},
        {"name": "WEIGHTSYNC_COORDINATOR", "value": names.coordinator_address(job, namespace)},
        {"name": "WEIGHTSYNC_CONFIG", "value": f"{names.CONFIG_MOUNT}/job.json"},
        {
            "name": "WEIGHTSYNC_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": names.token_secret(job), "key": names.TOKEN_KEY}},
        },
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]


def metrics_port() -> Obj:
    return {"name": "metrics", "containerPort": names.METRICS_PORT, "protocol": "TCP"}
