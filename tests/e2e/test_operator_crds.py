"""The CRDs on the real API server: accepted, defaults applied, bad specs rejected naming the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import Kube
from weightsync.resources.naming import NAME_LIMIT

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLE: dict[str, Any] = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())


@pytest.fixture(scope="module")
def crds_installed(kube: Kube) -> None:
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "crd/rljobs.weightsync.io", "crd/weightversions.weightsync.io")


def _apply(kube: Kube, namespace: str, body: dict[str, Any], dry_run: bool = True) -> Any:
    args = ["apply", "-n", namespace, "--server-side", "-f", "-", "-o", "json"]
    return kube.kubectl(*args, *(["--dry-run=server"] if dry_run else []), input=json.dumps(body), check=False)


def _with(change: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    for dotted, value in change.items():
        node = body
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    return body


def test_example_is_accepted_with_defaults(kube: Kube, namespace: str, crds_installed: None) -> None:
    proc = _apply(kube, namespace, EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)["spec"]
    assert spec["suspend"] is False and spec["inference"]["port"] == 8000
    assert spec["sync"]["checkpointVolume"]["accessMode"] == "ReadWriteMany"


def test_the_trl_example_is_accepted(kube: Kube, namespace: str, crds_installed: None) -> None:
    """examples/rljob-trl.yaml: the RLJob whose trainer command is the TRL integration's example."""
    proc = _apply(kube, namespace, yaml.safe_load((REPO / "examples" / "rljob-trl.yaml").read_text()))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["spec"]["trainer"]["command"][1].endswith("/trl_grpo.py")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"spec.inference.replicas": 0}, "spec.inference.replicas"),
        ({"spec.sync.channels": ["nccl", "rdma"]}, 'spec.sync.channels[1]: Unsupported value: "rdma"'),
        ({"spec.sync.ackPolicy": "Quorum"}, "spec.sync.quorum is required"),
        ({"spec.sync.ackPolicy": "Quorum", "spec.sync.quorum": 5}, "spec.sync.quorum must not exceed"),
        ({"spec.inference.tensorParallelSize": 2, "spec.inference.gpusPerReplica": 3}, "spec.inference.gpusPerReplica"),
        ({"spec.trainer.command": []}, "spec.trainer.command"),
        ({"spec.sync.allOrNothing": True}, "spec.sync.allOrNothing needs spec.sync.mode staged"),
        ({"spec.sync.timeoutSeconds": 60}, "spec.sync.transferTimeoutSeconds must be below spec.sync.timeoutSeconds"),
        (
            {"spec.sync.joinTimeoutSeconds": 200},
            "spec.sync.joinTimeoutSeconds must be below spec.sync.transferTimeoutSeconds",
        ),
        ({"metadata.name": "my.job"}, "metadata.name: Invalid value: must be a DNS-1035 label"),
        ({"metadata.name": "1job"}, "metadata.name: Invalid value: must be a DNS-1035 label"),
        ({"metadata.name": "a" * (NAME_LIMIT + 1)}, f"metadata.name: Invalid value: may have at most {NAME_LIMIT}"),
        ({"spec.sync.checkpointVolume.size": "-5Gi"}, 'spec.sync.checkpointVolume.size: Invalid value: "-5Gi": must'),
        ({"spec.trainer.resources.cpu": "-1"}, 'spec.trainer.resources.cpu: Invalid value: "-1": must be a positive'),
        ({"spec.inference.resources.memory": "0"}, 'spec.inference.resources.memory: Invalid value: "0": must be'),
        (
            {
                "spec.placement.tolerations": [
                    {"key": "a", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 5}
                ]
            },
            "spec.placement.tolerations[0].tolerationSeconds: Invalid value: tolerationSeconds needs effect NoExecute",
        ),
        (
            {"spec.placement.tolerations": [{"operator": "Equal", "value": "x"}]},
            "spec.placement.tolerations[0].operator: Invalid value: operator must be Exists when key is empty",
        ),
        ({"spec.placement.nodeSelector": {"not a key": "x"}}, "spec.placement.nodeSelector: Invalid value: keys must"),
        ({"spec.inference.port": 9400}, "spec.inference.port: Invalid value: 9400: must not be 8001"),
        ({"spec.inference.port": 8001}, "spec.inference.port: Invalid value: 8001: must not be 8001"),
        ({"spec.inference.port": 8002}, "spec.inference.port: Invalid value: 8002: must not be 8001"),
    ],
    ids=[
        "zero-replicas",
        "unknown-channel",
        "quorum-missing",
        "quorum-too-big",
        "tp-gpus",
        "no-command",
        "atomic-in-place",
        "transfer-timeout",
        "join-timeout",
        "name-dots",
        "name-digit-first",
        "name-one-over-the-limit",
        "signed-size",
        "signed-cpu",
        "zero-memory",
        "toleration-seconds-without-noexecute",
        "toleration-without-key-not-exists",
        "node-selector-key",
        "port-of-the-agent-metrics",
        "port-of-vllm",
        "port-of-the-agent-served",
    ],
)
def test_invalid_specs_are_rejected_naming_the_field(
    kube: Kube, namespace: str, crds_installed: None, change: dict[str, Any], expected: str
) -> None:
    proc = _apply(kube, namespace, _with(change))
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"spec.trainer.worldSize": 4}, "spec.trainer.worldSize"),
        ({"spec.placement.mode": "Colocate"}, "spec.placement.mode"),
        ({"spec.sync.checkpointVolume": {"size": "1Ti"}}, "spec.sync.checkpointVolume"),
        ({"spec.inference.model": "Qwen/Qwen3-8B"}, "spec.inference.model"),
    ],
    ids=["world-size", "placement-mode", "checkpoint-volume", "model"],
)
def test_immutable_fields_cannot_change(
    kube: Kube, namespace: str, crds_installed: None, change: dict[str, Any], field: str
) -> None:
    created = _apply(kube, namespace, EXAMPLE, dry_run=False)
    assert created.returncode == 0, created.stderr
    proc = _apply(kube, namespace, _with(change))
    assert proc.returncode != 0
    assert f"{field}: Invalid value" in proc.stderr and "is immutable" in proc.stderr, proc.stderr


def test_weightversion_spec_is_immutable(kube: Kube, namespace: str, crds_installed: None) -> None:
    wv = {
        "apiVersion": "weightsync.io/v1alpha1",
        "kind": "WeightVersion",
        "metadata": {"name": "grpo-qwen-v1", "labels": {"weightsync.io/job": "grpo-qwen"}},
        "spec": {
            "job": "grpo-qwen",
            "version": 1,
            "step": 4,
            "bytes": 1024,
            "channelPlan": [{"channel": "nccl", "replicas": 2}],
        },
    }
    assert _apply(kube, namespace, wv, dry_run=False).returncode == 0
    wv["spec"]["step"] = 8
    proc = _apply(kube, namespace, wv)
    assert proc.returncode != 0 and "is immutable" in proc.stderr, proc.stderr
    got = kube.kubectl("get", "wv", "-n", namespace, "grpo-qwen-v1").stdout
    assert "VERSION" in got.splitlines()[0] and "grpo-qwen" in got
