"""The replica agent: follows the coordinator and drives one engine through each version.

It registers the replica (its channels and the version it serves), watches the
coordinator's stream and, for each event:

- ``CATCH_UP v``: load the newest durable READY version from the checkpoint volume
  (late joiners and restarted replicas, without waiting for the next step);
- ``ASSIGN v``: (re)join the sender's group when its membership changed, report
  ready-to-receive, load v over the planned channel, ack with the phase timings;
- ``ABORT v``: the trainer gave up on v; a replica whose parameters were touched
  reloads the newest durable READY version before serving again.

A failed update is acked as failed (``channel_failed`` for a transport error, so the
coordinator plans the volume next time). The lifecycle (``Replica``) keeps the
fail-stop rule: a torn replica stays paused until a whole version loads.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.channels.base import UpdateTicket
from weightsync.coordinator import models
from weightsync.coordinator.client import CoordinatorClient
from weightsync.errors import WeightsyncError
from weightsync.metrics import AgentMetrics
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel, SyncPhase
from weightsync_inference.lifecycle import EngineControl, Replica, ReplicaState, UpdateFailed

log = logging.getLogger(__name__)
EMPTY = TensorTable(())


@dataclass(frozen=True)
class AgentConfig:
    job: str
    replica_id: str
    capabilities: models.Capabilities
    volume: Path | None = None
    update_timeout_s: float = 300.0
    verify: bool = True
    lag_check_s: float = 2.0


class Agent:
    def __init__(
        self,
        control: EngineControl,
        client: CoordinatorClient,
        config: AgentConfig,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.replica = Replica(control)
        self.client = client
        self.config = config
        self.metrics = metrics
        self._groups: dict[Channel, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.events: list[tuple[str, int, str]] = []  # (kind, version, outcome), for status displays and tests

    def run(self) -> None:
        """Register and follow the coordinator until ``stop()``."""
        self.client.register_replica(
            self.config.job, self.config.replica_id, self.config.capabilities, current_version=self.replica.version
        )
        threading.Thread(target=self.follow_durable, name="weightsync-follow-durable", daemon=True).start()
        for assignment in self.client.watch():
            if self._stop.is_set():
                break
            try:
                with self._lock:
                    self.handle(assignment)
            except WeightsyncError as e:
                log.error("replica %s: version %d: %s", self.config.replica_id, assignment.version, e)

    def stop(self) -> None:
        self._stop.set()
        self.client.close()

    def handle(self, a: models.Assignment) -> None:
        if a.kind is models.EventKind.ABORT:
            self.events.append(("abort", a.version, a.reason))
            if self.replica.state is ReplicaState.TORN:
                self.recover()
            return
        if a.version <= self.replica.version and self.replica.state is ReplicaState.SERVING:
            return  # a re-sent event after a reconnect
        if a.kind is models.EventKind.CATCH_UP:
            self._load_from_volume(a.version, "catch-up", a.table.table_digest if a.table else "")
            return
        assert a.plan is not None
        self._assign(a, a.plan)

    def _volume_ticket(self, version: int, root: str = "") -> UpdateTicket:
        path = root or (str(self.config.volume) if self.config.volume else "")
        if not path:
            raise WeightsyncError(f"version {version} must come from the volume, but replica has no volume mounted")
        return UpdateTicket(
            version,
            Channel.VOLUME,
            EMPTY,
            verify=self.config.verify,
            timeout_s=self.config.update_timeout_s,
            params={"root": path},
        )

    def _load_from_volume(self, version: int, why: str, digest: str) -> None:
        outcome = self.replica.apply(self._volume_ticket(version))
        self.client.set_current_version(version)
        self._observe(Channel.VOLUME, outcome.seconds)
        self.events.append((why, version, "ok"))
        # an ack for a version this replica was not planned for tells the coordinator what it serves
        phases = {SyncPhase(k): v for k, v in outcome.seconds.items()}
        self.client.ack(models.AckReport(version, digest, ok=True, phases=phases))

    def newest_durable(self) -> tuple[int, str]:
        job = self.client.get_job()
        if job.newest_durable_ready <= 0:
            return 0, ""
        table = self.client.version_info(job.newest_durable_ready).table
        return job.newest_durable_ready, table.table_digest if table else ""

    def recover(self) -> None:
        """Load the newest durable READY version as a whole (the only way out of TORN)."""
        newest, digest = self.newest_durable()
        if newest <= 0:
            log.error(
                "replica %s is torn and no durable READY version exists yet; staying paused", self.config.replica_id
            )
            return
        self._load_from_volume(newest, "recover", digest)

    def follow_durable(self) -> None:
        """Catch up when the fleet moved on while this replica was in no plan (it joined between versions)."""
        while not self._stop.wait(self.config.lag_check_s):
            try:
                with self._lock:
                    newest, digest = self.newest_durable()
                    if newest > self.replica.version and self.replica.state is ReplicaState.SERVING:
                        self._load_from_volume(newest, "catch-up", digest)
            except WeightsyncError as e:
                log.warning("replica %s: catch-up check failed: %s", self.config.replica_id, e)

    def _join(self, plan: models.ChannelPlan) -> None:
        r = plan.rendezvous
        if plan.channel not in (Channel.CPU, Channel.NCCL) or self._groups.get(plan.channel) == r.group_id:
            return
        init: dict[str, Any] = {
            "channel": plan.channel.value,
            "address": f"{r.host}:{r.port}",
            "world_size": r.world_size,
            "rank_offset": r.rank_offset,
            "group_id": r.group_id,
            "timeout_s": self.config.update_timeout_s,
        }
        self.replica.init_transfer(init, timeout_s=self.config.update_timeout_s)
        self._groups[plan.channel] = r.group_id

    def _assign(self, a: models.Assignment, plan: models.ChannelPlan) -> None:
        digest = a.table.table_digest if a.table else ""
        try:
            self._join(plan)
            self.client.report_ready(a.version)
            if plan.channel is Channel.VOLUME:
                ticket = self._volume_ticket(a.version, plan.rendezvous.volume_path)
            else:
                ticket = UpdateTicket(
                    a.version,
                    plan.channel,
                    EMPTY,
                    step=a.step,
                    verify=self.config.verify,
                    timeout_s=self.config.update_timeout_s,
                )
            outcome = self.replica.apply(ticket)
        except (UpdateFailed, WeightsyncError) as e:
            self._groups.pop(plan.channel, None)  # a failed transfer breaks the group: rejoin next time
            if self.metrics:
                self.metrics.failures_total.labels(plan.channel.value).inc()
            self.events.append(("assign", a.version, f"failed: {e}"))
            self.client.ack(
                models.AckReport(
                    a.version, digest, ok=False, error=str(e)[:2000], channel_failed=plan.channel is not Channel.VOLUME
                )
            )
            if self.replica.state is ReplicaState.TORN:
                self.recover()
            return
        self._observe(plan.channel, outcome.seconds)
        self.events.append(("assign", a.version, "ok"))
        phases = {SyncPhase(k): v for k, v in outcome.seconds.items()}
        self.client.ack(models.AckReport(a.version, digest, ok=True, phases=phases))

    def _observe(self, channel: Channel, seconds: dict[str, float]) -> None:
        if self.metrics is None:
            return
        self.metrics.version.set(self.replica.version)
        self.metrics.version_lag.set(max(0, self.client.get_job().newest_ready - self.replica.version))
        for phase, value in seconds.items():
            self.metrics.sync_seconds.labels(phase, channel.value).observe(value)
