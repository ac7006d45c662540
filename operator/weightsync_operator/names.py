"""Names, labels and ports of an RLJob's children, in one place.

Every child's name derives from the job's name, so a replayed event or a
restarted operator finds what it made before instead of making a second one:
names, not memory, are the operator's idempotency keys. Labels follow the
``app.kubernetes.io`` conventions plus ``weightsync.io/job`` (the selector the
coordinator uses for WeightVersion objects too).
"""

from __future__ import annotations

import enum

from weightsync.resources import GROUP, JOB_LABEL

MANAGER = "weightsync-operator"
"""Server-side-apply field manager and the value of app.kubernetes.io/managed-by."""

COMPONENT_LABEL = "app.kubernetes.io/component"
HASH_ANNOTATION = f"{GROUP}/spec-hash"
RANK_LABEL = f"{GROUP}/rank"
RESTART_ANNOTATION = f"{GROUP}/restart"
"""On a trainer pod: its job's ``status.restarts`` when the pod was created (which gang it belongs to)."""
CLEANUP_FINALIZER = f"{GROUP}/cleanup"

COORDINATOR_PORT = 50051
"""gRPC port of the coordinator (publishers and agents connect here)."""
METRICS_PORT = 9400
"""Prometheus port of every weightsync process (coordinator, agent, operator)."""
VLLM_PORT = 8001
"""vLLM's own port, bound to 127.0.0.1: its development-mode RL routes never leave the pod."""
SERVED_PORT = 8002
"""The agent's ``/served`` (what the replica serves), bound to 127.0.0.1: the proxy beside it reads it."""
TRAINER_MASTER_PORT = 29500
"""torch.distributed rendezvous port of trainer rank 0."""

CONFIG_MOUNT = "/etc/weightsync"
CHECKPOINT_MOUNT = "/checkpoints"
TOKEN_KEY = "token"
TLS_DIR = "tls"
"""The TLS files appear under ``CONFIG_MOUNT/TLS_DIR`` (projected into the config volume, see podspecs)."""
TLS_MOUNT = f"{CONFIG_MOUNT}/{TLS_DIR}"
TLS_CERT_KEY, TLS_KEY_KEY, TLS_CA_KEY = "tls.crt", "tls.key", "ca.crt"
"""Keys of the TLS Secret (type kubernetes.io/tls, plus the CA) and file names under ``TLS_MOUNT``."""
TLS_CA_ENV = "WEIGHTSYNC_TLS_CA"
"""Set in trainer pods: the path of the CA that signed the coordinator's certificate."""


class Component(enum.StrEnum):
    COORDINATOR = "coordinator"
    TRAINER = "trainer"
    INFERENCE = "inference"


def labels(job: str, component: Component | None = None) -> dict[str, str]:
    """Labels of a child; with ``component``, also the label that tells the parts apart."""
    out = {
        "app.kubernetes.io/name": "weightsync",
        "app.kubernetes.io/instance": job,
        "app.kubernetes.io/managed-by": MANAGER,
        JOB_LABEL: job,
    }
    if component is not None:
        out[COMPONENT_LABEL] = component.value
    return out


def selector(job: str, component: Component | None = None) -> dict[str, str]:
    """The stable subset of ``labels`` that selects pods (never includes a changing label)."""
    out = {JOB_LABEL: job}
    if component is not None:
        out[COMPONENT_LABEL] = component.value
    return out


def label_selector(job: str, component: Component | None = None) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(job, component).items())


def child(job: str, component: Component) -> str:
    """Name of the workload (and Service) of ``component``."""
    return f"{job}-{component.value}"


def trainer_pod(job: str, rank: int) -> str:
    return f"{job}-trainer-{rank}"


def openai_service(job: str) -> str:
    """The only Service clients use: it exposes the proxy's OpenAI routes and nothing else."""
    return f"{job}-openai"


def openai_url(job: str, namespace: str, port: int) -> str:
    """The OpenAI Service's URL as a trainer pod reaches it (without ``/v1``; ``weightsync.served``)."""
    return f"http://{openai_service(job)}.{namespace}.svc:{port}"


def config_map(job: str) -> str:
    return f"{job}-config"


def token_secret(job: str) -> str:
    return f"{job}-token"


def tls_secret(job: str) -> str:
    return f"{job}-tls"


def checkpoint_claim(job: str) -> str:
    return f"{job}-checkpoints"


def coordinator_account(job: str) -> str:
    return f"{job}-coordinator"


def coordinator_address(job: str, namespace: str) -> str:
    return f"{child(job, Component.COORDINATOR)}.{namespace}.svc:{COORDINATOR_PORT}"
