"""The built-in gang admission: jobs are admitted whole against the nodes' free capacity, in creation order.

The nodes and pods are the e2e cluster's shape (two nodes of 8 GPUs behind the GPU taint, a CPU node); the jobs are
``examples/rljob.yaml`` (2 trainer ranks and 2 replicas of 1 GPU each, a coordinator). The e2e test
(``test_operator_gang.py``) runs the same on the real control plane.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync.resources.rljob import RLJobSpec
from weightsync_operator import admission, capacity, children
from weightsync_operator.admission import Gate, Want
from weightsync_operator.capacity import Shape

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BODY = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def _node(name: str, gpus: int, taint: bool = True, ready: bool = True) -> dict[str, Any]:
    allocatable = {"cpu": "96", "memory": "1536Gi", "pods": "110"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
    labels = {"nvidia.com/gpu.present": "true"} if gpus else {}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": [TAINT] if taint else []},
        "status": {"allocatable": allocatable, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


NODES = [_node("gpu-node-0", 8), _node("gpu-node-1", 8), _node("cpu-node-0", 0, taint=False)]


class FakeApi:
    def __init__(self, nodes: list[dict[str, Any]] = NODES) -> None:
        self.nodes, self.pods = nodes, list[dict[str, Any]]()
        self.lists = 0

    def list(self, kind: str, namespace: str, label_selector: str, field_selector: str = "") -> list[dict[str, Any]]:
        self.lists += 1
        return copy.deepcopy(self.nodes if kind == "Node" else self.pods)


def _want(job: str, created: str, **changes: Any) -> Want:
    spec = copy.deepcopy(BODY["spec"])
    for section, values in changes.items():
        spec[section].update(values)
    parsed = RLJobSpec.model_validate(spec)
    shapes = children.pod_shapes(children.Owner(job, "ns", "uid"), parsed, "coordinator:1")
    return Want(created, shapes, parsed.placement.mode == "Colocate")


def _bind(api: FakeApi, key: tuple[str, str], want: Want) -> None:
    """The granted job's pods, placed as the scheduler would (first node with room)."""
    free = capacity.nodes(api.nodes, api.pods)
    for component, shapes in want.pods.items():
        for shape in shapes:
            node = next(n for n in free if n.admits(shape) and n.room(shape))
            node.take(shape)
            resources = {"limits": {r: str(a) for r, a in shape.requests.items() if r != "pods"}}
            api.pods.append(
                {
                    "metadata": {"name": shape.name, "namespace": key[0], "labels": _labels(key[1], component)},
                    "spec": {"nodeName": node.name, "containers": [{"resources": resources}]},
                    "status": {"phase": "Running"},
                }
            )


def _labels(job: str, component: str) -> dict[str, str]:
    return {"weightsync.io/job": job, "app.kubernetes.io/component": component}


def test_ten_jobs_on_sixteen_gpus_run_four_at_a_time_whole_and_in_turn() -> None:
    api, woken = FakeApi(), list[tuple[str, str]]()
    clock = [0.0]
    gate = Gate(api, woken.append, clock=lambda: clock[0])  # type: ignore[arg-type]
    wants = {("ns", f"job-{i}"): _want(f"job-{i}", f"2026-01-01T00:00:{i:02d}Z") for i in range(10)}
    answers = {key: gate.decide(key, want, holds=False) for key, want in wants.items()}
    admitted = [key for key, answer in answers.items() if answer.admitted]
    assert admitted == [("ns", f"job-{i}") for i in range(4)]  # 4 GPUs each: four fit 16, in creation order
    assert (
        "it needs 4 nvidia.com/gpu in all; the nodes it may use have 0 nvidia.com/gpu free"
        in answers[("ns", "job-4")].message
    )
    assert gate.rounds == 1 and api.lists == 2  # the first job's round; the others fitted on what it left
    clock[0] += 1
    assert not gate.decide(("ns", "job-9"), wants[("ns", "job-9")], holds=False).admitted and gate.rounds == 1
    for key in admitted:
        _bind(api, key, wants[key])

    # job-1 finishes: its room goes back (its pods are gone) and the queue is woken; job-4 is next
    api.pods = [p for p in api.pods if p["metadata"]["labels"]["weightsync.io/job"] != "job-1"]
    gate.release(("ns", "job-1"))
    assert set(woken) == {("ns", f"job-{i}") for i in range(4, 10)}
    clock[0] += 1
    later = {key: gate.decide(key, wants[key], holds=False) for key in sorted(set(woken))}
    assert [key for key, answer in later.items() if answer.admitted] == [("ns", "job-4")]


def test_a_granted_job_keeps_room_for_the_pods_it_has_not_created_yet() -> None:
    api = FakeApi()
    gate = Gate(api, lambda key: None)
    first = _want("a", "1")
    assert gate.decide(("ns", "a"), first, holds=False).admitted  # granted, no pod created yet
    gate._round = None  # a later round, with none of a's pods in the cluster
    for i in range(3):
        assert gate.decide(("ns", f"b{i}"), _want(f"b{i}", f"2{i}"), holds=False).admitted
    gate._round = None
    assert not gate.decide(("ns", "c"), _want("c", "3"), holds=False).admitted  # a's 4 GPUs are held for it


def test_pods_waiting_for_a_node_keep_their_room() -> None:
    api = FakeApi()
    shapes = [Shape("other", {"nvidia.com/gpu": capacity.Decimal(7), "pods": capacity.Decimal(1)})]
    for node in ("0", "1"):
        spec = {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "7"}}}], "tolerations": [TAINT]}
        api.pods.append({"metadata": {"name": f"other-{node}"}, "spec": spec, "status": {"phase": "Pending"}})
    assert shapes
    answer = Gate(api, lambda key: None).decide(("ns", "j"), _want("j", "1"), holds=False)
    assert not answer.admitted and "have 2 nvidia.com/gpu free" in answer.message  # 16 - 2 x 7 pending


def test_a_job_with_pods_or_admitted_before_keeps_its_grant_without_a_round() -> None:
    api = FakeApi(nodes=[])
    gate = Gate(api, lambda key: None)
    assert gate.decide(("ns", "j"), _want("j", "1"), holds=True).admitted and api.lists == 0


def test_a_job_bigger_than_any_node_says_so() -> None:
    answer = Gate(FakeApi(), lambda key: None).decide(
        ("ns", "j"), _want("j", "1", inference={"gpusPerReplica": 16}), False
    )
    assert not answer.admitted
    assert "asks for" in answer.message and "16 nvidia.com/gpu" in answer.message
    assert "more than any node it may use has allocatable" in answer.message


def test_colocated_jobs_need_one_node_with_room_for_all_their_gpu_pods() -> None:
    api = FakeApi(nodes=[_node("gpu-node-0", 3), _node("gpu-node-1", 3), _node("cpu-node-0", 0, taint=False)])
    spread = Gate(api, lambda key: None).decide(("ns", "s"), _want("s", "1"), False)
    assert spread.admitted  # 4 GPUs over two nodes of 3
    colocated = _want("c", "1", placement={"mode": "Colocate"})
    assert not Gate(api, lambda key: None).decide(("ns", "c"), colocated, False).admitted


def test_taints_selectors_and_unready_nodes() -> None:
    untolerated = _want("u", "1", placement={"tolerations": []})
    answer = Gate(FakeApi(), lambda key: None).decide(("ns", "u"), untolerated, False)
    assert not answer.admitted and "matches no Ready node" in answer.message
    down = FakeApi(nodes=[_node("gpu-node-0", 8, ready=False), _node("cpu-node-0", 0, taint=False)])
    assert not Gate(down, lambda key: None).decide(("ns", "d"), _want("d", "1"), False).admitted


def test_requests_default_to_limits_and_finished_pods_free_their_node() -> None:
    pod_spec = {
        "containers": [{"resources": {"limits": {"nvidia.com/gpu": "2", "cpu": "4"}, "requests": {"cpu": "1"}}}]
    }
    shape = Shape.of("p", pod_spec)
    assert shape.requests == {"pods": 1, "nvidia.com/gpu": 2, "cpu": 1}
    done = {"metadata": {"name": "d"}, "spec": {"nodeName": "gpu-node-0", **pod_spec}, "status": {"phase": "Succeeded"}}
    running = copy.deepcopy(done) | {"status": {"phase": "Running"}}
    assert capacity.nodes(NODES, [done])[1].free["nvidia.com/gpu"] == 8
    assert capacity.nodes(NODES, [running])[1].free["nvidia.com/gpu"] == 6


def test_recheck_and_freshness_bound_the_gate_s_cost() -> None:
    assert admission.FRESH_S <= admission.RECHECK_S
