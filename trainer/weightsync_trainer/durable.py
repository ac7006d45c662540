"""The durable copy of each version: written to the checkpoint volume, then marked durable at the coordinator.

A replica planned on the volume (it has no live channel, or its channel failed) loads a
version only once its copy landed, so the publisher writes it first when the coordinator
says a replica waits for it (``write``); otherwise the copy is written in the background
after the verdict (``write_later``), so late joiners and recovering replicas find it. A
failed copy is reported to the coordinator, which fails the replicas waiting for it at
once instead of at the version's timeout. The volume is pruned by the coordinator (it
knows which version is the newest durable READY one), never by the writer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from weightsync.channels import manifests
from weightsync.channels.base import UpdateTicket
from weightsync.channels.volume import VolumeSender
from weightsync.coordinator.client import CoordinatorClient
from weightsync.errors import WeightsyncError
from weightsync.tensors import TensorTable, content_digest, manifest_checksum
from weightsync.vocabulary import Channel

log = logging.getLogger(__name__)

Snapshot = list[list[torch.Tensor]]
"""A copy of each group as it was sent (kept by the stream for the volume), or empty: gather again."""


class VolumeCopies:
    """Writes versions to ``volume`` (None: the job has no volume) and marks them durable through ``client``."""

    def __init__(
        self,
        volume: VolumeSender | None,
        client: CoordinatorClient,
        table: TensorTable,
        verify: bool,
        gather: Callable[[], Iterable[Sequence[torch.Tensor]]],
    ) -> None:
        self.volume, self.client, self.table, self.verify, self.gather = volume, client, table, verify, gather
        self.errors: list[str] = []
        """Every copy that failed ("version N: why"), for the trainer's own report."""
        self._writer: threading.Thread | None = None

    def write(self, version: int, step: int, snapshot: Snapshot) -> str:
        """Write ``snapshot`` as ``version`` and mark it durable; why not, if not (empty when it landed)."""
        if self.volume is None:
            error = "a replica waits for the volume, which is not configured"
            self.errors.append(f"version {version}: {error}")
            return error
        try:
            groups: Iterable[Sequence[torch.Tensor]] = snapshot if snapshot else self.gather()
            ticket = UpdateTicket(version, Channel.VOLUME, self.table, step=step, verify=self.verify)
            written = self.volume.send(ticket, groups).digests
            path = manifests.manifest_path(self.volume.root, version)
            # what was written, for the replicas that load it from there: a version no live channel carried
            # is checked against the trainer's digest too
            digest = content_digest(written) if written else ""
            self.client.mark_durable(version, str(path), manifest_checksum(path.read_bytes()), digest)
        except (WeightsyncError, OSError) as e:
            log.error("v%d: the volume copy failed: %s", version, e)
            self.errors.append(f"version {version}: {e}")
            return str(e)
        return ""

    def write_later(self, version: int, step: int, snapshot: Snapshot) -> None:
        """Write the copy on a thread of its own (after the previous one landed); nothing to do without a volume
        or a snapshot."""
        if self.volume is None or not snapshot:
            return
        self.wait()
        self._writer = threading.Thread(
            target=self.write, args=(version, step, snapshot), name=f"weightsync-durable-v{version}", daemon=True
        )
        self._writer.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the last background copy landed (or failed)."""
        if self._writer is not None:
            self._writer.join(timeout_s)
