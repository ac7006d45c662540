"""The replica agent: follows the coordinator and drives one engine through each version.

At start it asks the engine's workers what they are (CPU or GPU, GPU UUIDs, how many:
the tensor-parallel size, NIXL) and what version the engine serves, takes the engine
over as a previous agent may have left it (paused with whole weights: resumed; paused
and torn: kept paused and recovered from the volume), registers the replica with the
channels of the job it can receive, then follows its watch stream:

- ``CATCH_UP v``: load the newest durable READY version from the checkpoint volume
  (late joiners and restarted replicas, without waiting for the next step). A
  catch-up the engine refuses is acked as failed with the reason (the version's
  status shows it) and retried with backoff; a retry first checks the version's
  files here, so a serving engine is not paused again for a version still damaged;
- ``ASSIGN v``: start the planned channel's receiver from the plan's typed rendezvous
  when its membership changed, report joined, load v (a volume plan arrives once v
  is durable, with the manifest checksum the replica must find), ack. In staged mode
  (``vocabulary.SyncMode``) v is received into the engine's stage while it goes on
  serving, and the replica pauses only to switch it in; an engine that cannot allocate
  the stage loads that version in place. In an all-or-nothing job (the ASSIGN says
  ``await_commit``) the replica stages v, reports it staged and waits; an engine
  that cannot allocate the stage fails v (loading it in place would break the promise);
- ``COMMIT v``: all-or-nothing: the replicas the policy needs staged v; switch it in, ack;
- ``ABORT v``: v failed; a replica whose parameters were touched reloads the newest
  durable READY version before serving again, and so does one that loaded v whole
  before it failed (a FAILED version is served by no replica: ``roll_back``; with no
  durable READY version to go back to it keeps serving v, said in the log and its
  events); a staged v is dropped (no parameter was touched).

What the replica serves at every moment (one version, or two while one switches in; paused or
torn) is on its ``served.Board``, which the agent serves on loopback for the proxy beside it.

Every ack carries what the engine itself computed while loading: the layout digest of
the table it received and the content digest over the per-tensor digests it computed
where the bytes landed (its receipt). A failed update is acked as failed, with
``torn`` from the engine's receipt; a failed live channel makes the coordinator plan
the same version on the volume for this replica. The lifecycle (``Replica``) keeps the
fail-stop rule: a torn replica stays paused until a whole version loads.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.channels import rules
from weightsync.channels.base import Rendezvous, UpdateTicket
from weightsync.coordinator import models
from weightsync.coordinator.client import CoordinatorClient, until_registered
from weightsync.errors import IntegrityError, RetryableError, WeightsyncError
from weightsync.metrics import AgentMetrics
from weightsync.sharding.fills import EngineLayout
from weightsync.sharding.plans import ReplicaPlan
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel, EngineState, SyncMode, SyncPhase
from weightsync_inference import volume_reads
from weightsync_inference.lifecycle import (
    EngineControl,
    RegionControl,
    Replica,
    UpdateFailed,
    UpdateOutcome,
    VolumeRegionControl,
)
from weightsync_inference.receipts import Identity, Receipt, read_by_every
from weightsync_inference.served import Board
from weightsync_inference.staging import StageStatus, StagingUnavailable, staging_bytes
from weightsync_inference.volume_reads import RegionsRead

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentConfig:
    job: str
    replica_id: str
    channels: tuple[Channel, ...]
    """The job's channels; the replica declares those its engine can receive."""
    host: str
    """The node it runs on (IPC needs the trainer on the same one)."""
    volume: Path | None = None
    volume_id: str = ""
    nccl_domain: str = ""
    update_timeout_s: float = 300.0
    lag_check_s: float = 2.0
    retry_s: float = 5.0
    """First wait before retrying a catch-up the engine refused; doubles (jittered) up to ``retry_max_s``."""
    retry_max_s: float = 300.0
    sync_mode: SyncMode = SyncMode.IN_PLACE


@dataclass
class _Staged:
    """An all-or-nothing version staged in the engine, waiting for its COMMIT."""

    ticket: UpdateTicket
    plan: models.ChannelPlan
    layout_digest: str
    status: StageStatus


@dataclass
class _Refused:
    """A version a catch-up failed on, and when to try it again."""

    error: str
    delay: float
    retry_at: float


def capabilities(config: AgentConfig, workers: Sequence[Identity]) -> models.Capabilities:
    """What this replica discovered of its engine, with the job's channels it can receive (``channels.rules``)."""
    from weightsync.channels import nccl, nixl

    gpu = bool(workers) and all(w.gpu for w in workers)
    found = models.Capabilities(
        host=config.host,
        # in worker order: the coordinator matches worker i with the trainer rank on its GPU (``links.copied``)
        gpu_uuids=tuple(w.gpu_uuid for w in sorted(workers, key=lambda w: w.rank) if w.gpu_uuid),
        peer_gpu_uuids=read_by_every(workers) if gpu else (),
        devices=max(1, len(workers)),
        nccl_domain=config.nccl_domain,
        nixl=bool(workers) and all(w.nixl for w in workers),
        volume_id=config.volume_id if config.volume else "",
        volume_mount=str(config.volume or ""),
        engine=models.EngineKind.GPU if gpu else models.EngineKind.CPU,
    )
    channels, why = rules.usable(
        config.channels, found, sends=False, nccl_transport=nccl.transport(), nixl_memory=nixl.memory()
    )
    for ch, reason in why.items():
        log.info("replica %s does not receive %s: %s", config.replica_id, ch.value, reason)
    return dataclasses.replace(found, channels=channels)


def served_version(control: EngineControl) -> int:
    """The version the engine serves by its own account (a restarted agent must not report 0): 0 for an engine
    that keeps no version; an engine too slow to answer yet raises (``RetryableError``), to be waited out."""
    try:
        text = control.weight_version()
    except RetryableError:
        raise
    except WeightsyncError:
        return 0
    return int(text) if text.isdigit() else 0


class Agent:
    def __init__(
        self,
        control: EngineControl,
        client: CoordinatorClient,
        config: AgentConfig,
        metrics: AgentMetrics | None = None,
        board: Board | None = None,
    ) -> None:
        """``board``: where the replica shows what it serves (``served``: the proxy reads it)."""
        self.replica = Replica(control, version=served_version(control), board=board)
        if self.replica.adopt() is EngineState.TORN:  # a previous agent died mid-update: recovered once registered
            log.warning(
                "replica %s: the engine was left paused and torn; it stays paused until a whole version loads",
                config.replica_id,
            )
        self.control = control
        self.client = client
        self.config = config
        self.metrics = metrics
        self.capabilities = capabilities(config, control.identity())
        self._joined: dict[Channel, Rendezvous] = {}
        self._layout: tuple[TensorTable, EngineLayout] | None = None
        """The engine layout this replica registered, and the table it was recorded against (the sharded path)."""
        self.last_regions: RegionsReceived | None = None
        """What the workers received on the sharded path last (for status displays and tests)."""
        self.last_read: RegionsRead | None = None
        """What the workers read by region from a sharded volume version last (for status displays and tests)."""
        self._holds_regions = False
        """Whether the workers may hold region groups (a plan sent them regions since they last let them go)."""
        self._workers_plan = ""
        """The plan key whose regions every worker parsed in the last version it received over regions (what the
        next request may leave out); "" after a failed one."""
        self._refused: dict[int, _Refused] = {}
        self._staged: _Staged | None = None
        """All-or-nothing: the version staged here and waiting for its COMMIT."""
        self._waiting_for_durable = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.events: list[tuple[str, int, str]] = []  # (kind, version, outcome), for status displays and tests

    @property
    def engine_layout(self) -> EngineLayout | None:
        """The engine layout this replica registered (None: none yet, every version reaches it whole)."""
        return self._layout[1] if self._layout is not None else None

    def run(self) -> bool:
        """Register (waiting out a coordinator that is not up yet) and follow it until ``stop()``; False when the
        coordinator's stream ended without one (said in the log: the process must not end in silence)."""
        c = self.config

        def register() -> models.Lease:
            return self.client.register_replica(
                c.job, c.replica_id, self.capabilities, current_version=self.replica.version
            )

        if until_registered(register, f"replica {c.replica_id}", self._stop) is None:
            return True
        if self.replica.version:  # started beside an engine that serves a version (the agent restarted): its layout
            with self._lock:  # now, or the next version would go gathered and a volume read whole until one did
                self._record_layout(self.replica.version)
        threading.Thread(target=self.follow_durable, name="weightsync-follow-durable", daemon=True).start()
        for assignment in self.client.watch():
            if self._stop.is_set():
                break
            try:
                with self._lock:
                    self.handle(assignment)
            except WeightsyncError as e:
                log.error("replica %s: version %d: %s", self.config.replica_id, assignment.version, e)
        if not self._stop.is_set():
            log.error("replica %s: the coordinator's stream ended and no stop was asked for", c.replica_id)
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self.client.close()

    def handle(self, a: models.Assignment) -> None:
        if a.kind is models.EventKind.ABORT:
            self.events.append(("abort", a.version, a.reason))
            if self._staged is not None and self._staged.ticket.version == a.version:
                self._staged = None  # the stage is left as it is: no parameter was touched
            if self.replica.state is EngineState.TORN:
                self.recover()
            elif self.replica.state is EngineState.SERVING and self.replica.version == a.version:
                self.roll_back(a.version)
            return
        if a.kind is models.EventKind.COMMIT:
            self._commit(a.version)
            return
        if a.version <= self.replica.version and self.replica.state is EngineState.SERVING:
            return  # a re-sent event after a reconnect
        if a.plan is None or a.table is None:
            log.warning(
                "replica %s: event for v%d carries no plan or table; ignored", self.config.replica_id, a.version
            )
            return
        if a.kind is models.EventKind.CATCH_UP:
            self._load_from_volume(a.version, "catch-up", a.table, a.plan)
            return
        self._assign(a, a.plan, a.table)

    def _ticket(
        self, version: int, plan: models.ChannelPlan, table: models.TableSummary, step: int = 0
    ) -> UpdateTicket:
        if plan.channel is Channel.VOLUME and not plan.manifest_checksum:
            raise WeightsyncError(
                f"version {version} would load from the volume, but the coordinator recorded no manifest checksum "
                "for it: a manifest cannot be trusted by itself"
            )
        return UpdateTicket(
            version,
            plan.channel,
            layout_digest=table.layout_digest,
            manifest_checksum=plan.manifest_checksum,
            step=step,
            verify=table.verified,  # the trainer's choice: both ends of a channel must agree on it
            timeout_s=self.config.update_timeout_s,
            join_timeout_s=plan.rendezvous.join_timeout_s,
            root=plan.rendezvous.root if plan.channel is Channel.VOLUME else "",
        )

    def _join(self, plan: models.ChannelPlan) -> None:
        """Start the planned channel's receiver unless this membership's is running already."""
        rdv = plan.rendezvous
        if rdv.same_membership(self._joined.get(plan.channel)) and plan.channel is not Channel.VOLUME:
            return
        self.replica.init_transfer(
            rdv.with_timeout(self.config.update_timeout_s).to_dict(), timeout_s=self.config.update_timeout_s
        )
        self._joined[plan.channel] = rdv

    def _assign(self, a: models.Assignment, plan: models.ChannelPlan, table: models.TableSummary) -> None:
        part = plan.regions_part()
        if part is not None:
            self._assign_regions(a, plan, table, part)
            return
        self._release_regions()
        try:
            self._join(plan)
            ticket = self._ticket(a.version, plan, table, a.step)
            if a.await_commit:
                self._stage_for_commit(ticket, plan, table)
                return
            staged = self._stage(ticket, table)
            if plan.channel is not Channel.VOLUME:
                self.client.report_joined(a.version)
            read = None
            if staged:
                outcome = self.replica.switch(ticket)
            elif plan.channel is Channel.VOLUME:
                outcome, read = self._apply_from_volume(ticket)
            else:
                outcome = self.replica.apply(ticket)
        except (UpdateFailed, WeightsyncError) as e:
            log.warning("replica %s: v%d over %s failed: %s", self.config.replica_id, a.version, plan.channel.value, e)
            self._failed(a.version, plan, table.layout_digest, e)
            return
        log.info("replica %s: loaded v%d over %s", self.config.replica_id, a.version, plan.channel.value)
        self._loaded(a.version, plan.channel, outcome, "assign", read=read)

    def _assign_regions(
        self, a: models.Assignment, plan: models.ChannelPlan, table: models.TableSummary, part: ReplicaPlan
    ) -> None:
        """The sharded path: every worker receives only its regions, from every trainer rank, over the region
        group the plan's rendezvous names; the ack carries the workers' own digests of what arrived, combined in
        plan order (``regions.combine``), which the coordinator checks against what the ranks sent."""
        # the publisher released this replica's CPU-stream group (the coordinator mints a new one for a later
        # gathered plan): the receiver joined for it is stale
        self._joined.pop(plan.channel, None)
        try:
            ticket = self._ticket(a.version, plan, table, a.step)
            control, request = self._regions_request(a.version, plan, table, part)
            self._holds_regions = True
            self.client.report_joined(a.version)  # the workers join their region group from here on
            outcome = self.replica.apply_regions(
                ticket, lambda: self._receive_regions(a.version, control, request, part)
            )
        except (UpdateFailed, WeightsyncError) as e:
            log.warning("replica %s: v%d over regions failed: %s", self.config.replica_id, a.version, e)
            self._workers_plan = ""  # a worker may have failed before it parsed the plan: send it in full next
            self._failed(a.version, plan, table.layout_digest, e)
            return
        self._workers_plan = plan.transfer.key if plan.transfer is not None else ""
        received = self.last_regions
        assert received is not None and received.version == a.version
        log.info(
            "replica %s: loaded v%d over regions; bytes received per worker %s (the table: %d)",
            self.config.replica_id,
            a.version,
            received.nbytes,
            table.total_bytes,
        )
        if self.metrics is not None:
            self.metrics.observe_regions(received.nbytes)
        self._loaded(a.version, plan.channel, outcome, "assign", content_digest=received.content_digest)

    def _release_regions(self) -> None:
        """The replica left the sharded path (the plan gathers it now): its workers let their region groups go, which
        hold GPU memory (NCCL) and the trainer ranks' shard memory (IPC mappings). Once; a failure is logged only
        (the groups go with the workers at the latest)."""
        control = self.control
        if not self._holds_regions or not isinstance(control, RegionControl):
            return
        self._holds_regions = False
        try:
            released = control.release_regions()
        except WeightsyncError as e:
            log.warning("replica %s: its workers could not let their region groups go: %s", self.config.replica_id, e)
            return
        log.info(
            "replica %s: back on the gathered path; its workers let %s region groups go",
            self.config.replica_id,
            released,
        )

    def _regions_request(
        self, version: int, plan: models.ChannelPlan, table: models.TableSummary, part: ReplicaPlan
    ) -> tuple[RegionControl, dict[str, Any]]:
        """The workers' request, from the layout this replica registered; refused (before any byte moved) when the
        engine cannot take regions or the plan is for a layout of another table."""
        from weightsync_inference import sharded

        control, recorded = self.control, self._layout
        if not isinstance(control, RegionControl):
            raise WeightsyncError(f"the engine {type(control).__name__} cannot receive regions")
        if recorded is None or recorded[0].layout_digest() != table.layout_digest:
            raise WeightsyncError(
                "the plan sends regions, but this replica registered no engine layout of the version's table"
            )
        rdv = plan.rendezvous.with_timeout(self.config.update_timeout_s)
        order = sharded.Order(version, rdv, part.regions, part.copied)
        key = plan.transfer.key if plan.transfer is not None else ""
        held = bool(key) and key == self._workers_plan
        return control, sharded.request(order, recorded[0], recorded[1].workers, key, held)

    def _receive_regions(
        self, version: int, control: RegionControl, request: dict[str, Any], part: ReplicaPlan
    ) -> Receipt:
        """Every worker receives and lands its regions; their answers checked into ``last_regions``; the receipt
        of the update for the lifecycle."""
        assert self._layout is not None  # ``_regions_request`` refused the update otherwise
        table = self._layout[0]
        answers = control.receive_regions(request)
        self.last_regions = regions_received(version, table, part, answers)
        seconds = max(float(w["seconds"]) for w in answers)
        return Receipt(version, Channel.CPU, layout_digest=table.layout_digest(), seconds={SyncPhase.TRANSFER: seconds})

    def _record_layout(self, version: int) -> None:
        """After a version received whole (or at start, beside an engine that serves one), when this replica
        receives a channel that can carry regions (or reads the volume with an engine that reads regions there):
        record what each worker keeps of its table (vLLM's own loaders) and register it, so the next version's plan
        can send this replica only its regions, and a sharded volume copy is read by region. Once per table; before
        the ack, so the next version is planned with it. A failure only keeps the gathered path."""
        control = self.control
        carries = any(not rules.regions(ch) for ch in self.capabilities.channels)
        carries = carries or (self.config.volume is not None and isinstance(control, VolumeRegionControl))
        # a staged replica receives beside generation; the sharded path lands in place (for now)
        staged = self.config.sync_mode is SyncMode.STAGED
        if not carries or staged or not isinstance(control, RegionControl):
            return
        c = self.config
        try:
            table = control.last_table()
            if table is None or (self._layout is not None and self._layout[0].layout_digest() == table.layout_digest()):
                return
            layout = control.engine_layout(table)
            self.client.register_replica(c.job, c.replica_id, self.capabilities, current_version=version, layout=layout)
        except WeightsyncError as e:
            log.warning("replica %s: no engine layout registered (the gathered path stays): %s", c.replica_id, e)
            return
        self._layout = (table, layout)
        why = f" ({layout.unsupported})" if layout.unsupported else ""
        log.info("replica %s: registered its engine layout of v%d's table%s", c.replica_id, version, why)

    def _stage_for_commit(self, ticket: UpdateTicket, plan: models.ChannelPlan, table: models.TableSummary) -> None:
        """All-or-nothing: stage ``ticket``'s version and report it staged; the switch waits for its COMMIT."""
        held = self._staged
        if held is None or held.ticket.version != ticket.version:  # else: a re-sent ASSIGN after a reconnect
            self._staged = None  # an older uncommitted version is dropped: a newer one supersedes it
            self.replica.stage(ticket, staging_bytes(table.total_bytes, table.tensor_count))
            if plan.channel is not Channel.VOLUME:
                self.client.report_joined(ticket.version)
            status = self.replica.wait_staged(ticket)
            self._staged = _Staged(ticket, plan, table.layout_digest, status)
            self.events.append(("stage", ticket.version, "staged"))
        self.client.report_progress(ticket.version, models.Progress.STAGED)

    def _commit(self, version: int) -> None:
        """All-or-nothing: switch in the version the coordinator committed."""
        held, self._staged = self._staged, None
        if held is None or held.ticket.version != version:
            log.warning("replica %s: COMMIT of v%d, which is not staged here; ignored", self.config.replica_id, version)
            return
        try:
            outcome = self.replica.switch(held.ticket, held.status)
        except (UpdateFailed, WeightsyncError) as e:
            log.warning("replica %s: switching v%d in failed: %s", self.config.replica_id, version, e)
            self._failed(version, held.plan, held.layout_digest, e)
            return
        log.info("replica %s: switched v%d in (committed)", self.config.replica_id, version)
        self._loaded(version, held.plan.channel, outcome, "commit")

    def _stage(self, ticket: UpdateTicket, table: models.TableSummary) -> bool:
        """In staged mode, start receiving ``ticket``'s version beside generation; False: load it in place."""
        if self.config.sync_mode is not SyncMode.STAGED or self.replica.state is not EngineState.SERVING:
            return False
        try:
            self.replica.stage(ticket, staging_bytes(table.total_bytes, table.tensor_count))
        except StagingUnavailable as e:
            log.warning("replica %s: v%d loads in place: %s", self.config.replica_id, ticket.version, e)
            self.events.append(("stage", ticket.version, f"in place: {e}"))
            return False
        return True

    def _failed(self, version: int, plan: models.ChannelPlan, layout_digest: str, e: Exception) -> None:
        self._joined.pop(plan.channel, None)  # a failed transfer breaks the group: rejoin next time
        torn = self.replica.state is EngineState.TORN
        if self.metrics:
            self.metrics.failures_total.labels(plan.channel.value).inc()
        self.events.append(("assign", version, f"failed: {e}"))
        # a stage the engine cannot hold is not the channel's fault: the volume would not help
        live = plan.channel is not Channel.VOLUME and not isinstance(e, StagingUnavailable)
        report = models.AckReport(version, layout_digest, ok=False, error=str(e), channel_failed=live, torn=torn)
        self.client.ack(report)
        # a failed live channel is retried from the volume by the coordinator (that loads a whole version);
        # a torn replica whose volume load failed reloads the newest durable READY version now
        if torn and not live:
            self.recover()

    def _loaded(
        self,
        version: int,
        channel: Channel,
        outcome: UpdateOutcome,
        why: str,
        content_digest: str | None = None,
        read: RegionsRead | None = None,
    ) -> None:
        """Ack a loaded version with what the engine computed: its receipt's digest, or on the sharded path
        (``content_digest``) the workers' region digests combined, or for a region read from the volume (``read``)
        the workers' fill digests combined, marked ``regions_read`` (``volume_reads``)."""
        receipt = outcome.receipt
        self.client.set_current_version(version)
        self.events.append((why, version, "ok"))
        if read is not None:
            content_digest = read.content_digest
        if content_digest is None:  # a version received whole: its table is the engine's to record against
            self._record_layout(version)
        digest = receipt.content_digest if content_digest is None else content_digest
        report = models.AckReport(
            version,
            receipt.layout_digest,
            ok=True,
            phases=outcome.seconds,
            content_digest=digest,
            regions_read=read is not None,
        )
        self.client.ack(report)
        self._observe(channel, outcome.seconds)  # after the ack: its lag query is not on the version's path

    def _load_from_volume(self, version: int, why: str, table: models.TableSummary, plan: models.ChannelPlan) -> None:
        """Load a durable version this replica was not planned for (catch-up, recovery), acking either way."""
        refused = self._refused.get(version)
        if refused is not None and time.monotonic() < refused.retry_at:
            return
        try:
            ticket = self._ticket(version, plan, table)
            if refused is not None:  # the engine refused it before: it is not paused again for the same fault
                self._check_files(ticket, plan)
        except (WeightsyncError, OSError) as e:
            self._refuse(version, why, table.layout_digest, f"its files are refused: {e}", engine=False)
            return
        try:
            self._join(plan)
            outcome, read = self._apply_from_volume(ticket)
        except (UpdateFailed, WeightsyncError) as e:
            self._refuse(version, why, table.layout_digest, str(e), engine=True)
            return
        self._refused = {v: r for v, r in self._refused.items() if v > version}
        log.info("replica %s: loaded v%d from the volume (%s)", self.config.replica_id, version, why)
        # an ack for a version this replica was not planned for tells the coordinator what it serves
        self._loaded(version, Channel.VOLUME, outcome, why, read=read)

    def _apply_from_volume(self, ticket: UpdateTicket) -> tuple[UpdateOutcome, RegionsRead | None]:
        """Load a durable version from the volume: by region where this replica can (a sharded copy and an engine
        layout registered for its table: ``volume_reads.why_whole``), each worker reading only its fills; else whole,
        as before. With the workers' account of a region read."""
        control, recorded = self.control, self._layout
        readable = isinstance(control, VolumeRegionControl)
        why = volume_reads.why_whole(readable, recorded, _sharded_copy(ticket), ticket.layout_digest)
        if why or recorded is None or not isinstance(control, VolumeRegionControl):
            log.debug("replica %s: v%d read whole from the volume: %s", self.config.replica_id, ticket.version, why)
            return self.replica.apply(ticket), None
        table, layout = recorded
        request = volume_reads.request(ticket.root, ticket.version, ticket.manifest_checksum, table, layout)

        def read() -> Receipt:
            # every worker checks all its tiles before any worker lands a byte: one worker's damage leaves them all
            # untouched
            checks = control.read_regions(request)
            bytes_checked = volume_reads.checked(checks)
            answers = control.read_regions({**request, "phase": volume_reads.LAND})
            self.last_read = volume_reads.regions_read(ticket.version, table, layout, answers, bytes_checked)
            seconds = {
                SyncPhase.VERIFY: max(float(a["seconds"]) for a in checks),
                SyncPhase.LOAD: max(float(a["seconds"]) for a in answers),
            }
            return Receipt(ticket.version, Channel.VOLUME, layout_digest=table.layout_digest(), seconds=seconds)

        outcome = self.replica.apply_regions(ticket, read)
        assert self.last_read is not None and self.last_read.version == ticket.version
        if self.metrics is not None:
            self.metrics.observe_regions(self.last_read.landed, volume=True)
        log.info(
            "replica %s: read v%d from the volume by region; bytes read per worker %s (the version: %d)",
            self.config.replica_id,
            ticket.version,
            self.last_read.bytes_read,
            table.total_bytes,
        )
        return outcome, self.last_read

    def _check_files(self, ticket: UpdateTicket, plan: models.ChannelPlan) -> None:
        """The version's manifest and every shard against their checksums, read here, without the engine."""
        from weightsync.channels.volume import VolumeReceiver, verify_version

        receiver = VolumeReceiver(plan.rendezvous.root)
        verify_version(receiver.version_directory(ticket), receiver.manifest(ticket))

    def _refuse(self, version: int, why: str, layout_digest: str, error: str, engine: bool) -> None:
        """Back off from ``version`` and tell the coordinator why (once per distinct reason).

        ``engine``: the engine itself refused it (else the files were refused before the engine was touched)."""
        before = self._refused.get(version)
        delay = min(before.delay * 2, self.config.retry_max_s) if before else self.config.retry_s
        self._refused[version] = _Refused(error, delay, time.monotonic() + delay * random.uniform(0.8, 1.2))
        self.events.append((why, version, f"failed: {error}" if engine else f"not loaded: {error}"))
        log.warning(
            "replica %s: %s to v%d failed (retrying in about %.0fs): %s",
            self.config.replica_id,
            why,
            version,
            delay,
            error,
        )
        if before is not None and before.error == error:
            return  # the coordinator has this reason already
        torn = self.replica.state is EngineState.TORN
        report = models.AckReport(version, layout_digest, ok=False, error=f"{why} from the volume: {error}", torn=torn)
        self.client.ack(report)

    def _volume_plan(self, version: int) -> tuple[models.ChannelPlan, models.TableSummary] | None:
        if self.config.volume is None:
            return None
        info = self.client.version_info(version)
        if not info.durable or info.table is None:
            return None
        rdv = Rendezvous(Channel.VOLUME, root=str(self.config.volume))
        plan = models.ChannelPlan(
            self.config.replica_id, Channel.VOLUME, rdv, why_volume(version), info.manifest_checksum
        )
        return plan, info.table

    def _newest_durable(self) -> tuple[int, tuple[models.ChannelPlan, models.TableSummary] | None]:
        """The job's newest durable READY version, and how to load it from the volume (None: none, or no volume)."""
        newest = self.client.get_job().newest_durable_ready
        return newest, self._volume_plan(newest) if newest > 0 else None

    def recover(self) -> None:
        """Load the newest durable READY version as a whole (the only way out of TORN)."""
        newest, found = self._newest_durable()
        if found is None:
            (log.debug if self._waiting_for_durable else log.error)(
                "replica %s is torn and no durable READY version exists yet; staying paused", self.config.replica_id
            )
            self._waiting_for_durable = True
            return
        self._waiting_for_durable = False
        self._load_from_volume(newest, "recover", found[1], found[0])

    def roll_back(self, failed: int) -> None:
        """Leave version ``failed``, which this replica loaded whole before the version failed: load the newest
        durable READY version (from the volume, as a recovery does)."""
        newest, found = self._newest_durable()
        if found is None:
            log.warning(
                "replica %s: v%d failed after this replica loaded it, and no durable READY version exists to go back "
                "to; it keeps serving v%d",
                self.config.replica_id,
                failed,
                failed,
            )
            self.events.append(("rollback", failed, "kept: no durable READY version"))
            return
        log.info("replica %s: v%d failed after it loaded; back to v%d", self.config.replica_id, failed, newest)
        self._load_from_volume(newest, "rollback", found[1], found[0])

    def follow_durable(self) -> None:
        """Catch up when the fleet moved on while this replica was in no plan (it joined between versions), and
        retry the recovery of a torn replica; both with the backoff of a refused version."""
        while not self._stop.wait(self.config.lag_check_s):
            try:
                with self._lock:
                    torn = self.replica.state is EngineState.TORN
                    if torn:
                        self.recover()
                        continue
                    newest = self.client.get_job().newest_durable_ready
                    if newest > self.replica.version and self.replica.state is EngineState.SERVING:
                        found = self._volume_plan(newest)
                        if found is not None:
                            self._load_from_volume(newest, "catch-up", found[1], found[0])
            except WeightsyncError as e:
                log.warning("replica %s: catch-up check failed: %s", self.config.replica_id, e)

    def _observe(self, channel: Channel, seconds: dict[SyncPhase, float]) -> None:
        if self.metrics is None:
            return
        self.metrics.version.set(self.replica.version)
        self.metrics.version_lag.set(max(0, self.client.get_job().newest_ready - self.replica.version))
        for phase, value in seconds.items():
            self.metrics.sync_seconds.labels(phase.value, channel.value).observe(value)


@dataclass(frozen=True)
class RegionsReceived:
    """One version on the sharded path, by the workers' own account."""

    version: int
    nbytes: dict[int, int]
    """Worker -> bytes it received (exactly what its regions hold)."""
    content_digest: str
    """The workers' per-region digests of what arrived, combined in plan order: what the replica acks."""


def regions_received(
    version: int, table: TensorTable, part: ReplicaPlan, answers: Sequence[Mapping[str, Any]]
) -> RegionsReceived:
    """The workers' answers to a sharded update (``sharded.receive``), checked: each landed regions of
    ``table`` and received exactly the bytes its regions in ``part`` hold; their per-region digests of what
    arrived combined in plan order (``regions.combine``: a worker that reports fewer or more digests than its
    regions fails it). ``IntegrityError`` otherwise: the replica acks only what its engine computed."""
    from weightsync.channels import regions

    need: dict[int, int] = collections.Counter()
    for r in part.regions:
        need[r.worker] += r.nbytes
    got = {int(w["worker"]): int(w["nbytes"]) for w in answers}
    layouts = {str(w["layout_digest"]) for w in answers}
    if layouts != {table.layout_digest()}:
        raise IntegrityError(f"the workers landed regions of tables {sorted(layouts)}, not the version's")
    if got != dict(need):
        raise IntegrityError(f"the workers received {got} bytes; their regions hold {dict(need)}")
    digests = {int(w["worker"]): list(w["digests"]) for w in answers}
    return RegionsReceived(version, got, regions.combine(part.regions, digests, regions.worker_of))


def _sharded_copy(ticket: UpdateTicket) -> bool:
    """Whether the version's volume copy is sharded (format v2), by its manifest checked against the recorded
    checksum; False for a v1 copy or one that cannot be read here (the whole read then reports why)."""
    from weightsync.channels import manifests

    if not ticket.root:
        return False
    directory = manifests.version_dir(Path(ticket.root), ticket.version)
    try:
        return manifests.read(directory, ticket.version, ticket.manifest_checksum).sharded
    except (WeightsyncError, OSError, ValueError):
        return False


def why_volume(version: int) -> str:
    return f"load version {version} from the volume (newest durable READY)"
