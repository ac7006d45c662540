"""Dashboards: stable uids, a datasource variable, and queries that use only metrics weightsync.metrics defines."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from weightsync import metrics

pytestmark = pytest.mark.unit

DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "helm" / "weightsync" / "dashboards").glob("*.json"))
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def defined_series() -> set[str]:
    """Every series name the metric groups of weightsync.metrics export (each group in a fresh registry)."""
    names: set[str] = set()
    for _, group in inspect.getmembers(metrics, inspect.isclass):
        if group.__module__ != metrics.__name__ or not dataclasses.is_dataclass(group) or not hasattr(group, "create"):
            continue
        registry = CollectorRegistry()
        group.create(registry)
        for family in registry.collect():
            names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
    return names


def _targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_queries_use_only_defined_metrics(path: Path) -> None:
    known = defined_series()
    unknown = [
        (title, name)
        for title, expr in _targets(json.loads(path.read_text()))
        for name in re.findall(r"\bweightsync_[a-z0-9_]+", expr)
        if name not in known
    ]
    assert unknown == []


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_uid_datasource_variable_and_unique_panel_ids(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"].startswith("weightsync-")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_required_panels_exist() -> None:
    by_uid = {json.loads(p.read_text())["uid"]: json.loads(p.read_text()) for p in DASHBOARDS}
    sync = " ".join(e for _, e in _targets(by_uid["weightsync-sync"]))
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le, channel, phase)" in sync
    assert "weightsync_transferred_bytes_total" in sync and "weightsync_agent_version_lag" in sync
    assert 'state="FAILED"' in sync
    operator = " ".join(e for _, e in _targets(by_uid["weightsync-operator"]))
    for name in (
        "weightsync_operator_reconciles_total",
        "weightsync_operator_reconcile_duration_seconds_bucket",
        "weightsync_operator_jobs",
        'result="error"',
    ):
        assert name in operator
    assert len({json.loads(p.read_text())["uid"] for p in DASHBOARDS}) == len(DASHBOARDS)
