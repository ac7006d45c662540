"""Run the Kubernetes operator: reconcile RLJobs into their coordinator, trainer ranks and vLLM replicas.

Watches every namespace unless --namespace is given (repeatable). Serves a
liveness endpoint at :<liveness-port>/healthz and Prometheus metrics at
:<metrics-port>/metrics. Credentials come from the pod's ServiceAccount, or from
$KUBECONFIG outside a cluster.

Any number of operators may run: they elect a leader on a Lease (--leader-elect-*),
and only the leader reconciles; the others answer /healthz and wait to take over.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightsync_operator.leader import Election


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", action="append", default=[], help="namespace to watch (repeatable)")
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=600.0,
        help="seconds a job may go without an event before one reconcile reads the API itself "
        "(a safety net: events drive reconciles)",
    )
    parser.add_argument(
        "--coordinator-image",
        default="ghcr.io/weightsync/coordinator:0.1.0",
        help="coordinator image for jobs that do not name one",
    )
    parser.add_argument(
        "--coordinator-role",
        default="weightsync-coordinator",
        help="ClusterRole bound to each job's coordinator ServiceAccount",
    )
    parser.add_argument(
        "--gang-admission",
        choices=["builtin", "off"],
        default="builtin",
        help="builtin: a job gets its pods only once all of them fit the nodes' free capacity (jobs never deadlock "
        "on GPUs); off: every job creates its pods at once (jobs labelled for Kueue are admitted by Kueue either way)",
    )
    parser.add_argument(
        "--kueue",
        action="store_true",
        help="Kueue admits jobs labelled kueue.x-k8s.io/queue-name: the operator makes each one's Workload and "
        "suspends the job until Kueue admits it (needs Kueue, with RLJob.v1alpha1.weightsync.io in its "
        "integrations.externalFrameworks)",
    )
    parser.add_argument("--liveness-port", type=int, default=8080, help="port of /healthz")
    parser.add_argument("--metrics-port", type=int, default=9400, help="port of /metrics; 0 disables it")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    parser.add_argument(
        "--no-leader-elect",
        action="store_true",
        help="reconcile without taking the leader Lease (only when no other operator can run)",
    )
    parser.add_argument(
        "--leader-elect-namespace",
        default="",
        help="namespace of the Lease (default: $POD_NAMESPACE, the pod's own namespace, else 'default')",
    )
    parser.add_argument("--leader-elect-name", default="weightsync-operator", help="name of the Lease")
    parser.add_argument(
        "--leader-elect-identity", default="", help="this candidate's name (default: $POD_NAME or the host, + random)"
    )
    parser.add_argument(
        "--leader-elect-lease-seconds",
        type=float,
        default=15.0,
        help="a standby takes over after the Lease went this long unrenewed",
    )
    parser.add_argument(
        "--leader-elect-renew-deadline-seconds",
        type=float,
        default=10.0,
        help="the leader exits when it could not renew for this long (less than the lease)",
    )
    parser.add_argument(
        "--leader-elect-retry-seconds", type=float, default=2.0, help="how often the Lease is renewed or tried"
    )
    parser.add_argument(
        "--check-uninstall",
        action="store_true",
        help="do not run: exit 1 naming the RLJobs that still exist in the watched namespaces, 0 when there are "
        "none (the chart's pre-delete hook)",
    )


def run(args: argparse.Namespace) -> int:
    from weightsync_operator import Options, Settings
    from weightsync_operator.running import run as run_operator

    if args.check_uninstall:
        return _check_uninstall(args.namespace)

    settings = Settings(
        coordinator_image=args.coordinator_image, coordinator_role=args.coordinator_role, kueue=args.kueue
    )
    try:
        election = _election(args) if not args.no_leader_elect else None
    except ValueError as err:
        raise SystemExit(f"weightsync operator: {err}") from None
    run_operator(
        Options(settings=settings, resync_seconds=args.resync_seconds, gang=args.gang_admission == "builtin"),
        args.namespace,
        args.liveness_port,
        args.metrics_port,
        args.log_level,
        election,
    )
    return 0


def _election(args: argparse.Namespace) -> Election:
    from weightsync_operator.leader import Election, Timing, default_identity

    timing = Timing(
        lease_s=args.leader_elect_lease_seconds,
        renew_deadline_s=args.leader_elect_renew_deadline_seconds,
        retry_s=args.leader_elect_retry_seconds,
    )
    return Election(
        namespace=args.leader_elect_namespace or _own_namespace(),
        name=args.leader_elect_name,
        identity=args.leader_elect_identity or default_identity(),
        timing=timing,
    )


def _own_namespace() -> str:
    import os
    from pathlib import Path

    in_pod = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return os.environ.get("POD_NAMESPACE") or (in_pod.read_text().strip() if in_pod.exists() else "default")


def _check_uninstall(namespaces: list[str]) -> int:
    import sys

    from weightsync_operator import uninstall
    from weightsync_operator.kubeapi import Api
    from weightsync_operator.running import api_client

    why = uninstall.refusal(uninstall.live_jobs(Api(api_client()), namespaces))
    if why:
        print(f"weightsync: uninstall refused: {why}", file=sys.stderr)
        return 1
    print("weightsync: no RLJobs left; the operator can be uninstalled")
    return 0
