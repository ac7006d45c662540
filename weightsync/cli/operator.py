"""Run the Kubernetes operator: reconcile RLJobs into their coordinator, trainer ranks and vLLM replicas.

Watches every namespace unless --namespace is given (repeatable). Serves a
liveness endpoint at :<liveness-port>/healthz and Prometheus metrics at
:<metrics-port>/metrics. Credentials come from the pod's ServiceAccount, or from
$KUBECONFIG outside a cluster.
"""

from __future__ import annotations

import argparse


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
    parser.add_argument("--liveness-port", type=int, default=8080, help="port of /healthz")
    parser.add_argument("--metrics-port", type=int, default=9400, help="port of /metrics; 0 disables it")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
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

    settings = Settings(coordinator_image=args.coordinator_image, coordinator_role=args.coordinator_role)
    run_operator(
        Options(settings=settings, resync_seconds=args.resync_seconds),
        args.namespace,
        args.liveness_port,
        args.metrics_port,
        args.log_level,
    )
    return 0


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
