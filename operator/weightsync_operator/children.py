"""The full desired set of an RLJob's children, stamped with namespace, labels, owner and a spec hash.

Each child carries an ownerReference to its RLJob (controller, blocking owner
deletion), so deleting the RLJob deletes every child through the garbage
collector, and the annotation ``weightsync.io/spec-hash``: the reconciler writes
a child only when it is missing or its hash differs, so a steady job costs reads,
not writes.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

from weightsync.resources import API_VERSION
from weightsync.resources.rljob import RLJobSpec
from weightsync_operator import names, networking, support, workloads
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
    bare = copy.deepcopy(obj)
    meta = bare.get("metadata", {})
    meta.get("annotations", {}).pop(names.HASH_ANNOTATION, None)
    if not meta.get("annotations", True):
        del meta["annotations"]
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


def desired(owner: Owner, spec: RLJobSpec, coordinator_image: str, coordinator_role: str, parked: bool) -> list[Obj]:
    """Every child except the trainer pods and the token and TLS Secrets (which have their own life cycles)."""
    objs = [
        *support.checkpoint_claim(owner.name, spec),
        support.job_config(owner.name, spec),
        *support.coordinator_identity(owner.name, coordinator_role),
        *networking.services(owner.name, spec),
        *networking.network_policies(owner.name, spec),
        workloads.coordinator(owner.name, owner.namespace, spec, coordinator_image, parked),
        workloads.inference(owner.name, owner.namespace, spec, parked),
    ]
    return [stamp(o, owner) for o in objs]


def trainer_pods(owner: Owner, spec: RLJobSpec) -> list[Obj]:
    return [
        stamp(workloads.trainer_pod(owner.name, owner.namespace, spec, rank), owner)
        for rank in range(spec.trainer.world_size)
    ]


def token_secret(owner: Owner) -> Obj:
    return stamp(support.token_secret(owner.name), owner)


def tls_secret(owner: Owner) -> Obj:
    """A new CA and coordinator certificate each call: create it only when the Secret is missing."""
    return stamp(support.tls_secret(owner.name, owner.namespace), owner)
