"""A job's sync settings as every process of the job reads them: ``$WEIGHTSYNC_CONFIG`` (``job.json``).

On Kubernetes the operator writes ``job.json`` into the job's ConfigMap from the
RLJob's spec and mounts it into every pod; the coordinator takes its policy from it
(channels, ack policy, timeout, retention), each agent the channels it may receive
and the job's NCCL domain, the publisher the channels it offers and the checkpoint
directory. The embedded default writes the same file. Parsed once, here, into a
typed ``JobConfig``; a malformed file fails naming the field. The file's schema is the
model ``weightsync.resources.jobfile.JobFile`` (docs/job-config.md, generated); this
parser stays free of pydantic (the GPU host has none), and a unit test holds it to the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.errors import PermanentError
from weightsync.vocabulary import Channel, PauseMode, SyncMode

ENV = "WEIGHTSYNC_CONFIG"
DEFAULT_JOIN_TIMEOUT_S = 10.0
"""The join deadline when a job sets none: several times the slowest join measured on a loaded CPU fleet
(docs/faults.md, "The join deadline"), far below any transfer timeout."""
REFERENCE = "docs/job-config.md"


@dataclass(frozen=True)
class JobConfig:
    job: str
    channels: tuple[Channel, ...]
    """The channels the job may use, in preference order."""
    ack_quorum: int = 0
    """0: every live planned replica must ack (ackPolicy All)."""
    timeout_s: float = 600.0
    """A version not acked within this is FAILED."""
    transfer_timeout_s: float = 120.0
    """A transfer stalled this long (a peer died or is unreachable) is abandoned: the replica takes the volume."""
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    """A version's receivers join within this (counted from its open), or the sender goes on without them and they
    take the version from the volume; also how far one receiver may fall behind the others mid-transfer."""
    retention: int = 3
    checkpoint_dir: str = ""
    nccl_domain: str = ""
    """Processes of the job that may reach each other over NCCL share this name (empty: NCCL is not used)."""
    every_steps: int = 1
    ready_without_acks: bool = False
    """A version planned for no replica is READY (default: FAILED)."""
    pause_mode: PauseMode = PauseMode.KEEP
    """What a replica's pause for an update does with requests in flight (``vocabulary.PauseMode``)."""
    sync_mode: SyncMode = SyncMode.IN_PLACE
    """How a replica takes a version in (``vocabulary.SyncMode``)."""
    all_or_nothing: bool = False
    """Staged mode only: replicas switch a version in only once the ack policy's replicas staged it."""

    def __post_init__(self) -> None:
        if not 0 < self.join_timeout_s < self.transfer_timeout_s:
            raise PermanentError(
                f"job config: sync.joinTimeoutSeconds ({self.join_timeout_s:g}) must be above 0 and below "
                f"sync.transferTimeoutSeconds ({self.transfer_timeout_s:g}): the join deadline is the short one, the "
                "transfer timeout bounds a transfer that started"
            )
        if self.transfer_timeout_s >= self.timeout_s:
            raise PermanentError(
                f"job config: sync.transferTimeoutSeconds ({self.transfer_timeout_s:g}) must be below "
                f"sync.timeoutSeconds ({self.timeout_s:g}): a transfer stalled on a replica that died is abandoned "
                "only after it, and the version would time out first for every replica"
            )

    @classmethod
    def parse(cls, data: Mapping[str, Any], where: str = "job.json") -> JobConfig:
        try:
            sync = dict(data.get("sync", {}))
            quorum = int(sync.get("quorum") or 0) if sync.get("ackPolicy", "All") == "Quorum" else 0
            return cls(
                job=str(data["job"]),
                # the RLJob's default, in its preference order (docs/job-config.md)
                channels=tuple(Channel.parse(str(c)) for c in sync.get("channels", list(Channel))),
                ack_quorum=quorum,
                timeout_s=float(sync.get("timeoutSeconds", 600)),
                transfer_timeout_s=float(sync.get("transferTimeoutSeconds", 120)),
                join_timeout_s=float(sync.get("joinTimeoutSeconds", DEFAULT_JOIN_TIMEOUT_S)),
                retention=int(sync.get("retention", 3)),
                checkpoint_dir=str(data.get("checkpointDir", "")),
                nccl_domain=str(data.get("ncclDomain", "")),
                every_steps=int(sync.get("everySteps", 1)),
                ready_without_acks=bool(sync.get("readyWithoutAcks", False)),
                pause_mode=PauseMode(str(sync.get("pauseMode", PauseMode.KEEP.value))),
                sync_mode=SyncMode(str(sync.get("mode", SyncMode.IN_PLACE.value))),
                all_or_nothing=bool(sync.get("allOrNothing", False)),
            )
        except KeyError as e:
            raise PermanentError(
                f"{where}: the job config has no {e.args[0]!r} (the job's name); its fields: {REFERENCE}"
            ) from None
        except (TypeError, ValueError) as e:
            raise PermanentError(
                f"{where}: malformed job config ({type(e).__name__}: {e}); its fields: {REFERENCE}"
            ) from None

    def to_json(self) -> dict[str, Any]:
        """The ``job.json`` form (what the operator writes), for the embedded default and tests."""
        return {
            "job": self.job,
            "sync": {
                "channels": [c.value for c in self.channels],
                "ackPolicy": "Quorum" if self.ack_quorum else "All",
                **({"quorum": self.ack_quorum} if self.ack_quorum else {}),
                "timeoutSeconds": self.timeout_s,
                "transferTimeoutSeconds": self.transfer_timeout_s,
                "joinTimeoutSeconds": self.join_timeout_s,
                "retention": self.retention,
                "everySteps": self.every_steps,
                "readyWithoutAcks": self.ready_without_acks,
                "pauseMode": self.pause_mode.value,
                "mode": self.sync_mode.value,
                "allOrNothing": self.all_or_nothing,
            },
            "checkpointDir": self.checkpoint_dir,
            "ncclDomain": self.nccl_domain,
        }


def load(path: str | os.PathLike[str] | None = None) -> JobConfig | None:
    """The job config at ``path`` (default ``$WEIGHTSYNC_CONFIG``); None when neither names a file."""
    where = path or os.environ.get(ENV)
    if not where:
        return None
    try:
        data = json.loads(Path(where).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PermanentError(f"job config {where}: cannot read it ({e})") from None
    return JobConfig.parse(data, str(where))
