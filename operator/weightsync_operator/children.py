"""The full desired set of an RLJob's children, stamped with namespace, labels, owner and a spec hash.

Each child carries an ownerReference to its RLJob (controller, blocking owner
deletion), so deleting the RLJob deletes every child through the garbage
collector, and the annotation ``weightsync.io/spec-hash``. The reconciler writes
a child when it is missing, when its hash differs (the spec changed), or when it
drifted: someone changed a field the operator sets (``kubectl scale``, a new
image by hand), which ``covers`` finds by comparing what the operator would write
with the live object, field by field, ignoring what the API server adds.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kubernetes.utils import parse_quantity

from weightsync.resources import API_VERSION
from weightsync.resources.rljob import RLJobSpec
from weightsync_operator import names, networking, support, workloads
from weightsync_operator.capacity import Shape
from weightsync_operator.names import Component
from weightsync_operator.podspecs import Obj


@dataclass(frozen=True)
class Owner:
    """The RLJob a child belongs to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> Obj:
        return {
            "apiVersion": API_VERSION,
            "kind": "RLJob",
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def spec_hash(obj: Obj) -> str:
    """A short digest of what the operator would write, ignoring the hash annotation itself."""
    bare = obj
    if "metadata" in obj:  # copies of the two levels it changes only: a reconcile hashes every child on every pass
        meta = dict(obj["metadata"])
        if "annotations" in meta:
            kept = {k: v for k, v in meta["annotations"].items() if k != names.HASH_ANNOTATION}
            if kept:
                meta["annotations"] = kept
            else:
                del meta["annotations"]
        bare = {**obj, "metadata": meta}
    return hashlib.sha256(json.dumps(bare, sort_keys=True).encode()).hexdigest()[:16]


def stamp(obj: Obj, owner: Owner) -> Obj:
    """Namespace, labels, ownerReference and spec hash on ``obj`` (in place; returned for chaining)."""
    meta = obj.setdefault("metadata", {})
    meta["namespace"] = owner.namespace
    meta["labels"] = names.labels(owner.name) | meta.get("labels", {})
    meta["ownerReferences"] = [owner.reference()]
    meta.setdefault("annotations", {})[names.HASH_ANNOTATION] = spec_hash(obj)
    return obj


def current_hash(obj: Obj | None) -> str | None:
    if obj is None:
        return None
    value = obj.get("metadata", {}).get("annotations", {}).get(names.HASH_ANNOTATION)
    return str(value) if value is not None else None


def covers(live: object, want: object) -> bool:
    """Whether ``live`` holds every field of ``want`` with its value; fields only ``live`` has (the server's
    defaults, other managers' fields) do not count. Quantities compare by value (``1`` is ``"1"``, ``"1000m"``
    is ``"1"``); a ``None`` the operator writes is a field it leaves unset, and a zero value (``false``, ``0``,
    empty) is one the server may drop (Go's ``omitempty``)."""
    if live is None and not want and want is not None:
        return True
    if isinstance(want, dict):
        if not isinstance(live, dict):
            return False
        return all(covers(live.get(k), v) for k, v in want.items() if v is not None)
    if isinstance(want, list):
        return isinstance(live, list) and len(live) == len(want) and all(map(covers, live, want))
    if want == live:
        return True
    if isinstance(want, bool) or isinstance(live, bool) or want is None or live is None:
        return False
    try:
        return bool(parse_quantity(live) == parse_quantity(want))
    except (ValueError, TypeError, ArithmeticError):
        return False


def containers(pod: Obj) -> list[tuple[str, str, list[str], list[str]]]:
    """What a running pod may have had changed by hand (its images), with the commands that go with them: the
    rest of a pod's spec is immutable, and admission adds to it (token volumes), so it is not compared."""
    return [
        (c.get("name", ""), c.get("image", ""), list(c.get("command") or []), list(c.get("args") or []))
        for c in pod.get("spec", {}).get("containers", [])
    ]


def drifted(want: Obj, live: Obj | None) -> bool:
    """The child must be written: missing, another spec (its hash), or changed by hand since."""
    return live is None or current_hash(live) != current_hash(want) or not covers(live, want)


def desired(
    owner: Owner,
    spec: RLJobSpec,
    coordinator_image: str,
    coordinator_role: str,
    parked: bool,
    node_labels: dict[str, Obj] | None = None,
) -> list[Obj]:
    """Every child except the trainer pods and the token and TLS Secrets (which have their own life cycles);
    ``node_labels``: by component, those of the flavors Kueue admitted the job's pod sets on."""
    on = node_labels or {}
    objs = [
        *support.checkpoint_claim(owner.name, spec),
        support.job_config(owner.name, spec),
        *support.coordinator_identity(owner.name, coordinator_role),
        *networking.services(owner.name, spec),
        *networking.network_policies(owner.name, spec),
        workloads.coordinator(
            owner.name, owner.namespace, spec, coordinator_image, parked, on.get(Component.COORDINATOR)
        ),
        workloads.inference(owner.name, owner.namespace, spec, parked, on.get(Component.INFERENCE)),
    ]
    return [stamp(o, owner) for o in objs]


def trainer_pods(owner: Owner, spec: RLJobSpec, node_labels: Obj | None = None) -> list[Obj]:
    return [
        stamp(workloads.trainer_pod(owner.name, owner.namespace, spec, rank, node_labels), owner)
        for rank in range(spec.trainer.world_size)
    ]


def pod_specs(owner: Owner, spec: RLJobSpec, coordinator_image: str) -> dict[str, list[tuple[str, Obj]]]:
    """(name, pod spec) of each pod of the running job, by component: the very specs its pods get (the gang
    admission checks them against the nodes; Kueue's Workload carries them)."""
    coordinator = workloads.coordinator(owner.name, owner.namespace, spec, coordinator_image, parked=False)
    inference = workloads.inference(owner.name, owner.namespace, spec, parked=False)["spec"]["template"]["spec"]
    return {
        Component.COORDINATOR: [
            (names.child(owner.name, Component.COORDINATOR), coordinator["spec"]["template"]["spec"])
        ],
        Component.INFERENCE: [(names.inference_pod(owner.name, i), inference) for i in range(spec.inference.replicas)],
        Component.TRAINER: [(p["metadata"]["name"], p["spec"]) for p in trainer_pods(owner, spec)],
    }


def pod_shapes(owner: Owner, spec: RLJobSpec, coordinator_image: str) -> dict[str, list[Shape]]:
    """What each pod of the running job asks of a node, by component."""
    return {
        component: [Shape.of(name, pod) for name, pod in pods]
        for component, pods in pod_specs(owner, spec, coordinator_image).items()
    }


def token_secret(owner: Owner) -> Obj:
    return stamp(support.token_secret(owner.name), owner)


def tls_secret(owner: Owner) -> Obj:
    """A new CA and coordinator certificate each call: create it only when the Secret is missing."""
    return stamp(support.tls_secret(owner.name, owner.namespace), owner)
