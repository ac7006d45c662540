"""Starting the operator: API client, Prometheus endpoint, leader election, kopf's loop with a liveness endpoint.

With an :class:`~weightsync_operator.leader.Election` (the chart always passes one) any number
of operators may run: one takes the Lease and reconciles, the others answer /healthz and wait
for it. kopf itself runs standalone (no kopf peering objects): its peering pauses a lower
priority operator only after it has seen a higher one, so two could reconcile in between.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kopf
from kubernetes import client, config

from weightsync.metrics import OperatorMetrics, serve
from weightsync_operator import writing
from weightsync_operator.handlers import WORKERS, Options, build_registry
from weightsync_operator.kubeapi import Api
from weightsync_operator.leader import Election

log = logging.getLogger(__name__)


def api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call,unused-ignore]
    except config.ConfigException as in_pod:
        try:
            config.load_kube_config()  # type: ignore[no-untyped-call,unused-ignore]
        except config.ConfigException as outside:
            raise SystemExit(
                f"weightsync operator: no cluster credentials: not in a pod ({in_pod}) and no kubeconfig ({outside}); "
                "run it from the chart (in-cluster ServiceAccount) or set KUBECONFIG"
            ) from outside
    configuration = client.Configuration.get_default_copy()
    # a connection for every reconcile thread and every write in flight
    configuration.connection_pool_maxsize = WORKERS + writing.WIDTH
    return client.ApiClient(configuration)


class _Standby(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        found = self.path == "/healthz"
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"standing by\n" if found else b"")

    def log_message(self, format: str, *args: object) -> None:
        pass  # a probe every few seconds is no news


@contextmanager
def _standby_probe(port: int) -> Iterator[None]:
    """/healthz answers while this operator stands by (kopf serves it once leading): waiting is not being stuck."""
    server = ThreadingHTTPServer(("0.0.0.0", port), _Standby)
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), name="standby-probe", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _lost(why: str) -> None:
    # reconciles run in threads that cannot be stopped from here; only ending the process stops them before a
    # standby may take the Lease (the pod restarts and stands by)
    log.critical("leadership lost, exiting: %s", why)
    logging.shutdown()
    os._exit(1)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run(
    options: Options,
    namespaces: Sequence[str],
    liveness_port: int,
    metrics_port: int,
    log_level: str = "INFO",
    election: Election | None = None,
) -> None:
    """Block running the operator: watch ``namespaces`` (every namespace when empty); with ``election``, only
    while holding its Lease."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(log_level)  # also when something configured logging before us
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # a line per tick otherwise; we log changes
    metrics = OperatorMetrics.create()
    if metrics_port:
        serve(metrics_port, host="0.0.0.0")
    api = Api(api_client())
    stop = threading.Event()
    # SIGTERM stops cleanly from the start (kopf installs its own handler only once its loop runs): a leader
    # stopped while starting still releases the Lease
    signal.signal(signal.SIGTERM, _terminate)
    lease = election.candidate(api) if election else None
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="reconcile")
    try:
        if lease is not None:
            with _standby_probe(liveness_port):
                lease.acquire(stop)
            lease.keep(_lost, stop)
        metrics.leader.set(1)
        kopf.run(
            registry=build_registry(api, options, metrics, pool),
            standalone=True,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            liveness_endpoint=f"http://0.0.0.0:{liveness_port}/healthz",
        )
    finally:
        # no reconcile may still be writing once a standby can take over
        pool.shutdown(wait=True, cancel_futures=True)
        stop.set()
        if lease is not None:
            lease.release()  # only if it holds the Lease
