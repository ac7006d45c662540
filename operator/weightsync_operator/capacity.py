"""Whether a set of pods fits the nodes' free capacity: the model the built-in gang admission checks jobs against.

Pure functions over Node and Pod objects as the API server returns them. A pod
needs its containers' requests (a limit stands in for a request it lacks, as the
API server defaults it: ``nvidia.com/gpu`` is set as a limit only) and one pod
slot; a node offers its ``allocatable`` minus what the pods bound to it request,
if it is Ready and schedulable, its labels match the pod's nodeSelector and the
pod tolerates its NoSchedule and NoExecute taints. ``place`` puts pods
largest-first, each on the first node with room (all on one node for a
colocated job), on a copy: nothing changes unless every pod found a node.

It is a model of the scheduler, not the scheduler: other pods' affinity, volume
topology and the scheduler's own scoring (which may spread pods where this packs
them) are not in it. A job it admits can still wait for the scheduler, whose
words then fill the job's ``Scheduled`` condition.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

Obj = dict[str, Any]
PODS = "pods"
"""The pod slots of a node (its ``allocatable.pods``)."""
TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Shape:
    """What one pod asks of a node."""

    name: str
    requests: dict[str, Decimal]
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[tuple[str, str, str, str], ...] = ()  # key, operator, value, effect

    @classmethod
    def of(cls, name: str, pod_spec: Obj) -> Shape:
        """The shape of a pod with spec ``pod_spec`` (a Pod's, or a workload's template's)."""
        total: dict[str, Decimal] = {PODS: Decimal(1)}
        for container in pod_spec.get("containers", []):
            resources = container.get("resources") or {}
            amounts = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for resource, amount in amounts.items():
                total[resource] = total.get(resource, Decimal(0)) + parse_quantity(amount)
        tolerations = tuple(
            (t.get("key") or "", t.get("operator") or "Equal", t.get("value") or "", t.get("effect") or "")
            for t in pod_spec.get("tolerations") or []
        )
        return cls(name, total, dict(pod_spec.get("nodeSelector") or {}), tolerations)

    def tolerates(self, taint: Obj) -> bool:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            return True  # PreferNoSchedule only steers the scheduler
        for key, operator, value, effect in self.tolerations:
            if effect and effect != taint.get("effect"):
                continue
            if not key and operator == "Exists":
                return True
            if key == taint.get("key") and (operator == "Exists" or value == (taint.get("value") or "")):
                return True
        return False


@dataclass
class Node:
    name: str
    free: dict[str, Decimal]
    allocatable: dict[str, Decimal]
    labels: dict[str, str]
    taints: list[Obj]

    def admits(self, shape: Shape) -> bool:
        """Whether ``shape`` may go here at all (labels, taints), room aside."""
        return all(self.labels.get(k) == v for k, v in shape.node_selector.items()) and all(
            shape.tolerates(t) for t in self.taints
        )

    def room(self, shape: Shape) -> bool:
        return all(self.free.get(r, Decimal(0)) >= amount for r, amount in shape.requests.items() if amount)

    def take(self, shape: Shape) -> None:
        for resource, amount in shape.requests.items():
            self.free[resource] = self.free.get(resource, Decimal(0)) - amount


def _schedulable(node: Obj) -> bool:
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in node.get("status", {}).get("conditions", [])
    )
    return ready and not node.get("spec", {}).get("unschedulable")


def nodes(node_objs: Iterable[Obj], pods: Iterable[Obj]) -> list[Node]:
    """Every Ready, schedulable node with what the pods bound to it (and not finished) leave free."""
    out = {}
    for obj in node_objs:
        if not _schedulable(obj):
            continue
        allocatable = {r: parse_quantity(q) for r, q in (obj.get("status", {}).get("allocatable") or {}).items()}
        meta = obj["metadata"]
        out[meta["name"]] = Node(
            meta["name"], dict(allocatable), allocatable, dict(meta.get("labels") or {}), obj["spec"].get("taints", [])
        )
    for pod in pods:
        node = out.get(pod.get("spec", {}).get("nodeName") or "")
        if node is not None and pod.get("status", {}).get("phase") not in TERMINAL:
            node.take(Shape.of(pod["metadata"]["name"], pod["spec"]))
    return sorted(out.values(), key=lambda n: n.name)


def _size(shape: Shape) -> tuple[Decimal, ...]:
    gpus = sum((a for r, a in shape.requests.items() if "/" in r), Decimal(0))  # extended resources: GPUs, RDMA
    return (gpus, shape.requests.get("cpu", Decimal(0)), shape.requests.get("memory", Decimal(0)))


def place(free: list[Node], shapes: list[Shape], colocate: bool = False) -> list[Node] | None:
    """``free`` after every pod of ``shapes`` took a node (largest first, first node with room), or None when one
    finds none; with ``colocate``, all of them on the same node."""
    order = sorted(shapes, key=_size, reverse=True)
    candidates = [[n] for n in free] if colocate else [free]
    for group in candidates:
        trial = copy.deepcopy(group)
        if all(_take_first(trial, shape) for shape in order):
            by_name = {n.name: n for n in trial}
            return [by_name.get(n.name, n) for n in free]
    return None


def _take_first(free: list[Node], shape: Shape) -> bool:
    for node in free:
        if node.admits(shape) and node.room(shape):
            node.take(shape)
            return True
    return False


def shortfall(free: list[Node], shapes: list[Shape]) -> str:
    """Why ``shapes`` do not fit ``free``, in words: a pod no node may take even empty, a resource short in total,
    or pods that do not pack."""
    for shape in shapes:
        eligible = [n for n in free if n.admits(shape)]
        if not eligible:
            return f"pod {shape.name} matches no Ready node (its nodeSelector, or a taint it does not tolerate)"
        if not any(all(n.allocatable.get(r, Decimal(0)) >= a for r, a in shape.requests.items()) for n in eligible):
            wants = ", ".join(_fmt(a, r) for r, a in sorted(shape.requests.items()) if r != PODS)
            return f"pod {shape.name} asks for {wants}: more than any node it may use has allocatable"
    needed: dict[str, Decimal] = {}
    for shape in shapes:
        for resource, amount in shape.requests.items():
            needed[resource] = needed.get(resource, Decimal(0)) + amount
    eligible_nodes = [n for n in free if any(n.admits(s) for s in shapes)]
    for resource, amount in sorted(needed.items(), key=lambda item: ("/" not in item[0], item[0])):
        available = sum((max(n.free.get(resource, Decimal(0)), Decimal(0)) for n in eligible_nodes), Decimal(0))
        if available < amount:
            return (
                f"it needs {_fmt(amount, resource)} in all; the nodes it may use have {_fmt(available, resource)} free"
            )
    return "its pods do not pack onto the nodes' free capacity together"


def _fmt(amount: Decimal, resource: str) -> str:
    """``64Gi memory``, ``8 cpu``, ``500m cpu``, ``4 nvidia.com/gpu``."""
    if resource in ("memory", "ephemeral-storage"):
        return f"{amount / 2**30:g}Gi {resource}"
    if resource == "cpu" and amount != amount.to_integral_value():
        return f"{amount * 1000:.0f}m cpu"
    return f"{amount.normalize():f} {resource}"
