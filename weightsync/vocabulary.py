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
    PUBLISH = "publish"
    TRANSFER = "transfer"
    LOAD = "load"
    VERIFY = "verify"
    TOTAL = "total"
