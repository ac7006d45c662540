"""Server assembly: the core, the servicer, the interceptors, the listener, the reaper, /metrics.

Secure by default: a server without ``insecure=True`` needs a TLS certificate and
a bearer token and refuses to start otherwise, saying which option is missing.
It listens on 127.0.0.1 unless told another host. Interceptors run in this order:
size limit first (cheap, bounds work), then the token.

The gRPC thread pool bounds concurrency: each replica's open watch stream holds
one worker thread, so ``max_workers`` must exceed the fleet size plus the unary
calls in flight (the default leaves room for 512 streams).
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet
from prometheus_client import CollectorRegistry

from weightsync import metrics as metrics_mod
from weightsync.coordinator import _service, auth, limits
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import JobPolicy
from weightsync.coordinator.servicer import Servicer
from weightsync.coordinator.store import MemoryStore, VersionStore, VolumeStore
from weightsync.coordinator.tls import ServerTls
from weightsync.errors import PermanentError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    tls: ServerTls | None = None
    token: str | None = None
    insecure: bool = False
    max_message_bytes: int = limits.DEFAULT_MAX_MESSAGE_BYTES
    max_workers: int = 640
    lease_ttl_s: float = 10.0
    policy: JobPolicy = field(default_factory=JobPolicy)
    volumes: dict[str, Path] = field(default_factory=dict)
    """Job name -> checkpoint volume root: recovery, the version journal, manifest checksums and retention."""
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def check(self) -> None:
        if not self.insecure and self.tls is None:
            raise PermanentError(
                "TLS is on by default: pass --tls-cert and --tls-key (and --tls-client-ca for mutual "
                "TLS), or --insecure for a local run"
            )
        if not self.insecure and not self.token:
            raise PermanentError(
                "a bearer token is required with TLS: pass --token-file or set WEIGHTSYNC_TOKEN, "
                "or --insecure for a local run"
            )
        if self.max_message_bytes < 1024:
            raise PermanentError(f"--max-message-bytes {self.max_message_bytes} is too small; use at least 1024")


class _RefreshOnScrape:
    """A collector registered before the gauges: a scrape walks collectors in registration order,
    so the coordinator recomputes its gauges just before they are read (they are not updated per ack)."""

    def __init__(self) -> None:
        self.core: Coordinator | None = None

    def collect(self) -> list[object]:
        if self.core is not None:
            self.core.refresh_metrics()
        return []


class CoordinatorServer:
    """A running coordinator. ``stop()`` ends the listener, the reaper and /metrics."""

    def __init__(
        self, config: ServerConfig, registry: CollectorRegistry | None = None, store: VersionStore | None = None
    ) -> None:
        config.check()
        self.config = config
        self.registry = registry if registry is not None else CollectorRegistry()
        refresher = _RefreshOnScrape()
        self.registry.register(refresher)  # type: ignore[arg-type]
        self.metrics = metrics_mod.CoordinatorMetrics.create(self.registry)
        if store is None:
            store = VolumeStore(config.volumes) if config.volumes else MemoryStore()
        self.core = Coordinator(
            lease_ttl_s=config.lease_ttl_s,
            default_policy=config.policy,
            store=store,
            metrics=self.metrics,
            volumes=config.volumes,
        )
        refresher.core = self.core
        interceptors: list[grpc.ServerInterceptor] = [limits.SizeLimitInterceptor(config.max_message_bytes)]
        if config.token:
            interceptors.append(auth.BearerTokenInterceptor(config.token))
        hard_cap = config.max_message_bytes + (1 << 20)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="coordinator"),
            interceptors=interceptors,
            maximum_concurrent_rpcs=config.max_workers,
            options=[
                ("grpc.max_receive_message_length", hard_cap),
                ("grpc.max_send_message_length", hard_cap),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._server.add_generic_rpc_handlers(
            (_service.handler(Servicer(self.core, config.max_message_bytes).implementations()),)
        )
        address = f"{config.host}:{config.port}"
        if config.insecure:
            self.port = self._server.add_insecure_port(address)
        else:
            assert config.tls is not None
            self.port = self._server.add_secure_port(address, config.tls.credentials())
        if self.port == 0:
            raise PermanentError(f"cannot listen on {address}: in use or not a local address; pick another --port")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="coordinator-reaper", daemon=True)
        self.metrics_server: metrics_mod.MetricsServer | None = None

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> CoordinatorServer:
        self._server.start()
        self._reaper.start()
        if self.config.metrics_port is not None:
            self.metrics_server = metrics_mod.serve(self.config.metrics_port, self.config.metrics_host, self.registry)
        log.info("coordinator listening on %s (%s)", self.target, "insecure" if self.config.insecure else "TLS")
        return self

    def _reap(self) -> None:
        interval = min(0.5, self.config.lease_ttl_s / 4)
        while not self._stop.wait(interval):
            try:
                self.core.tick()
            except Exception:
                log.exception("reaper tick failed")

    def wait(self, timeout_s: float | None = None) -> bool:
        return bool(self._server.wait_for_termination(timeout_s))

    def stop(self, grace_s: float = 1.0) -> None:
        self._stop.set()
        self._server.stop(grace_s).wait(grace_s + 1.0)
        if self.metrics_server is not None:
            self.metrics_server.close()
