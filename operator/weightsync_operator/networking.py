"""Services and NetworkPolicies of an RLJob.

Who may talk to whom: every pod of the job may reach every other pod of the job
on any port (NCCL and NIXL pick their ports at run time; the agents and
publishers speak gRPC to the coordinator); anything may reach the OpenAI proxy
port and the metrics ports; nothing else gets in. vLLM's development-mode port is
bound to 127.0.0.1 and so is unreachable from any other pod whatever the
policies say; the policies are the second fence, for clusters that enforce them.
The OpenAI Service selects the replicas but names only the proxy's port.
"""

from __future__ import annotations

from weightsync.resources.rljob import RLJobSpec
from weightsync_operator import names
from weightsync_operator.names import Component
from weightsync_operator.podspecs import Obj


def _service(name: str, job: str, component: Component, ports: list[Obj], headless: bool = False) -> Obj:
    spec: Obj = {"selector": names.selector(job, component), "ports": ports}
    if headless:
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def _port(name: str, port: int, target: str | int | None = None) -> Obj:
    return {"name": name, "port": port, "targetPort": target if target is not None else port, "protocol": "TCP"}


def services(job: str, spec: RLJobSpec) -> list[Obj]:
    metrics = _port("metrics", names.METRICS_PORT)
    return [
        _service(
            names.child(job, Component.COORDINATOR),
            job,
            Component.COORDINATOR,
            [_port("grpc", names.COORDINATOR_PORT), metrics],
        ),
        # headless: stable DNS per rank (<job>-trainer-0.<job>-trainer) for the torch.distributed rendezvous
        _service(
            names.child(job, Component.TRAINER),
            job,
            Component.TRAINER,
            [_port("rendezvous", names.TRAINER_MASTER_PORT), metrics],
            headless=True,
        ),
        # headless: the StatefulSet's governing Service, per-replica DNS for the data plane and scraping
        _service(names.child(job, Component.INFERENCE), job, Component.INFERENCE, [metrics], headless=True),
        _service(names.openai_service(job), job, Component.INFERENCE, [_port("openai", spec.inference.port, "openai")]),
    ]


def _policy(job: str, component: Component, from_job_ports: list[int] | None, public_ports: list[int]) -> Obj:
    """Ingress: from the job's pods (on ``from_job_ports``, or any port when None) and from anywhere on
    ``public_ports``."""
    from_job: Obj = {"from": [{"podSelector": {"matchLabels": names.selector(job)}}]}
    if from_job_ports is not None:
        from_job["ports"] = [{"protocol": "TCP", "port": p} for p in from_job_ports]
    public = {"ports": [{"protocol": "TCP", "port": p} for p in public_ports]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": names.child(job, component)},
        "spec": {
            "podSelector": {"matchLabels": names.selector(job, component)},
            "policyTypes": ["Ingress"],
            "ingress": [from_job, public],
        },
    }


def network_policies(job: str, spec: RLJobSpec) -> list[Obj]:
    return [
        _policy(job, Component.COORDINATOR, [names.COORDINATOR_PORT], [names.METRICS_PORT]),
        _policy(job, Component.TRAINER, None, [names.METRICS_PORT]),
        _policy(job, Component.INFERENCE, None, [spec.inference.port, names.METRICS_PORT]),
    ]
