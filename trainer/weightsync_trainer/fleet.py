"""Publishing to a fleet through the coordinator: live replicas over the CPU stream, every version to the volume.

One ``publish(step)`` (on every trainer rank; rank 0 talks to the coordinator):

1. open the version: the coordinator assigns its number and a channel plan per replica;
2. form the stream groups this plan names that the sender lacks (one per replica on
   the CPU stream), while the replicas' agents join them, and wait until every planned
   replica is ready to receive or has been dropped;
3. stream the version to every group (a replica that dies mid-stream costs only
   itself), then wait for the coordinator's verdict (READY when the ack policy is met);
4. off the critical path, write a snapshot of the same tensors to the checkpoint
   volume and mark the version durable when its manifest lands; late joiners and
   recovering replicas load it from there.

The snapshot is a copy: the trainer goes on updating its parameters in place while the
volume writer works.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightsync.channels.base import UpdateTicket
from weightsync.channels.cpu import CpuSender
from weightsync.channels.volume import MANIFEST, VolumeSender, version_dir
from weightsync.coordinator import models
from weightsync.coordinator.client import CoordinatorClient
from weightsync.errors import PermanentError
from weightsync.metrics import PublisherMetrics
from weightsync.vocabulary import Channel, VersionState
from weightsync_trainer.sources import WeightSource


@dataclass
class FleetReport:
    version: int
    step: int
    state: VersionState
    channels: dict[str, str]  # replica -> channel
    seconds: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # stream group -> why


class FleetPublisher:
    def __init__(
        self,
        source: WeightSource,
        client: CoordinatorClient,
        *,
        volume: Path,
        host: str = "127.0.0.1",
        timeout_s: float = 120.0,
        verify: bool = True,
        metrics: PublisherMetrics | None = None,
        keep: int = 3,
    ) -> None:
        self.source, self.client, self.timeout_s, self.verify, self.metrics = source, client, timeout_s, verify, metrics
        self.table = source.table()
        self.summary = models.summarize(self.table)
        self.stream = CpuSender(host=host, timeout_s=timeout_s)
        self.volume = VolumeSender(volume, keep=keep)
        self._writer: threading.Thread | None = None
        self.durable_errors: list[str] = []

    @property
    def offers(self) -> list[models.SenderOffer]:
        return [models.SenderOffer(Channel.CPU, self.stream.host, self.stream.port)]

    def publish(self, step: int) -> FleetReport:
        t0 = time.perf_counter()
        opened = self.client.open_version(step, self.summary, offers=self.offers)
        version = opened.version
        groups = opened.groups()
        missing = {gid: ws for gid, (ch, ws) in groups.items() if ch is Channel.CPU and gid not in self.stream.groups}
        self.stream.retain(gid for gid, (ch, _) in groups.items() if ch is Channel.CPU)
        unsupported = {p.channel for p in opened.plans} - {Channel.CPU, Channel.VOLUME}
        if unsupported:
            raise PermanentError(f"this publisher streams over cpu and writes the volume; plan asks for {unsupported}")
        joiners = [threading.Thread(target=self._form, args=(gid, ws), daemon=True) for gid, ws in missing.items()]
        for t in joiners:
            t.start()
        self.client.wait_receivers_ready(version, self.timeout_s)
        for t in joiners:
            t.join(self.timeout_s)
        snapshot = self._transfer(version, step, stream=bool(self.stream.groups))
        seconds = {"transfer": time.perf_counter() - t0}
        state = self.client.wait_version(version, self.timeout_s)
        seconds["total"] = time.perf_counter() - t0
        if self.metrics:
            self.metrics.observe_publish(seconds["total"], Channel.CPU)
            self.metrics.versions_published_total.labels(state.value).inc()
        self._write_durable(version, step, snapshot)
        return FleetReport(
            version,
            step,
            state,
            {p.replica_id: p.channel.value for p in opened.plans},
            seconds,
            dict(self.stream.failed),
        )

    def _form(self, gid: str, world_size: int) -> None:
        try:
            self.stream.connect(world_size, gid)
        except Exception as e:  # noqa: BLE001 - a replica that never joins is dropped, not fatal
            self.stream.failed[gid] = str(e)

    def _transfer(self, version: int, step: int, stream: bool) -> list[list[torch.Tensor]]:
        """Stream each gathered group and keep a copy of it for the volume writer."""
        snapshot: list[list[torch.Tensor]] = []

        def groups() -> object:
            for group in self.source.groups():
                snapshot.append([t.detach().clone() for t in group])
                yield group

        if stream:
            ticket = UpdateTicket(
                version, Channel.CPU, self.table, step=step, verify=self.verify, timeout_s=self.timeout_s
            )
            try:
                self.stream.send(ticket, groups())  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - every group failed; the replicas ack failures, volume stays
                self.stream.failed["*"] = str(e)
        if len(snapshot) < len(self.table.groups()):
            snapshot = [[t.detach().clone() for t in g] for g in self.source.groups()]
        return snapshot

    def _write_durable(self, version: int, step: int, snapshot: Sequence[Sequence[torch.Tensor]]) -> None:
        self.wait_durable()

        def write() -> None:
            try:
                ticket = UpdateTicket(version, Channel.VOLUME, self.table, step=step, verify=self.verify)
                self.volume.send(ticket, iter(snapshot))
                manifest = version_dir(self.volume.root, version) / MANIFEST
                sha = hashlib.sha256(manifest.read_bytes()).hexdigest()
                self.client.mark_durable(version, str(manifest), sha)
            except Exception as e:  # noqa: BLE001 - reported, and the version simply stays non-durable
                self.durable_errors.append(f"version {version}: {e}")

        self._writer = threading.Thread(target=write, name=f"weightsync-durable-v{version}", daemon=True)
        self._writer.start()

    def wait_durable(self, timeout_s: float | None = None) -> None:
        """Block until the last version's volume copy has landed (or failed)."""
        if self._writer is not None:
            self._writer.join(timeout_s)

    def close(self) -> None:
        self.wait_durable()
        self.stream.close()
