"""The metrics module: naming conventions, bounded labels, buckets, the /metrics helper."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from weightsync import metrics

pytestmark = pytest.mark.unit

FORBIDDEN_LABELS = {"version", "pod", "replica", "replica_id", "pod_name", "step"}


def all_groups() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics.CoordinatorMetrics.create(registry)
    metrics.OperatorMetrics.create(registry)
    metrics.AgentMetrics.create(registry)
    other = CollectorRegistry()  # publisher shares sync/bytes names with the coordinator: its own process
    metrics.PublisherMetrics.create(other)
    return registry


def test_names_units_and_labels() -> None:
    for metric in all_groups().collect():
        assert metric.name.startswith("weightsync_"), metric.name
        for sample in metric.samples:
            assert not FORBIDDEN_LABELS & set(sample.labels), (metric.name, sample.labels)
        if metric.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in metric.samples)
        if metric.type == "histogram":
            assert metric.name.endswith("_seconds"), metric.name


def test_sync_buckets_span_1ms_to_30min() -> None:
    assert metrics.SYNC_BUCKETS[0] == 0.001 and metrics.SYNC_BUCKETS[-1] == 1800.0
    assert list(metrics.SYNC_BUCKETS) == sorted(metrics.SYNC_BUCKETS)


def test_agent_lag_has_no_labels_and_publisher_observes_publish() -> None:
    registry = CollectorRegistry()
    agent = metrics.AgentMetrics.create(registry)
    agent.version_lag.set(2)
    assert registry.get_sample_value("weightsync_agent_version_lag") == 2
    pub_registry = CollectorRegistry()
    pub = metrics.PublisherMetrics.create(pub_registry)
    from weightsync.vocabulary import Channel

    pub.observe_publish(0.02, Channel.NCCL)
    assert (
        pub_registry.get_sample_value("weightsync_sync_duration_seconds_count", {"phase": "publish", "channel": "nccl"})
        == 1
    )


def test_serve_exposes_the_registry() -> None:
    registry = CollectorRegistry()
    metrics.CoordinatorMetrics.create(registry)
    server = metrics.serve(0, registry=registry)
    try:
        body = urllib.request.urlopen(server.url, timeout=5).read().decode()
    finally:
        server.close()
    assert 'weightsync_versions{state="READY"} 0.0' in body
    assert server.url.startswith("http://127.0.0.1:")


def test_an_agent_counts_each_workers_region_bytes_by_worker() -> None:
    registry = CollectorRegistry()
    agent = metrics.AgentMetrics.create(registry)
    agent.observe_regions({0: 1314304, 1: 1314304})
    agent.observe_regions({0: 10, 1: 20})
    by_worker = {
        w: registry.get_sample_value("weightsync_agent_region_received_bytes_total", {"worker": w}) for w in "01"
    }
    assert by_worker == {"0": 1314314, "1": 1314324}
