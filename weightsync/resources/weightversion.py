"""The WeightVersion resource: one published weight version of one RLJob, as the fleet saw it.

Ownership (DESIGN.md): the coordinator creates these objects and is the only
writer of their status, a few times per version (opened, Ready/Failed, durable),
never once per replica ack, so a large fleet does not turn into an API-server
write storm. The operator only reads them, reflects the current one into the
RLJob's status and deletes those beyond the job's retention. The spec describes
bytes that already exist, so all of it is immutable.

Names are ``<job>-v<version>`` and carry the label ``weightsync.io/job``; the
coordinator sets an ownerReference to the RLJob so they go with it.
"""

from __future__ import annotations

from pydantic import Field, JsonValue

from weightsync.resources._base import DNS_NAME, Model, ReplicaName, rules
from weightsync.vocabulary import Channel, ReplicaState, SyncPhase, VersionState

JOB_LABEL = "weightsync.io/job"
MAX_LISTED_REPLICAS = 16
"""Failed and lagging replica names are capped here: the counts stay exact, the names are examples."""
MAX_REPLICA_ENTRIES = 64
"""Per-replica entries (name, channel, state) are capped here, so a status stays small in a large fleet."""
MAX_SUMMARY = 512
DIGEST_PATTERN = r"^(sha256:[0-9a-f]{64})?$"

PHASES: list[JsonValue] = [state.phase for state in VersionState]


def version_name(job: str, version: int) -> str:
    """The object name of ``version`` of ``job``."""
    return f"{job}-v{version}"


class ChannelShare(Model):
    """How many replicas the plan sends this version to over one channel."""

    channel: Channel = Field(description="Channel name.")
    replicas: int = Field(ge=0, description="Replicas planned on this channel.")


class WeightVersionSpec(Model):
    job: str = Field(min_length=1, max_length=DNS_NAME, description="Name of the RLJob in this namespace.")
    version: int = Field(ge=1, description="Version number, monotonic per job.")
    step: int = Field(ge=0, description="Training step the weights come from.")
    bytes: int = Field(ge=0, description="Bytes of one full copy of the weights.")
    layout_digest: str = Field(
        default="",
        max_length=80,
        pattern=DIGEST_PATTERN,
        description="Digest of the tensor table's layout: names, dtypes, shapes, offsets (sha256:<hex>).",
    )
    channel_plan: list[ChannelShare] = Field(
        default_factory=list,
        max_length=len(Channel),
        description="Replicas per channel in the plan.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["channel"]},
    )


class PhaseSeconds(Model):
    """Seconds spent per sync phase (the slowest replica for transfer, load and verify)."""

    publish: float | None = Field(default=None, ge=0)
    transfer: float | None = Field(default=None, ge=0)
    load: float | None = Field(default=None, ge=0)
    verify: float | None = Field(default=None, ge=0)
    total: float | None = Field(default=None, ge=0)
    pause: float | None = Field(default=None, ge=0)
    resume: float | None = Field(default=None, ge=0)


assert set(PhaseSeconds.model_fields) == {p.value for p in SyncPhase}, "PhaseSeconds must follow SyncPhase"


class ReplicaEntry(Model):
    """One replica's part in this version."""

    name: ReplicaName = Field(description="Replica id (its pod name).")
    channel: Channel | None = Field(default=None, description="Channel it was planned on.")
    state: ReplicaState = Field(
        description="planned, joined, staged (all-or-nothing: waits to switch), loaded, failed or dropped."
    )


class WeightVersionStatus(Model):
    phase: str = Field(
        default=VersionState.STAGING.phase,
        description="Staging, Ready, Failed or Superseded.",
        json_schema_extra={"enum": PHASES},
    )
    durable: bool = Field(default=False, description="The checkpoint volume holds this version's manifest.")
    replicas_loaded: int = Field(default=0, ge=0, description="Replicas that loaded and verified it.")
    replicas_failed: int = Field(default=0, ge=0, description="Replicas whose load failed.")
    failed_replicas: list[ReplicaName] = Field(
        default_factory=list, max_length=MAX_LISTED_REPLICAS, description="Some failed replicas (capped)."
    )
    lagging_replicas: list[ReplicaName] = Field(
        default_factory=list, max_length=MAX_LISTED_REPLICAS, description="Some replicas not yet on it (capped)."
    )
    replicas: list[ReplicaEntry] = Field(
        default_factory=list, max_length=MAX_REPLICA_ENTRIES, description="Each replica's channel and state (capped)."
    )
    replica_states: str = Field(
        default="", max_length=MAX_SUMMARY, description="The replicas' states in one line, for kubectl get."
    )
    manifest_checksum: str = Field(
        default="",
        max_length=80,
        pattern=DIGEST_PATTERN,
        description="Checksum of the volume copy's manifest.json, once durable (sha256:<hex>).",
    )
    content_digest: str = Field(
        default="",
        max_length=80,
        pattern=DIGEST_PATTERN,
        description="Digest over the per-tensor digests the trainer sent; replicas' engines must match it.",
    )
    phase_seconds: PhaseSeconds = Field(default_factory=PhaseSeconds, description="Seconds per sync phase.")
    message: str = Field(default="", max_length=4096, description="Why it failed, if it did.")


def replica_states(entries: list[ReplicaEntry]) -> str:
    """``name=state/channel`` for each replica, in one line capped for a printer column."""
    # the models keep enum values (use_enum_values): state and channel are plain strings here
    text = " ".join(
        f"{e.name}={ReplicaState(e.state).value}/{Channel(e.channel).value if e.channel else '-'}" for e in entries
    )
    return text if len(text) <= MAX_SUMMARY else text[: MAX_SUMMARY - 3] + "..."


WEIGHTVERSION_SPEC_RULES = rules(("self == oldSelf", "is immutable: a version describes bytes already published"))


class WeightVersion(Model):
    api_version: str = Field(default="weightsync.io/v1alpha1", description="weightsync.io/v1alpha1")
    kind: str = Field(default="WeightVersion", description="WeightVersion")
    metadata: dict[str, object] = Field(default_factory=dict)
    spec: WeightVersionSpec
    status: WeightVersionStatus | None = None
