"""Starting the operator: API client, Prometheus endpoint, kopf's loop with a liveness endpoint.

Runs standalone (no kopf peering objects): the chart runs one replica with the
Recreate strategy, so two operators never reconcile at once during a rollout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import kopf
from kubernetes import client, config

from weightsync.metrics import OperatorMetrics, serve
from weightsync_operator.handlers import Options, build_registry
from weightsync_operator.kubeapi import Api


def api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call,unused-ignore]
    except config.ConfigException:
        config.load_kube_config()  # type: ignore[no-untyped-call,unused-ignore]
    configuration = client.Configuration.get_default_copy()
    # a connection for every reconcile thread and every concurrent write (handlers.WORKERS, reconciling._WRITES)
    configuration.connection_pool_maxsize = 64
    return client.ApiClient(configuration)


def run(
    options: Options, namespaces: Sequence[str], liveness_port: int, metrics_port: int, log_level: str = "INFO"
) -> None:
    """Block running the operator: watch ``namespaces`` (every namespace when empty)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level)  # also when something configured logging before us
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # a line per tick otherwise; we log changes
    metrics = OperatorMetrics.create()
    if metrics_port:
        serve(metrics_port, host="0.0.0.0")
    registry = build_registry(Api(api_client()), options, metrics)
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz",
    )
