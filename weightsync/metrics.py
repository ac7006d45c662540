"""The one place every weightsync metric is defined: coordinator, agents, publisher, operator.

Conventions (DESIGN.md, "Metrics"): names start with ``weightsync_``; base units
(``_seconds``, ``_bytes``); counters end in ``_total``; labels are few and bounded
(phase, channel, state, result) - never a version number or a pod name, which would
grow a series per step or per pod. Each component builds only its own group from
an injectable ``CollectorRegistry``, so a test uses a fresh registry and a process
exports only what it measures (an agent does not export an empty fleet gauge).

Who observes what, so no sync is counted twice: the publisher observes the
``publish`` phase; the coordinator observes ``transfer``, ``load``, ``verify`` and
``total`` from the replicas' acks (one scrape target sees the whole fleet) and the
bytes moved per channel; each agent exports only its own version and lag.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from weightsync.vocabulary import Channel, ReplicaHealth, SyncPhase, VersionState

SYNC_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
)
"""1 ms to 30 min: an IPC handoff of a small model up to a volume reload of a very large one."""

RECONCILE_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


NEGOTIATION_NONE = "none"
"""The ``channel`` label value of a negotiation that found no shared channel."""


def sync_duration(registry: CollectorRegistry) -> Histogram:
    return Histogram(
        "weightsync_sync_duration_seconds",
        "Seconds one sync phase took for one replica (publish: on the trainer).",
        ["phase", "channel"],
        buckets=SYNC_BUCKETS,
        registry=registry,
    )


def bytes_moved(registry: CollectorRegistry) -> Counter:
    return Counter(
        "weightsync_transferred_bytes", "Tensor bytes delivered, by channel.", ["channel"], registry=registry
    )


@dataclass(frozen=True)
class CoordinatorMetrics:
    sync_seconds: Histogram
    bytes_total: Counter
    versions: Gauge
    version_transitions_total: Counter
    replicas: Gauge
    fleet_version_lag_max: Gauge
    fleet_replicas_lagging: Gauge
    negotiations_total: Counter
    leases_expired_total: Counter
    version_ready_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry = REGISTRY) -> CoordinatorMetrics:
        m = cls(
            sync_seconds=sync_duration(registry),
            bytes_total=bytes_moved(registry),
            versions=Gauge("weightsync_versions", "Retained versions by state.", ["state"], registry=registry),
            version_transitions_total=Counter(
                "weightsync_version_transitions", "Versions that entered each state.", ["state"], registry=registry
            ),
            replicas=Gauge("weightsync_replicas", "Live replicas by state.", ["state"], registry=registry),
            fleet_version_lag_max=Gauge(
                "weightsync_fleet_version_lag_max",
                "Largest gap between the newest READY version number and a live replica's.",
                registry=registry,
            ),
            fleet_replicas_lagging=Gauge(
                "weightsync_fleet_replicas_lagging",
                "Live replicas not serving the newest READY version.",
                registry=registry,
            ),
            negotiations_total=Counter(
                "weightsync_negotiations",
                "Channel negotiations by outcome (channel, or none).",
                ["channel"],
                registry=registry,
            ),
            leases_expired_total=Counter(
                "weightsync_leases_expired",
                "Leases that expired without renewal, by role.",
                ["role"],
                registry=registry,
            ),
            version_ready_seconds=Histogram(
                "weightsync_version_ready_seconds",
                "Seconds from opening a version to READY.",
                buckets=SYNC_BUCKETS,
                registry=registry,
            ),
        )
        for state in VersionState:
            m.versions.labels(state.value)
        for health in ReplicaHealth:
            m.replicas.labels(health.value)
        return m


@dataclass(frozen=True)
class AgentMetrics:
    """One replica's agent: its own view, no labels (the scrape target says which pod)."""

    version: Gauge
    version_lag: Gauge
    sync_seconds: Histogram
    failures_total: Counter
    region_bytes_total: Counter
    """Bytes each worker received on the sharded path (its regions only), by worker index: what shows, from outside
    the agent, that a tensor-parallel worker took its own part and not the whole table."""
    volume_region_bytes_total: Counter
    """Bytes each worker landed from the checkpoint volume by region (a catch-up or a recovery of a sharded copy),
    by worker index: its layout's share, where a whole read would land the table."""

    @classmethod
    def create(cls, registry: CollectorRegistry = REGISTRY) -> AgentMetrics:
        return cls(
            version=Gauge("weightsync_agent_version", "Version this replica serves (0: none).", registry=registry),
            version_lag=Gauge(
                "weightsync_agent_version_lag",
                "Newest READY version number minus the one this replica serves.",
                registry=registry,
            ),
            sync_seconds=Histogram(
                "weightsync_agent_sync_duration_seconds",
                "Seconds this replica spent per sync phase.",
                ["phase", "channel"],
                buckets=SYNC_BUCKETS,
                registry=registry,
            ),
            failures_total=Counter(
                "weightsync_agent_update_failures",
                "Updates this replica refused or failed.",
                ["channel"],
                registry=registry,
            ),
            region_bytes_total=Counter(
                "weightsync_agent_region_received_bytes",
                "Bytes this replica's workers received as regions (the sharded path), by worker.",
                ["worker"],
                registry=registry,
            ),
            volume_region_bytes_total=Counter(
                "weightsync_agent_volume_region_landed_bytes",
                "Bytes this replica's workers landed from the checkpoint volume by region, by worker.",
                ["worker"],
                registry=registry,
            ),
        )

    def observe_regions(self, nbytes: Mapping[int, int], volume: bool = False) -> None:
        """One version received as regions (``volume``: read from the checkpoint volume by region): ``nbytes`` is
        worker -> bytes it received (landed)."""
        counter = self.volume_region_bytes_total if volume else self.region_bytes_total
        for worker, n in nbytes.items():
            counter.labels(str(worker)).inc(n)


@dataclass(frozen=True)
class PublisherMetrics:
    sync_seconds: Histogram
    bytes_total: Counter
    versions_published_total: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry = REGISTRY) -> PublisherMetrics:
        return cls(
            sync_seconds=sync_duration(registry),
            bytes_total=bytes_moved(registry),
            versions_published_total=Counter(
                "weightsync_versions_published",
                "Versions this trainer published, by outcome state.",
                ["state"],
                registry=registry,
            ),
        )

    def observe_publish(self, seconds: float, channel: Channel) -> None:
        self.sync_seconds.labels(SyncPhase.PUBLISH.value, channel.value).observe(seconds)


@dataclass(frozen=True)
class OperatorMetrics:
    reconciles_total: Counter
    reconcile_seconds: Histogram
    jobs: Gauge
    leader: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry = REGISTRY) -> OperatorMetrics:
        return cls(
            reconciles_total=Counter(
                "weightsync_operator_reconciles",
                "Reconciles by resource kind and result.",
                ["kind", "result"],
                registry=registry,
            ),
            reconcile_seconds=Histogram(
                "weightsync_operator_reconcile_duration_seconds",
                "Seconds per reconcile, by resource kind.",
                ["kind"],
                buckets=RECONCILE_BUCKETS,
                registry=registry,
            ),
            jobs=Gauge("weightsync_operator_jobs", "RLJobs by phase.", ["phase"], registry=registry),
            leader=Gauge(
                "weightsync_operator_leader",
                "1 while this operator holds the leader Lease and reconciles, 0 while it stands by.",
                registry=registry,
            ),
        )


@dataclass
class MetricsServer:
    """A running /metrics endpoint; ``close()`` stops it."""

    host: str
    port: int
    _server: object

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        shutdown = getattr(self._server, "shutdown", None)
        if shutdown is not None:
            shutdown()
        server_close = getattr(self._server, "server_close", None)
        if server_close is not None:
            server_close()


def serve(port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread (port 0 picks a free one)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host, int(server.server_address[1]), server)


def sync_seconds_totals(url: str, timeout_s: float = 10.0) -> dict[str, tuple[float, float]]:
    """(count, sum of seconds) per ``phase/channel`` of ``weightsync_sync_duration_seconds``, scraped from ``url`` (a
    coordinator's /metrics): what the demo and the benchmarks print as the replicas' breakdown (the difference of
    two scrapes is the breakdown of the versions between them)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local URLs: never through a proxy
    with no_proxy.open(url, timeout=timeout_s) as answer:
        text = answer.read().decode()
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "weightsync_sync_duration_seconds":
            continue
        for sample in family.samples:
            key = f"{sample.labels.get('phase')}/{sample.labels.get('channel')}"
            for suffix in ("_sum", "_count"):
                if sample.name.endswith(suffix):
                    found.setdefault(key, {})[suffix] = sample.value
    return {k: (v.get("_count", 0.0), v.get("_sum", 0.0)) for k, v in found.items()}
