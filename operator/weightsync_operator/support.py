"""The children that are not pods: checkpoint claim, job config, token and TLS Secrets, the coordinator's identity.

- The checkpoint PersistentVolumeClaim (unless the spec names an existing one):
  ReadWriteMany by default since the trainer writes and every replica reads.
- The ConfigMap ``job.json``: the spec's sync policy and sizes, read by the
  coordinator, the trainer ranks and the agents, so the three agree on one copy.
- The token Secret: a random bearer token the coordinator checks on every call.
  Created once and never re-applied (see kubeapi), so it never changes under a
  running job; it goes with the RLJob through its ownerReference.
- The TLS Secret ``<job>-tls`` (type kubernetes.io/tls plus ``ca.crt``): the
  job's CA and the coordinator's server certificate and key (see certs). Made
  only when the Secret is missing and created, never applied, like the token:
  a replayed event or a restarted operator keeps the material the pods use.
- The coordinator's ServiceAccount and a RoleBinding to the chart's
  ``weightsync-coordinator`` ClusterRole (WeightVersion objects and their status):
  the operator holds only ``bind`` on that role, not the permissions in it.
"""

from __future__ import annotations

import base64
import json
import secrets

from weightsync.resources import GROUP
from weightsync.resources.jobfile import JobFile
from weightsync.resources.rljob import RLJobSpec
from weightsync.vocabulary import Channel
from weightsync_operator import certs, names
from weightsync_operator.podspecs import Obj


def checkpoint_claim(job: str, spec: RLJobSpec) -> list[Obj]:
    volume = spec.sync.checkpoint_volume
    if volume.existing_claim:
        return []
    claim: Obj = {
        "accessModes": [volume.access_mode],
        "resources": {"requests": {"storage": volume.size}},
    }
    if volume.storage_class_name:
        claim["storageClassName"] = volume.storage_class_name
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": names.checkpoint_claim(job)},
            "spec": claim,
        }
    ]


def job_config(job: str, spec: RLJobSpec) -> Obj:
    """What the coordinator, trainer and agents share: the sync policy and the sizes it depends on.

    ``ncclDomain``: the job's GPU pods are taken to reach each other over NCCL (one NVLink/IB/RoCE
    fabric for the job's node pool), so they share one domain, the job's name, whenever the job lists
    the nccl channel; a job whose nodes do not reach each other over NCCL leaves nccl out of its channels.
    """
    config = JobFile.of(job, spec, names.CHECKPOINT_MOUNT, nccl=Channel.NCCL in spec.sync.channels).to_wire()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": names.config_map(job)},
        "data": {"job.json": json.dumps(config, indent=2, sort_keys=True)},
    }


def token_secret(job: str) -> Obj:
    token = base64.b64encode(secrets.token_urlsafe(32).encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": names.token_secret(job)},
        "type": "Opaque",
        "data": {names.TOKEN_KEY: token},
    }


def tls_secret(job: str, namespace: str) -> Obj:
    """Fresh TLS material for the job's coordinator Service (call only when the Secret does not exist)."""
    issued = certs.issue(names.child(job, names.Component.COORDINATOR), namespace, job)

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": names.tls_secret(job)},
        "type": "kubernetes.io/tls",
        "data": {
            names.TLS_CERT_KEY: b64(issued.cert),
            names.TLS_KEY_KEY: b64(issued.key),
            names.TLS_CA_KEY: b64(issued.ca_cert),
        },
    }


def coordinator_identity(job: str, cluster_role: str) -> list[Obj]:
    account = names.coordinator_account(job)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": account},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
            "subjects": [{"kind": "ServiceAccount", "name": account}],
        },
    ]


ROLE_RULES: list[Obj] = [
    {
        "apiGroups": [GROUP],
        "resources": ["weightversions"],
        "verbs": ["get", "list", "watch", "create", "update", "patch"],
    },
    {"apiGroups": [GROUP], "resources": ["weightversions/status"], "verbs": ["get", "update", "patch"]},
    {"apiGroups": [GROUP], "resources": ["rljobs"], "verbs": ["get", "list", "watch"]},
]
"""The coordinator's permissions (the chart's ClusterRole renders these; a unit test compares)."""
