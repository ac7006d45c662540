"""The names and ports of an RLJob's children: one contract for the operator that makes them and the CRD that refuses
a job whose children could not exist.

Every child's name derives from the job's, so the job's name is only valid if each
derived name is. Several must be DNS labels (at most 63 characters): the Services
(DNS-1035: they also start with a letter, hence the job's name does), each trainer
pod's hostname, and two labels that controllers add to the replica pods: the
StatefulSet controller's ``controller-revision-hash`` (``<statefulset>-<hash of up
to 10 characters>``) and ``statefulset.kubernetes.io/pod-name``. ``NAME_LIMIT`` is
computed from ``dns_labels`` at their longest (the largest rank and ordinal the
spec allows), so a new child or a longer suffix moves the CRD's limit with it
(``weightsync crds``), and a name at the limit fits every one of them.

The ports are those of the containers that share a pod with the OpenAI proxy, whose
port the user chooses: the CRD refuses a proxy port that would collide with them.
"""

from __future__ import annotations

import enum

from weightsync.resources._base import DNS_LABEL

MAX_WORLD_SIZE = 1024
"""The most trainer ranks a job may have (``spec.trainer.worldSize``)."""
MAX_REPLICAS = 1024
"""The most vLLM replicas a job may have (``spec.inference.replicas``)."""
REVISION_HASH_LENGTH = 10
"""The StatefulSet controller's revision hash: a 32-bit FNV hash in Kubernetes' safe alphabet, at most 10 characters
(``k8s.io/kubernetes/pkg/controller/history.ControllerRevisionName``)."""
DNS_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1035 label: what a Service's name must be."""

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
INFERENCE_POD_PORTS = {
    VLLM_PORT: "vLLM's own port",
    METRICS_PORT: "the agent's metrics port",
    SERVED_PORT: "the agent's /served port",
}
"""Ports taken in a replica pod besides the proxy's: ``spec.inference.port`` may be none of them."""


class Component(enum.StrEnum):
    COORDINATOR = "coordinator"
    TRAINER = "trainer"
    INFERENCE = "inference"


def child(job: str, component: Component) -> str:
    """Name of the workload (and Service) of ``component``."""
    return f"{job}-{component.value}"


def trainer_pod(job: str, rank: int) -> str:
    return f"{job}-trainer-{rank}"


def inference_pod(job: str, ordinal: int) -> str:
    """The StatefulSet's pod ``ordinal`` (the controller names it, and labels it with this name)."""
    return f"{child(job, Component.INFERENCE)}-{ordinal}"


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


def dns_labels(job: str) -> list[tuple[str, str]]:
    """Every name made from ``job`` that must be a DNS label, at its longest, with what takes it."""
    inference = child(job, Component.INFERENCE)
    return [
        *((child(job, c), f"Service {child('<name>', c)}") for c in Component),
        (openai_service(job), f"Service {openai_service('<name>')}"),
        (
            trainer_pod(job, MAX_WORLD_SIZE - 1),
            f"the hostname of trainer pod {trainer_pod('<name>', MAX_WORLD_SIZE - 1)}",
        ),
        (inference_pod(job, MAX_REPLICAS - 1), "the label statefulset.kubernetes.io/pod-name of each replica pod"),
        (
            f"{inference}-{'x' * REVISION_HASH_LENGTH}",
            "the label controller-revision-hash the StatefulSet controller puts on each replica pod "
            f"({child('<name>', Component.INFERENCE)}-<hash of up to {REVISION_HASH_LENGTH} characters>)",
        ),
    ]


def _limit() -> tuple[int, str]:
    longest = max(dns_labels(""), key=lambda item: len(item[0]))
    return DNS_LABEL - len(longest[0]), longest[1]


NAME_LIMIT, NAME_LIMITED_BY = _limit()
"""The longest job name whose every DNS-label child fits 63 characters, and the child that sets it."""
