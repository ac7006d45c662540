"""The RLJob resource: one RL training run with its vLLM fleet and how weights flow between them.

The spec is what a user writes in ``rljob.yaml``; the status is written by the
operator only. Rules that span fields (a quorum no larger than the fleet, GPUs a
multiple of the tensor-parallel size) and fields that may never change (the
trainer's world size, the checkpoint volume, the placement mode) are CEL rules in
the schema, so ``kubectl apply`` rejects a bad spec with a message naming the field
before any controller sees it. Phase is derived from the conditions, never set on
its own.
"""

from __future__ import annotations

import enum
import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field

from weightsync.jobconfig import DEFAULT_JOIN_TIMEOUT_S
from weightsync.resources._base import (
    ARG_LENGTH,
    DNS_LABEL,
    DNS_NAME,
    IMAGE_LENGTH,
    MAX_ARGS,
    Arg,
    Model,
    immutable,
    rules,
)
from weightsync.resources.conditions import Condition, is_true
from weightsync.resources.naming import DNS_1035, INFERENCE_POD_PORTS, MAX_REPLICAS, MAX_WORLD_SIZE, NAME_LIMIT
from weightsync.resources.naming import NAME_LIMITED_BY as _LIMITED_BY
from weightsync.vocabulary import Channel, PauseMode, SyncMode

QUANTITY = r"^([0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
"""A Kubernetes quantity without a sign (the CEL rule checks it exactly and that it is above zero)."""
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"  # an optional DNS-subdomain prefix
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
"""A label or taint key: an optional DNS-subdomain prefix and a name of at most 63 characters."""
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


def _positive(value: str) -> str:
    """The Python side of the CEL rule (the operator parses specs with these models too): the number before the
    suffix is above zero; the pattern has checked the form."""
    match = re.match(QUANTITY, value)
    try:
        positive = match is not None and Decimal(match.group(1)) > 0
    except InvalidOperation:
        positive = False
    if not positive:
        raise ValueError(f"{value!r} is not a positive quantity; write e.g. 8, 500m or 64Gi")
    return value


Quantity = Annotated[
    str,
    Field(
        pattern=QUANTITY,
        max_length=32,
        json_schema_extra=rules(
            (
                "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
                "must be a positive quantity, e.g. 8, 500m or 64Gi",
            )
        ),
    ),
    AfterValidator(_positive),
]


class EnvVar(Model):
    name: str = Field(description="Variable name.", min_length=1, max_length=DNS_NAME)
    value: str = Field(default="", description="Literal value.", max_length=ARG_LENGTH)


class Resources(Model):
    """CPU and memory for one pod's main container; GPUs have their own fields."""

    cpu: Quantity | None = Field(default=None, description="CPU request and limit, e.g. 8.")
    memory: Quantity | None = Field(default=None, description="Memory request and limit, e.g. 64Gi.")


class Trainer(Model):
    """The trainer ranks: one pod per rank with a stable name, gang-restarted on failure."""

    image: str = Field(
        description="Trainer image (weightsync[trainer] installed).", min_length=1, max_length=IMAGE_LENGTH
    )
    command: list[Arg] = Field(
        description="Command each rank runs; it calls weightsync's publish().", min_length=1, max_length=MAX_ARGS
    )
    world_size: int = immutable("Number of trainer ranks (pods); immutable.", default=1, ge=1, le=MAX_WORLD_SIZE)
    gpus_per_worker: int = Field(default=1, ge=0, le=64, description="nvidia.com/gpu per rank; 0 runs on the CPU.")
    resources: Resources = Field(default_factory=Resources, description="CPU and memory per rank.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra environment variables.")


class Inference(Model):
    """The vLLM replicas: a StatefulSet whose pods run vLLM, the weightsync agent and the OpenAI proxy."""

    image: str = Field(
        description="Inference image (vLLM with weightsync[inference]).", min_length=1, max_length=IMAGE_LENGTH
    )
    model: str = immutable(
        "Model name or path vLLM serves; immutable, since the trainer trains this one model.",
        min_length=1,
        max_length=ARG_LENGTH,
    )
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS, description="Number of vLLM replicas.")
    gpus_per_replica: int = Field(default=1, ge=0, le=64, description="nvidia.com/gpu per replica; 0 for CPU vLLM.")
    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="vLLM --tensor-parallel-size.")
    vllm_args: list[Arg] = Field(default_factory=list, max_length=MAX_ARGS, description="Extra vLLM server arguments.")
    port: int = Field(
        default=8000,
        ge=1024,
        le=65535,
        description="Port of the OpenAI-facing proxy and Service; not one the pod's other containers take ("
        + ", ".join(f"{port}: {what}" for port, what in INFERENCE_POD_PORTS.items())
        + ").",
        json_schema_extra=rules(
            (
                " && ".join(f"self != {port}" for port in INFERENCE_POD_PORTS),
                "must not be "
                + " or ".join(f"{port} ({what})" for port, what in INFERENCE_POD_PORTS.items())
                + ": the proxy shares the pod with them",
            )
        ),
    )
    resources: Resources = Field(default_factory=Resources, description="CPU and memory of the vLLM container.")


class AckPolicy(enum.StrEnum):
    ALL = "All"
    QUORUM = "Quorum"


class CheckpointVolume(Model):
    """The shared volume for checkpoints: the source for late joiners and recovery."""

    size: Quantity = Field(default="50Gi", description="Requested size of the claim.")
    storage_class_name: str | None = Field(
        default=None, max_length=DNS_NAME, description="StorageClass of the claim; the cluster default when unset."
    )
    access_mode: str = Field(
        default="ReadWriteMany",
        description="Access mode of the claim.",
        json_schema_extra={"enum": ["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"]},
    )
    existing_claim: str | None = Field(
        default=None, max_length=DNS_NAME, description="Use this PersistentVolumeClaim instead of creating one."
    )


_IMMUTABLE_VOLUME = rules(("self == oldSelf", "is immutable; delete and re-create the RLJob to change it"))


class Rdma(Model):
    """An extended resource that gives a pod RDMA devices (named by the cluster's RDMA device plugin)."""

    resource: str = Field(
        min_length=1, max_length=DNS_NAME, description="Resource name, e.g. rdma/ib or nvidia.com/hostdev."
    )
    count: int = Field(default=1, ge=1, le=64, description="Devices per pod.")


class Sync(Model):
    """How and how often weights move from the trainer to the replicas."""

    every_steps: int = Field(default=1, ge=1, description="Publish a version every N training steps.")
    channels: list[Channel] = Field(
        default=list(Channel),
        min_length=1,
        max_length=len(Channel),
        description="Channels in order of preference; the coordinator picks the first both sides reach.",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    ack_policy: AckPolicy = Field(
        default=AckPolicy.ALL, description="When a version is Ready: All live replicas, or a Quorum of them."
    )
    quorum: int | None = Field(default=None, ge=1, description="Replicas that must ack when ackPolicy is Quorum.")
    ready_without_acks: bool = Field(
        default=False,
        description="A version planned for no replica (none registered yet) is Ready instead of Failed.",
    )
    pause_mode: PauseMode = Field(
        default=PauseMode.KEEP,
        description="What a replica's pause for an update does with requests in flight: keep (continue them on "
        "the new weights; a completion that spans the update says both versions), wait (let them finish on the "
        "old weights first: every completion comes from one version) or abort (end them for the client to retry).",
    )
    mode: SyncMode = Field(
        default=SyncMode.IN_PLACE,
        description="How a replica takes a version in: in-place (pause for the whole transfer and load, no extra "
        "memory) or staged (receive beside generation into a second copy of the weights, then pause only to "
        "switch it in; a replica that cannot allocate the copy loads that version in place).",
    )
    all_or_nothing: bool = Field(
        default=False,
        description="Staged mode only: every replica stages a version and switches it in only once the replicas "
        "the ackPolicy needs have staged it; if they cannot (a replica fails to stage it, the timeout passes), the "
        "version fails and no replica switches (a replica that cannot allocate the stage fails it).",
    )
    timeout_seconds: int = Field(default=600, ge=1, le=86400, description="A version not acked in time is Failed.")
    transfer_timeout_seconds: int = Field(
        default=120,
        ge=1,
        le=3600,
        description="A transfer stalled this long (a peer died or is unreachable) is abandoned and the replica "
        "loads the version from the checkpoint volume.",
    )
    join_timeout_seconds: int = Field(
        default=int(DEFAULT_JOIN_TIMEOUT_S),
        ge=1,
        le=600,
        description="A version's replicas join its transfer within this (from its start), or the trainer sends to "
        "those that joined and the late one loads the version from the checkpoint volume, alone; also how far one "
        "replica may fall behind the others mid-transfer before it is left out the same way.",
    )
    retention: int = Field(default=3, ge=1, le=100, description="WeightVersion objects (and volume copies) kept.")
    rdma: Rdma | None = Field(
        default=None,
        description="RDMA devices for NCCL over InfiniBand/RoCE and NIXL: requested by the trainer and vLLM "
        "pods, which also get IPC_LOCK to pin the memory they register.",
    )
    checkpoint_volume: CheckpointVolume = Field(
        default_factory=CheckpointVolume,
        description="The checkpoint volume; immutable.",
        json_schema_extra=_IMMUTABLE_VOLUME,
    )


class PlacementMode(enum.StrEnum):
    COLOCATE = "Colocate"
    SPREAD = "Spread"


_TOLERATION_RULES = rules(
    (
        "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "tolerationSeconds needs effect NoExecute (only a NoExecute taint evicts, after that many seconds)",
        ".tolerationSeconds",
    ),
    (
        "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
        "operator must be Exists when key is empty (a toleration of every taint)",
        ".operator",
    ),
    (
        "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
        "value must be empty when operator is Exists",
        ".value",
    ),
)


class Toleration(Model):
    """A pod toleration, with the API server's own rules for pods (a bad one would be refused only when a pod is)."""

    model_config = ConfigDict(json_schema_extra=_TOLERATION_RULES)

    key: str | None = Field(
        default=None, max_length=316, pattern=QUALIFIED_NAME, description="Taint key; empty with Exists: every taint."
    )
    operator: str | None = Field(
        default=None, description="Exists or Equal.", json_schema_extra={"enum": ["Exists", "Equal"]}
    )
    value: str | None = Field(default=None, max_length=DNS_LABEL, pattern=LABEL_VALUE, description="Taint value.")
    effect: str | None = Field(
        default=None,
        description="Taint effect.",
        json_schema_extra={"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
    )
    toleration_seconds: int | None = Field(default=None, description="How long a NoExecute taint is tolerated.")


class Placement(Model):
    """Where GPU pods go: colocate trainer and replicas on one node (IPC/NVLink) or spread the replicas."""

    mode: PlacementMode = immutable("Colocate or Spread; immutable.", default=PlacementMode.SPREAD)
    node_selector: dict[str, Annotated[str, Field(max_length=DNS_LABEL, pattern=LABEL_VALUE)]] = Field(
        default_factory=dict,
        description="Node labels GPU pods require.",
        json_schema_extra={
            "maxProperties": 32,
            **rules(
                (
                    f"self.all(k, k.size() <= 316 && k.matches(r'{QUALIFIED_NAME}'))",
                    "keys must be label keys: an optional DNS-subdomain prefix and '/', then a name of at most 63 "
                    "letters, digits, '-', '_' and '.'",
                )
            ),
        },
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Tolerations of GPU pods (e.g. the GPU pool's taint)."
    )


class FailurePolicy(Model):
    max_restarts: int = Field(
        default=3, ge=0, le=1000, description="Trainer gang restarts allowed before the job is Failed."
    )


class Coordinator(Model):
    image: str | None = Field(
        default=None, max_length=IMAGE_LENGTH, description="Coordinator image; the operator's default when unset."
    )


class RLJobSpec(Model):
    trainer: Trainer
    inference: Inference
    sync: Sync = Field(default_factory=Sync, description="Sync policy.")
    placement: Placement = Field(default_factory=Placement, description="GPU pod placement.")
    coordinator: Coordinator = Field(default_factory=Coordinator, description="The coordinator.")
    failure_policy: FailurePolicy = Field(default_factory=FailurePolicy, description="Restart budget.")
    suspend: bool = Field(default=False, description="True removes every pod; false brings them back.")


RLJOB_SPEC_RULES = rules(
    (
        "self.sync.ackPolicy != 'Quorum' || has(self.sync.quorum)",
        "spec.sync.quorum is required when spec.sync.ackPolicy is Quorum",
        ".sync.quorum",
    ),
    (
        "!has(self.sync.quorum) || self.sync.quorum <= self.inference.replicas",
        "spec.sync.quorum must not exceed spec.inference.replicas",
        ".sync.quorum",
    ),
    (
        "self.sync.transferTimeoutSeconds < self.sync.timeoutSeconds",
        "spec.sync.transferTimeoutSeconds must be below spec.sync.timeoutSeconds: a transfer stalled on a replica "
        "that died is abandoned only after it, and the version would time out first for every replica",
        ".sync.transferTimeoutSeconds",
    ),
    (
        "self.sync.joinTimeoutSeconds < self.sync.transferTimeoutSeconds",
        "spec.sync.joinTimeoutSeconds must be below spec.sync.transferTimeoutSeconds: the join deadline is the "
        "short one, the transfer timeout bounds a transfer that started",
        ".sync.joinTimeoutSeconds",
    ),
    (
        "!self.sync.allOrNothing || self.sync.mode == 'staged'",
        "spec.sync.allOrNothing needs spec.sync.mode staged (replicas switch together from their stages)",
        ".sync.allOrNothing",
    ),
    (
        "self.inference.gpusPerReplica == 0 || self.inference.gpusPerReplica % self.inference.tensorParallelSize == 0",
        "spec.inference.gpusPerReplica must be a multiple of spec.inference.tensorParallelSize",
        ".inference.gpusPerReplica",
    ),
)


RLJOB_NAME_RULES = rules(
    (
        f"self.metadata.name.matches(r'{DNS_1035}')",
        "must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter and ending with a "
        "letter or digit (it names the job's Services)",
        ".metadata.name",
    ),
    (
        f"self.metadata.name.size() <= {NAME_LIMIT}",
        f"may have at most {NAME_LIMIT} characters: every name made from it must fit 63, and the longest is "
        f"{_LIMITED_BY}",
        ".metadata.name",
    ),
)
"""Rules on the object's name (CEL sees ``metadata.name`` at the root): a job whose children could not be named would
be accepted and never run."""


class JobPhase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionType(enum.StrEnum):
    """RLJob condition types; the phase is derived from them (see ``derive_phase``)."""

    RUNNING = "Running"  # every child up: trainer ranks and replicas ready
    SCHEDULED = "Scheduled"  # True when every pod the job should have has a node; else False, saying why
    ADMITTED = "Admitted"  # the gang admission (built-in, or Kueue) let the whole job have its pods at once
    APPLIED = "Applied"  # False when the API server refused a child (or a controller its pods), quoting it
    SUSPENDED = "Suspended"
    SYNCED = "Synced"  # the newest version is Ready on the fleet
    SUCCEEDED = "Succeeded"  # terminal: every trainer rank exited 0
    FAILED = "Failed"  # terminal: restart budget spent


class RLJobStatus(Model):
    phase: JobPhase = Field(default=JobPhase.PENDING, description="Derived from the conditions.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int = Field(default=0, ge=0, description="metadata.generation last reconciled.")
    replicas: int = Field(default=0, ge=0, description="Desired vLLM replicas.")
    ready_replicas: int = Field(default=0, ge=0, description="vLLM replicas ready.")
    ready: str = Field(default="0/0", max_length=32, description="Ready/desired replicas, for kubectl get.")
    trainer_ready: int = Field(default=0, ge=0, description="Trainer ranks running.")
    current_version: int | None = Field(default=None, ge=0, description="Newest Ready weight version.")
    replicas_loaded: int = Field(default=0, ge=0, description="Replicas that loaded the current version.")
    replicas_failed: int = Field(default=0, ge=0, description="Replicas that failed the current version.")
    last_sync_seconds: float | None = Field(
        default=None, ge=0, description="Total seconds of the current version's sync."
    )
    last_failed_version: int | None = Field(default=None, ge=0, description="Newest Failed weight version.")
    restarts: int = Field(default=0, ge=0, description="Trainer gang restarts so far; never reset.")


def derive_phase(status: RLJobStatus) -> JobPhase:
    """Phase from conditions: terminal ones win, then Suspended, then Running; else Pending."""
    for ctype, phase in (
        (ConditionType.FAILED, JobPhase.FAILED),
        (ConditionType.SUCCEEDED, JobPhase.SUCCEEDED),
        (ConditionType.SUSPENDED, JobPhase.SUSPENDED),
        (ConditionType.RUNNING, JobPhase.RUNNING),
    ):
        if is_true(status.conditions, ctype):
            return phase
    return JobPhase.PENDING


class RLJob(Model):
    api_version: str = Field(default="weightsync.io/v1alpha1", description="weightsync.io/v1alpha1")
    kind: str = Field(default="RLJob", description="RLJob")
    metadata: dict[str, object] = Field(default_factory=dict)
    spec: RLJobSpec
    status: RLJobStatus | None = None
