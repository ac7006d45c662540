"""Names, labels and ports of an RLJob's children, in one place.

Every child's name derives from the job's name, so a replayed event or a
restarted operator finds what it made before instead of making a second one:
names, not memory, are the operator's idempotency keys. Labels follow the
``app.kubernetes.io`` conventions plus ``weightsync.io/job`` (the selector the
coordinator uses for WeightVersion objects too).
"""

from __future__ import annotations

from weightsync.resources import GROUP, JOB_LABEL

# The children's names and ports are a contract with the CRD's rules (weightsync.resources.naming); re-exported here,
# where the operator's builders read every name, label and port.
from weightsync.resources.naming import (
    COORDINATOR_PORT,
    METRICS_PORT,
    SERVED_PORT,
    TRAINER_MASTER_PORT,
    VLLM_PORT,
    Component,
    checkpoint_claim,
    child,
    config_map,
    coordinator_account,
    inference_pod,
    openai_service,
    openai_url,
    tls_secret,
    token_secret,
    trainer_pod,
)

__all__ = [
    "CHECKPOINT_MOUNT",
    "CLEANUP_FINALIZER",
    "COMPONENT_LABEL",
    "CONFIG_MOUNT",
    "COORDINATOR_PORT",
    "HASH_ANNOTATION",
    "MANAGER",
    "METRICS_PORT",
    "RANK_LABEL",
    "RESTART_ANNOTATION",
    "SERVED_PORT",
    "TLS_CA_ENV",
    "TLS_CA_KEY",
    "TLS_CERT_KEY",
    "TLS_DIR",
    "TLS_KEY_KEY",
    "TLS_MOUNT",
    "TOKEN_KEY",
    "TRAINER_MASTER_PORT",
    "VLLM_PORT",
    "Component",
    "checkpoint_claim",
    "child",
    "config_map",
    "coordinator_account",
    "coordinator_address",
    "inference_pod",
    "label_selector",
    "labels",
    "openai_service",
    "openai_url",
    "selector",
    "tls_secret",
    "token_secret",
    "trainer_pod",
]

MANAGER = "weightsync-operator"
"""Server-side-apply field manager and the value of app.kubernetes.io/managed-by."""

COMPONENT_LABEL = "app.kubernetes.io/component"
HASH_ANNOTATION = f"{GROUP}/spec-hash"
RANK_LABEL = f"{GROUP}/rank"
RESTART_ANNOTATION = f"{GROUP}/restart"
"""On a trainer pod: its job's ``status.restarts`` when the pod was created (which gang it belongs to)."""
CLEANUP_FINALIZER = f"{GROUP}/cleanup"

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


def coordinator_address(job: str, namespace: str) -> str:
    return f"{child(job, Component.COORDINATOR)}.{namespace}.svc:{COORDINATOR_PORT}"
