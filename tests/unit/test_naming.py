"""The job name's limit is computed from its children's names: a name at the limit fits every one, one more does not.

The operator's own children are built at the largest world size and replica count the CRD allows, and the labels the
StatefulSet controller adds to each replica pod are made as the controller makes them; every name that Kubernetes
requires to be a DNS label is checked. (e2e: ``test_operator_validation.py`` runs a job at the limit on the real
control plane.)
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from weightsync.resources import crds, naming
from weightsync.resources.rljob import RLJobSpec
from weightsync_operator import children

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BODY = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _largest() -> RLJobSpec:
    spec = copy.deepcopy(BODY["spec"])
    spec["trainer"]["worldSize"] = naming.MAX_WORLD_SIZE
    spec["inference"]["replicas"] = naming.MAX_REPLICAS
    return RLJobSpec.model_validate(spec)


def _dns_labels(job: str) -> dict[str, str]:
    """Every DNS label the cluster holds for ``job``'s children, by what it is."""
    owner = children.Owner(job, "ns", "uid")
    spec = _largest()
    out: dict[str, str] = {}
    objs: list[dict[str, Any]] = children.desired(owner, spec, "img", "role", parked=False)
    objs += children.trainer_pods(owner, spec)
    for obj in objs:
        kind, meta = obj["kind"], obj["metadata"]
        if kind == "Service":
            out[f"Service {meta['name']}"] = meta["name"]
        for key, value in meta.get("labels", {}).items():
            out[f"{kind} {meta['name']} label {key}"] = value
        if kind == "Pod":
            out[f"Pod {meta['name']} hostname"] = obj["spec"]["hostname"]
        if kind == "StatefulSet":  # what its controller adds to each replica pod
            name = meta["name"]
            out["controller-revision-hash"] = f"{name}-{'z' * naming.REVISION_HASH_LENGTH}"
            out["statefulset.kubernetes.io/pod-name"] = f"{name}-{naming.MAX_REPLICAS - 1}"
    return out


def test_a_name_at_the_limit_fits_every_child_and_one_more_does_not() -> None:
    assert naming.NAME_LIMIT == 42  # <name>-inference-<10-character hash> must fit 63
    at_limit = _dns_labels("a" * naming.NAME_LIMIT)
    too_long = {what: value for what, value in at_limit.items() if len(value) > 63 or not DNS_1123_LABEL.match(value)}
    assert not too_long, too_long
    over = _dns_labels("a" * (naming.NAME_LIMIT + 1))
    assert [what for what, value in over.items() if len(value) > 63] == ["controller-revision-hash"]


def test_every_service_the_operator_makes_is_in_the_limit_s_table() -> None:
    """A new Service (or a longer suffix) must move the limit: the table is what the limit is computed from."""
    table = {name for name, _ in naming.dns_labels("j")}
    owner = children.Owner("j", "ns", "uid")
    services = {
        o["metadata"]["name"] for o in children.desired(owner, _largest(), "i", "r", False) if o["kind"] == "Service"
    }
    assert services <= table, services - table


def test_the_crd_refuses_names_past_the_limit_and_not_dns_1035() -> None:
    schema = crds.crd(crds.RLJOB)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = {r["rule"]: r for r in schema["x-kubernetes-validations"]}
    assert f"self.metadata.name.size() <= {naming.NAME_LIMIT}" in rules
    assert any("matches" in rule and naming.DNS_1035 in rule for rule in rules)
    assert all(r["fieldPath"] == ".metadata.name" for r in rules.values())
    assert schema["properties"]["metadata"]["properties"] == {"name": {"type": "string"}}


def test_the_proxy_port_may_not_take_a_port_of_its_pod() -> None:
    port = crds.crd(crds.RLJOB)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "inference"
    ]["properties"]["port"]
    assert port["x-kubernetes-validations"][0]["rule"] == "self != 8001 && self != 9400 && self != 8002"


@pytest.mark.parametrize("value", ["0", "0.0Gi", "-1", "+1", "-5Gi", "1.2.3", ""])
def test_quantities_must_be_positive(value: str) -> None:
    spec = copy.deepcopy(BODY["spec"])
    spec["trainer"]["resources"]["cpu"] = value
    with pytest.raises(ValidationError, match="cpu"):
        RLJobSpec.model_validate(spec)


@pytest.mark.parametrize("value", ["500m", "8", "0.5", "64Gi", "1e3", "1.5G"])
def test_positive_quantities_pass(value: str) -> None:
    spec = copy.deepcopy(BODY["spec"])
    spec["sync"]["checkpointVolume"]["size"] = value
    assert RLJobSpec.model_validate(spec).sync.checkpoint_volume.size == value
