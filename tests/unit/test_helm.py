"""The chart: lint --strict and template clean for the default and the GPU-pool values; every value documented."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync_operator import support

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "weightsync"
GPU_VALUES = REPO / "examples" / "values-gpu-pool.yaml"


def _helm() -> str:
    """helm from e2e/cluster.sh's tool cache (``e2e/cluster.sh tools``), or $WEIGHTSYNC_HELM."""
    if os.environ.get("WEIGHTSYNC_HELM"):
        return os.environ["WEIGHTSYNC_HELM"]
    out = subprocess.run(["bash", str(REPO / "e2e" / "cluster.sh"), "paths"], capture_output=True, text=True)
    path = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line).get("helm", "")
    if not os.access(path, os.X_OK):
        pytest.skip("helm not built: run e2e/cluster.sh tools")
    return path


def _template(*extra: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [_helm(), "template", "ws", str(CHART), "-n", "weightsync-system", *extra],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("values", [None, GPU_VALUES], ids=["default", "gpu-pool"])
def test_lint_strict(values: Path | None) -> None:
    args = [_helm(), "lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_render() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _template()}
    deploy = docs[("Deployment", "ws-weightsync")]
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "--coordinator-role=ws-weightsync-coordinator" in pod["containers"][0]["args"]
    assert ("ServiceMonitor", "ws-weightsync") not in docs
    dashboards = [d for d in docs.values() if d["kind"] == "ConfigMap"]
    assert len(dashboards) == 2 and all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in dashboards)
    # helm uninstall first runs the check that refuses while RLJobs exist, as the operator's ServiceAccount
    hook = docs[("Job", "ws-weightsync-uninstall-check")]
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    check = hook["spec"]["template"]["spec"]
    assert check["containers"][0]["command"] == ["weightsync", "operator", "--check-uninstall"]
    assert check["serviceAccountName"] == pod["serviceAccountName"] and check["securityContext"]["runAsNonRoot"]


def test_two_operator_replicas_elect_a_leader_on_the_charts_lease() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _template("--set", "operator.replicas=2")}
    deploy = docs[("Deployment", "ws-weightsync")]
    assert deploy["spec"]["replicas"] == 2 and deploy["spec"]["strategy"] == {"type": "RollingUpdate"}
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert {"--leader-elect-namespace=weightsync-system", "--leader-elect-name=ws-weightsync-leader"} <= set(
        container["args"]
    )
    assert "--no-leader-elect" not in container["args"]
    assert container["env"] == [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    # the chart makes the Lease (helm uninstall removes it), so the operators may only read and renew that one
    lease = docs[("Lease", "ws-weightsync-leader")]
    assert lease["metadata"]["namespace"] == "weightsync-system" and lease["spec"] == {}
    role = docs[("Role", "ws-weightsync-leader")]
    assert role["metadata"]["namespace"] == "weightsync-system"
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "update"],
            "resourceNames": ["ws-weightsync-leader"],
        },
    ]
    binding = docs[("RoleBinding", "ws-weightsync-leader")]
    account = {"kind": "ServiceAccount", "name": "ws-weightsync", "namespace": "weightsync-system"}
    assert binding["subjects"] == [account]


def test_gpu_values_render() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _template("-f", str(GPU_VALUES))}
    assert docs[("ServiceMonitor", "ws-weightsync")]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    pod = docs[("Deployment", "ws-weightsync")]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"weightsync.io/pool": "cpu"}


def test_rbac_is_least_privilege_and_matches_the_coordinator_contract() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _template()}
    operator = docs[("ClusterRole", "ws-weightsync-operator")]["rules"]
    resources = {r: rule["verbs"] for rule in operator for r in rule["resources"]}
    assert "weightversions/status" not in resources  # the coordinator's alone
    assert set(resources["weightversions"]) == {"get", "list", "watch", "delete"}
    assert {"rljobs/status", "rljobs/finalizers"} <= set(resources)
    assert resources["secrets"] == ["get", "create"]
    bind = next(r for r in operator if r["resources"] == ["clusterroles"])
    assert bind["verbs"] == ["bind"] and bind["resourceNames"] == ["ws-weightsync-coordinator"]
    assert docs[("ClusterRole", "ws-weightsync-coordinator")]["rules"] == support.ROLE_RULES
    assert not any("*" in str(rule) for rule in operator)


def test_every_value_is_documented_and_the_schema_covers_it() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    schema = json.loads((CHART / "values.schema.json").read_text())
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z][\w]*):", line)
        if not m:
            continue
        nested = i + 1 < len(lines) and re.match(rf"^{m.group(1)}\s+\S", lines[i + 1]) is not None
        if not nested and not (i > 0 and lines[i - 1].strip().startswith("# --")):
            undocumented.append(m.group(2))
    assert undocumented == []
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) == set(schema["properties"])
    for key, value in values.items():
        if isinstance(value, dict) and schema["properties"][key].get("properties"):
            assert set(value) == set(schema["properties"][key]["properties"]), key


def test_chart_crds_are_the_generated_ones() -> None:
    for path in (REPO / "crds").glob("*.yaml"):
        assert (CHART / "crds" / path.name).read_text() == path.read_text()


def test_kueue_integration_adds_its_flag_and_rights_only_when_enabled() -> None:
    default = {(d["kind"], d["metadata"]["name"]): d for d in _template()}
    container = default[("Deployment", "ws-weightsync")]["spec"]["template"]["spec"]["containers"][0]
    assert "--kueue" not in container["args"] and "--gang-admission=builtin" in container["args"]
    assert not any(
        "kueue.x-k8s.io" in r["apiGroups"] for r in default[("ClusterRole", "ws-weightsync-operator")]["rules"]
    )
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _template("--set", "kueue.enabled=true")}
    container = docs[("Deployment", "ws-weightsync")]["spec"]["template"]["spec"]["containers"][0]
    assert "--kueue" in container["args"]
    rules = {
        r["resources"][0]: r["verbs"]
        for r in docs[("ClusterRole", "ws-weightsync-operator")]["rules"]
        if "kueue.x-k8s.io" in r["apiGroups"]
    }
    assert rules == {
        "workloads": ["get", "list", "watch", "create", "delete"],
        "workloads/status": ["get", "patch"],
        "resourceflavors": ["get"],
    }


def test_the_uninstall_check_runs_where_the_operator_does() -> None:
    values = ["--set", "nodeSelector.pool=cpu", "--set-json", 'podAnnotations={"a":"b"}']
    hook = next(d for d in _template(*values) if d["kind"] == "Job")
    pod = hook["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"pool": "cpu"} and pod["metadata"]["annotations"] == {"a": "b"}
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "uninstall-check"
