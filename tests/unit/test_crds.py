"""The CRDs: generated from the models, structural, with the rules and columns users rely on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from weightsync.resources import crds
from weightsync.resources.rljob import RLJobSpec
from weightsync.resources.weightversion import PhaseSeconds, WeightVersionSpec
from weightsync.vocabulary import Channel, SyncPhase, VersionState

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob.yaml"


def test_generated_crds_match_the_models() -> None:
    """crds/ and the chart's copy are exactly what `weightsync crds` writes (run it when this fails)."""
    assert crds.stale(REPO) == []


def _walk(node: Any, path: str = "") -> Any:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


@pytest.mark.parametrize("resource", crds.RESOURCES, ids=lambda r: r.kind)
def test_schema_is_structural(resource: crds.Resource) -> None:
    schema = crds.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if path.endswith((".properties", "x-kubernetes-validations")) or "[" in path.split(".")[-1]:
            continue
        if "type" in node or "description" in node:
            assert "type" in node, f"{path} has no type"
        assert node.get("default", 0) is not None, f"{path} has a null default"


def test_rljob_crd_names_columns_and_subresources() -> None:
    doc = crds.crd(crds.RLJOB)
    names = doc["spec"]["names"]
    assert names["shortNames"] == ["rlj"] and "weightsync" in names["categories"]
    version = doc["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    for name in ("Phase", "Ready", "Version", "Last Sync", "Age"):
        assert columns[name].get("priority", 0) == 0, name
    assert columns["Restarts"]["priority"] == 1


def test_rules_and_immutable_fields_are_in_the_schema() -> None:
    spec = crds.crd(crds.RLJOB)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    messages = [r["message"] for r in spec["x-kubernetes-validations"]]
    assert any("spec.sync.quorum" in m for m in messages)
    assert spec["properties"]["trainer"]["properties"]["worldSize"]["x-kubernetes-validations"][0]["rule"] == (
        "self == oldSelf"
    )
    assert spec["properties"]["sync"]["properties"]["checkpointVolume"]["x-kubernetes-validations"]
    assert spec["properties"]["inference"]["properties"]["model"]["x-kubernetes-validations"][0]["rule"] == (
        "self == oldSelf"
    )
    channels = spec["properties"]["sync"]["properties"]["channels"]
    assert channels["items"]["enum"] == [c.value for c in Channel]


def test_weightversion_speaks_the_shared_vocabulary() -> None:
    status = crds.crd(crds.WEIGHTVERSION)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["phase"]["enum"] == [s.phase for s in VersionState]
    assert set(status["properties"]["phaseSeconds"]["properties"]) == {p.value for p in SyncPhase}
    assert set(PhaseSeconds.model_fields) == {p.value for p in SyncPhase}
    assert status["properties"]["failedReplicas"]["maxItems"] == 16


def test_example_parses_and_defaults_fill_in() -> None:
    spec = RLJobSpec.model_validate(yaml.safe_load(EXAMPLE.read_text())["spec"])
    assert spec.inference.replicas == 2 and spec.sync.channels == ["nccl", "volume"]
    assert spec.sync.checkpoint_volume.access_mode == "ReadWriteMany"
    minimal = RLJobSpec.model_validate(
        {"trainer": {"image": "t", "command": ["x"]}, "inference": {"image": "i", "model": "m"}}
    )
    assert minimal.sync.channels == [c.value for c in Channel] and minimal.failure_policy.max_restarts == 3


def test_model_errors_name_the_field() -> None:
    with pytest.raises(ValidationError) as err:
        RLJobSpec.model_validate(
            {"trainer": {"image": "t", "command": ["x"]}, "inference": {"image": "i", "model": "m", "replicas": 0}}
        )
    assert "inference.replicas" in str(err.value)
    with pytest.raises(ValidationError) as err:
        WeightVersionSpec.model_validate(
            {"job": "j", "version": 1, "step": 0, "bytes": 1, "channelPlan": [{"channel": "rdma", "replicas": 1}]}
        )
    assert "channelPlan.0.channel" in str(err.value)


def test_generated_yaml_is_stable_and_headed() -> None:
    text = crds.render(crds.RLJOB)
    assert text.startswith(crds.HEADER) and text == crds.render(crds.RLJOB)
    assert yaml.safe_load(text)["metadata"]["name"] == "rljobs.weightsync.io"
