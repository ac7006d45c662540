"""The one vocabulary shared by the proto, the CRDs, the metrics and the logs.

A version moves STAGING -> READY | FAILED, and READY -> SUPERSEDED once a newer
version is READY. A sync is timed in phases; a replica receives over one channel.
Keeping these names in one module is what lets a dashboard panel, a log line and a
``WeightVersion`` status speak about the same thing with the same word.
"""

from __future__ import annotations

import enum
from typing import NewType

JobName = NewType("JobName", str)
VersionNumber = NewType("VersionNumber", int)
ReplicaId = NewType("ReplicaId", str)

ENGINE_PREFIX = "weightsync-"
"""vLLM engine names carry this prefix so they never clash with vLLM's own ``nccl``/``ipc``."""


class Channel(enum.StrEnum):
    """How bytes reach a replica, in the default preference order."""

    IPC = "ipc"
    NCCL = "nccl"
    NIXL = "nixl"
    CPU = "cpu"
    VOLUME = "volume"

    @property
    def engine_name(self) -> str:
        """The name the vLLM plugin registers this channel's engine under."""
        return ENGINE_PREFIX + self.value

    @classmethod
    def parse(cls, value: str) -> Channel:
        """Parse a channel name, naming the valid ones when it is unknown."""
        name = value.removeprefix(ENGINE_PREFIX)
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(c.value for c in cls)
            raise ValueError(f"unknown channel {value!r}; valid channels: {valid}") from None


class VersionState(enum.StrEnum):
    STAGING = "STAGING"
    READY = "READY"
    FAILED = "FAILED"
    SUPERSEDED = "SUPERSEDED"

    @property
    def phase(self) -> str:
        """The CRD phase spelling (``Staging``, ``Ready``, ...)."""
        return self.value.capitalize()


class SyncPhase(enum.StrEnum):
    """Where a sync's time goes: ``publish`` on the trainer; ``pause`` (the engine's pause call), ``transfer``
    (bytes on the wire, verification excluded), ``verify`` (digests checked), ``load`` (into the engine),
    ``resume`` (the engine's resume call) and ``total`` (pause to resume) on a replica."""

    PUBLISH = "publish"
    TRANSFER = "transfer"
    LOAD = "load"
    VERIFY = "verify"
    TOTAL = "total"
    PAUSE = "pause"
    RESUME = "resume"


class ReplicaState(enum.StrEnum):
    """One replica's part in one version: the coordinator's record, the proto's enum, ``WeightVersion`` status.

    ``planned`` (assigned a channel) -> ``joined`` (its receiver is set up and waits for bytes; the
    publisher sends once every planned live replica joined) -> ``loaded`` (acked: its engine holds the
    version) | ``failed`` (acked an error) | ``dropped`` (its lease expired before it acked).
    """

    PLANNED = "planned"
    JOINED = "joined"
    LOADED = "loaded"
    FAILED = "failed"
    DROPPED = "dropped"


class ReplicaHealth(enum.StrEnum):
    """A live replica as the fleet gauge counts it (the ``state`` label of ``weightsync_replicas``)."""

    REGISTERED = "registered"
    """Live, serving no version yet."""
    SYNCING = "syncing"
    """A version is assigned to it and not yet acked."""
    CURRENT = "current"
    """Serving the newest READY version."""
    LAGGING = "lagging"
    """Serving an older version."""
    FAILED = "failed"
    """Its last ack was an error."""


class EngineState(enum.StrEnum):
    """What a replica's engine may do, as its agent drives it through an update (fail-stop)."""

    SERVING = "serving"
    PAUSED = "paused"
    TORN = "torn"
    """Bytes of a version that did not finish landed in its parameters: paused until a whole version loads."""
