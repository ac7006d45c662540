"""A version's staging: opening it with a plan per replica, then what replicas and the publisher report.

``open_version`` is idempotent per ``(incarnation, step)``: a retried open gets
the same version and plans back (``reused``). Steps never go backwards within an
incarnation; a new incarnation (a restarted trainer) may publish from an older
step, and the version number still grows. Only replicas that are watching
(``streams.listening``) are negotiated; each one planned on a live channel gets
its ASSIGN now, one planned on the volume once the version is durable.

Replica reports:

- ``report_progress(JOINED)`` moves a planned replica to JOINED; the publisher's
  ``wait_version(RECEIVERS_JOINED)`` is woken only when the last live receiver
  joined (``reached``);
- ``ack`` records LOADED or FAILED. An ok ack is still a failure when its layout
  digest is not the version's table's, or its content digest disagrees with what
  the trainer sent (or, before the trainer's report arrived, with what other
  replicas loaded). A replica whose live channel failed (``channel_failed``) is
  re-planned on the volume for the same version when it and the trainer share
  one (``_fall_back``), and skips that channel from then on; the ASSIGN goes out
  at once if the version is already durable, else when it becomes durable.
- an ack for a settled version outside any plan (a catch-up or a recovery from
  the volume) is recorded among the version's replicas, LOADED or FAILED with
  its reason, and saved (so its ``WeightVersion`` shows it); it never changes
  the version's verdict.

The publisher's ``report_sent`` records the content digest it sent, which the
ack policy needs before any version is READY, and fails replicas that already
acked different bytes. Every report ends in ``verdicts.settle``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weightsync import metrics as metrics_mod
from weightsync.channels import rules
from weightsync.channels.base import Offer, Rendezvous
from weightsync.coordinator import faults, lifecycle, negotiation, streams, verdicts
from weightsync.coordinator.jobs import Job, Member
from weightsync.coordinator.lifecycle import VersionRecord
from weightsync.coordinator.models import (
    LIVE_CHANNELS,
    SETTLED_STATES,
    AckReport,
    Capabilities,
    ChannelPlan,
    OpenedVersion,
    Progress,
    Role,
    SentReport,
    TableSummary,
    VersionInfo,
    WaitFor,
)
from weightsync.coordinator.negotiation import GroupState
from weightsync.coordinator.state import CoreState
from weightsync.sharding import links as sharding_links
from weightsync.sharding import plans as sharding_plans
from weightsync.sharding.fills import EngineLayout
from weightsync.sharding.plans import Region, TransferPlan
from weightsync.sharding.shards import TrainerLayout
from weightsync.vocabulary import Channel, ReplicaState, SyncPhase, VersionState

log = logging.getLogger(__name__)
RETAIN_IN_MEMORY = 256
"""Versions a job keeps in memory (the store keeps its own): older settled ones are forgotten on open."""


def _await_members(state: CoreState, job: Job) -> None:
    """After a restart the coordinator knows no member until each registers again, which every live one does
    within a lease TTL (it renews three times per TTL). A version opened sooner would be planned for the few
    that were quick (or for none, and fail): a recovered job opens none until one TTL after the start. The
    client retries UNAVAILABLE with backoff, so the trainer's open just takes that long."""
    if not job.recovered:
        return
    left = state.started + state.lease_ttl_s - state.clock.monotonic()
    if left > 0:
        raise faults.Unavailable(
            f"job {job.name}: the coordinator restarted and gives replicas one lease TTL to register again "
            f"before it plans a version; retry in {left:.1f}s"
        )


def open_version(
    state: CoreState,
    lease_id: str,
    job_name: str,
    incarnation: str,
    step: int,
    table: TableSummary,
    offers: Sequence[Offer],
    compute_plan: bool = True,
) -> OpenedVersion:
    """``compute_plan``: a transfer plan the job's cache lacks is computed here; else ``sharding.plans.Unplanned``
    is raised before anything changed (the core computes it off its lock and opens again)."""
    job = state.job(job_name)
    trainer = state.member(lease_id, Role.TRAINER)
    if trainer.job != job_name:
        raise faults.PermissionDenied(f"lease belongs to job {trainer.job!r}, not {job_name!r}")
    if incarnation != trainer.incarnation:
        raise faults.InvalidArgument(
            f"incarnation {incarnation!r} differs from the registered {trainer.incarnation!r}; "
            "register again after a restart"
        )
    key = (incarnation, step)
    if key not in job.keys:
        _await_members(state, job)
    if key in job.keys and job.keys[key] in job.versions:
        rec = job.versions[job.keys[key]]
        return OpenedVersion(rec.version, tuple(rec.plans[r] for r in sorted(rec.plans)), True)
    last = job.last_step.get(incarnation)
    if last is not None and step < last:
        raise faults.FailedPrecondition(
            f"step {step} goes backwards: incarnation {incarnation!r} already published step {last}; "
            "versions never go backwards (register a new incarnation to publish from an older step)"
        )
    all_offers = {**trainer.offers, **{o.channel: o for o in offers}}
    now = state.clock.monotonic()
    candidates = [
        negotiation.Candidate(m.member_id, m.incarnation, m.capabilities, m.channels_off(now))
        for m in job.members.values()
        if m.role is Role.REPLICA and streams.listening(state, m, now)
    ]

    def negotiate(regions: frozenset[str]) -> tuple[list[ChannelPlan], list[tuple[str, str]], GroupState]:
        return negotiation.negotiate(
            trainer.capabilities,
            all_offers,
            candidates,
            job.policy.channel_preference,
            job.groups,
            job.next_version,
            job.policy.join_timeout_s,
            regions,
        )

    # the replicas that may take regions are negotiated apart (NCCL's one rank per GPU of the gathered group does
    # not hold them back); those the plan then sends none are negotiated again with the rest
    apart = _may_take_regions(job, trainer, table)
    plans, unplanned, groups = negotiate(apart)
    planned = _transfer(job, trainer, table, plans, compute_plan)
    if planned is not None and planned.sharded != apart:
        plans, unplanned, groups = negotiate(planned.sharded)
        planned = _transfer(job, trainer, table, plans, compute_plan)
    job.groups = groups
    plans = planned.parts(plans) if planned is not None else plans
    rec = VersionRecord(
        job_name,
        job.next_version,
        step,
        incarnation,
        table,
        {p.replica_id: p for p in plans},
        quorum=job.policy.ack_quorum,
        ready_without_acks=job.policy.ready_without_acks,
        all_or_nothing=job.policy.all_or_nothing,
        opened_at=state.clock.time(),
        opened_mono=now,
    )
    job.next_version += 1
    job.versions[rec.version] = rec
    job.keys[key] = rec.version
    job.last_step[incarnation] = step
    for rid, reason in unplanned:
        log.warning("job %s v%d: replica %s left out: %s", job_name, rec.version, rid, reason)
    if state.metrics:
        for p in plans:
            state.metrics.negotiations_total.labels(p.channel.value).inc()
        for _ in unplanned:
            state.metrics.negotiations_total.labels(metrics_mod.NEGOTIATION_NONE).inc()
    for p in plans:
        if p.channel in LIVE_CHANNELS:  # volume plans are sent once the version is durable
            streams.assign(job.members[p.replica_id], job, rec, p)
    state.store.save(rec.info(with_replicas=False))
    verdicts.settle(state, job, rec)
    _trim(job)
    state.dirty = True
    return OpenedVersion(rec.version, tuple(plans))


@dataclass(frozen=True)
class _Planned:
    """The version's transfer plan before the rendezvous are final: which replicas it sends regions."""

    layout: TrainerLayout
    members: tuple[sharding_plans.Member, ...]
    whole: TransferPlan
    rank_gpus: tuple[str, ...]
    """Each trainer rank's GPU UUID, in rank order."""
    worker_gpus: Mapping[str, tuple[str, ...]]
    """Each replica's workers' GPU UUIDs, in worker order."""
    peer_gpus: Mapping[str, tuple[str, ...]]
    """Each replica's peer GPUs (``Capabilities.peer_gpu_uuids``), where its workers may copy (else none)."""

    @functools.cached_property
    def sharded(self) -> frozenset[str]:
        return frozenset(
            m.replica_id
            for m in self.members
            if m.layout is not None and self.whole.part_for_replica(m.replica_id).replicas[0].sharded
        )

    def parts(self, plans: list[ChannelPlan]) -> list[ChannelPlan]:
        """Each replica's plan with its part, a replica sent regions with its region group's rendezvous
        (``region_group``, from the membership of its own ``negotiate`` gave it). Rank 0 reads every replica's part
        from them and hands each trainer rank the round."""
        sharded, out = self.sharded, []
        for p, m in zip(plans, self.members, strict=True):
            rdv, part = p.rendezvous, self.whole.part_for_replica(p.replica_id)
            if p.replica_id in sharded and m.layout is not None:
                rdv = region_group(rdv, self.layout.world_size, len(m.layout.workers))
                if p.channel is Channel.NCCL:  # NIXL reads every link, a worker on a rank's GPU too
                    part = self._with_copies(part)
            out.append(dataclasses.replace(p, rendezvous=rdv, transfer=part))
        return out

    def _with_copies(self, part: TransferPlan) -> TransferPlan:
        """A sharded replica's part with the links its workers copy by CUDA IPC (``sharding.links.copied``: a
        trainer rank on the worker's GPU, where ``rules.regions`` planned it on regions only if it can copy, or on a
        GPU the replica reaches peer-to-peer, where ``rules.no_copies`` says it can)."""
        (rp,) = part.replicas
        ranks, workers = dict(enumerate(self.rank_gpus)), dict(enumerate(self.worker_gpus[rp.replica_id]))
        copied = sharding_links.copied(rp.regions, ranks, workers, self.peer_gpus[rp.replica_id])
        return dataclasses.replace(part, replicas=(dataclasses.replace(rp, copied=copied),)) if copied else part


def _transfer(
    job: Job, trainer: Member, table: TableSummary, plans: list[ChannelPlan], compute: bool = True
) -> _Planned | None:
    """The version's transfer plan, when the trainer registered a layout of this table: each replica its regions,
    or why it takes the gathered path (its channel carries no regions, or not to its GPUs; it registered no
    layout; its layout was recorded against another table), each trainer rank its own. From the job's cache: the
    same layouts and membership reuse the last version's plan."""
    layout = _layout_of(trainer, table)
    if layout is None:
        if isinstance(trainer.layout, TrainerLayout):
            log.warning(
                "job %s: the trainer's registered layout is of another table than this version's; every replica "
                "takes the gathered path (the publisher registers again with a new table)",
                job.name,
            )
        return None
    # an all-or-nothing replica stages the version before its commit; the sharded path lands in place (for now)
    staged = (
        "all-or-nothing: the replica stages the version, and regions land in place" if job.policy.all_or_nothing else ""
    )
    members = []
    for p in plans:
        member = job.members[p.replica_id]
        engine = member.layout if isinstance(member.layout, EngineLayout) else None
        why = rules.regions(p.channel, trainer.capabilities, member.capabilities) or staged
        members.append(sharding_plans.Member(p.replica_id, engine, why))
    caps = {p.replica_id: job.members[p.replica_id].capabilities for p in plans}
    workers = {r: c.gpu_uuids for r, c in caps.items()}
    peers = {r: () if rules.no_copies(trainer.capabilities, c) else c.peer_gpu_uuids for r, c in caps.items()}
    whole = job.transfer_plans.get(layout, members, compute)
    return _Planned(layout, tuple(members), whole, trainer.capabilities.rank_gpu_uuids, workers, peers)


def _layout_of(trainer: Member, table: TableSummary) -> TrainerLayout | None:
    """The trainer's registered layout, when it is one of this version's table (else every replica is gathered)."""
    layout = trainer.layout
    if not isinstance(layout, TrainerLayout) or layout.table.layout_digest() != table.layout_digest:
        return None
    return layout


def _may_take_regions(job: Job, trainer: Member, table: TableSummary) -> frozenset[str]:
    """The replicas the transfer plan may send regions, whatever their channel: every one that registered an engine
    layout, when the trainer registered a layout of this table and the job does not stage (``_transfer``)."""
    if job.policy.all_or_nothing or _layout_of(trainer, table) is None:
        return frozenset()
    return frozenset(
        m.member_id for m in job.members.values() if m.role is Role.REPLICA and isinstance(m.layout, EngineLayout)
    )


def region_group(rdv: Rendezvous, trainers: int, workers: int) -> Rendezvous:
    """The rendezvous of one replica's region group, from its channel's plan for it (a membership of its own,
    ``negotiation.group_key(..., regions=True)``): the same store (trainer rank 0's, the endpoint the publisher
    offered for the channel), name and secret, the trainer's ranks as group ranks ``0..trainers-1`` and the
    replica's workers after them (``rank`` = ``trainers``, the first worker's). Both ends keep the group across
    versions while its name holds (``region_groups.Kept``): the membership's name changes with its members or
    endpoint and after a failure (``_group_key``), and a group is formed once per name. No trainer rank needs an
    endpoint of its own: each joins rank 0's store (over gloo it binds its own host's address, which gloo
    exchanges through the store; NCCL exchanges its own through the store likewise)."""
    return dataclasses.replace(rdv, rank=trainers, world_size=trainers + workers)


def _group_key(planned: ChannelPlan) -> str:
    return negotiation.group_key(planned.channel, planned.replica_id, planned.regions_part() is not None)


def _trim(job: Job) -> None:
    """Forget the oldest settled versions beyond ``RETAIN_IN_MEMORY`` (never STAGING, never the newest durable)."""
    if len(job.versions) <= RETAIN_IN_MEMORY:
        return
    durable = job.newest(durable=True)
    for v in sorted(job.versions)[:-RETAIN_IN_MEMORY]:
        if job.versions[v].state is not VersionState.STAGING and (durable is None or v != durable.version):
            rec = job.versions.pop(v)
            job.keys.pop((rec.incarnation, rec.step), None)


def report_progress(state: CoreState, lease_id: str, version: int, progress: Progress) -> None:
    member = state.member(lease_id, Role.REPLICA)
    job = state.job(member.job)
    rec = state.record(job, version)
    rid = member.member_id
    planned = rec.plans.get(rid)
    live = planned is not None and planned.channel in LIVE_CHANNELS  # not one moved to the volume meanwhile
    if progress is Progress.JOINED and live and rec.status.get(rid) is ReplicaState.PLANNED:
        rec.set(rid, ReplicaState.JOINED)
        if rec.receivers_joined():
            state.wake()
    elif progress is Progress.STAGED:
        _staged(state, job, rec, member)


def _staged(state: CoreState, job: Job, rec: VersionRecord, member: Member) -> None:
    """An all-or-nothing replica staged ``rec``: it may complete the policy's commit, or get its own COMMIT when
    the version was committed already."""
    rid = member.member_id
    status = rec.status.get(rid)
    if not rec.all_or_nothing or rec.state is not VersionState.STAGING or status not in lifecycle.WAITING:
        return
    if status is not ReplicaState.STAGED:
        was_planned = status is ReplicaState.PLANNED
        rec.set(rid, ReplicaState.STAGED)
        if was_planned and rec.receivers_joined():
            state.wake()
    if rec.committed:
        streams.commit(member, job, rec)
    verdicts.settle(state, job, rec)
    state.dirty = True


def ack(state: CoreState, lease_id: str, report: AckReport) -> VersionState:
    member = state.member(lease_id, Role.REPLICA)
    job = state.job(member.job)
    rec = state.record(job, report.version)
    rid = member.member_id
    if member.catching_up == report.version:
        member.catching_up = 0
    ok, error = report.ok, report.error
    if ok and report.layout_digest != rec.table.layout_digest:
        ok, error = (
            False,
            f"layout_digest {report.layout_digest!r} does not match version {rec.version}'s "
            f"{rec.table.layout_digest!r}: the replica loaded a different table",
        )
    if ok:
        read_with = _read_with(member, report)
        error = _content_mismatch(rec, rid, report.content_digest, read_with)
        ok = not error
        if ok and read_with:
            rec.read_regions[rid] = read_with
        elif ok:
            rec.read_regions.pop(rid, None)
    planned = rec.plans.get(rid)
    waiting = planned is not None and rec.status.get(rid) in lifecycle.WAITING
    if waiting and not ok and report.channel_failed and rid in rec.fell_back:
        # its live channel's failure, told after the publisher's report of it moved this replica to the volume
        # already: the volume plan stands
        log.info("job %s v%d: %s's late report of its live channel's failure: %s", job.name, rec.version, rid, error)
        return rec.state
    fell_back = (
        planned is not None
        and waiting
        and not ok
        and report.channel_failed
        and _fall_back(state, job, rec, member, planned, error)
    )
    if fell_back:
        state.dirty = True
        return rec.state
    member.last_failed = not ok
    if ok:
        member.current_version = max(member.current_version, rec.version)
        rec.content[rid] = report.content_digest
        if planned is not None:
            member.failed_channels.pop(planned.channel, None)  # the channel works again
    metrics = state.metrics
    if planned is not None and waiting:
        was_planned = rec.status[rid] is ReplicaState.PLANNED
        rec.set(rid, ReplicaState.LOADED if ok else ReplicaState.FAILED)
        if was_planned and rec.receivers_joined():
            state.wake()
        if error:
            rec.errors[rid] = error
        if metrics:
            for phase, seconds in report.phases.items():
                metrics.sync_seconds.labels(phase.value, planned.channel.value).observe(seconds)
            if ok:
                metrics.bytes_total.labels(planned.channel.value).inc(rec.table.total_bytes)
        verdicts.settle(state, job, rec)
    elif rec.state is not VersionState.STAGING:  # a catch-up or recovery from the volume, outside any plan
        if rec.record_load(rid, ok, error):
            state.store.save(rec.info(with_replicas=False))  # the WeightVersion shows who failed to load it, and why
        if metrics and ok and SyncPhase.TOTAL in report.phases:
            total = report.phases[SyncPhase.TOTAL]
            metrics.sync_seconds.labels(SyncPhase.TOTAL.value, Channel.VOLUME.value).observe(total)
    state.dirty = True
    return rec.state


def _sent_regions(rec: VersionRecord, rid: str) -> bool:
    """Whether ``rid`` is planned on the sharded path (its live plan's part has regions): its digest is over the
    regions its workers received, in plan order, which no other replica's is comparable with."""
    planned = rec.plans.get(rid)
    return planned is not None and planned.regions_part() is not None


def _read_with(member: Member, report: AckReport) -> str:
    """For an ack of a region read from a sharded volume copy (``regions_read``): the digest of the engine layout
    the replica registered, which its digest is comparable under; empty for any other ack."""
    if not report.regions_read:
        return ""
    layout = member.layout
    return layout.digest() if isinstance(layout, EngineLayout) else "no engine layout registered"


def _content_mismatch(rec: VersionRecord, rid: str, digest: str, read_with: str | None = None) -> str:
    """Why a replica's content digest is wrong: not what the trainer sent (for a replica sent regions: the
    senders' combined digest of its regions; it must have one), or (before the trainer's report arrived) not what
    other replicas loaded whole; for a region read from the volume (``read_with``: the engine layout it read with;
    None: as recorded), not what other replicas read with the same layout; empty when it agrees or there is
    nothing to compare yet. A region read is never compared with whole loads or the trainer's digest, nor they
    with it: a worker holding a slice cannot compute per-tensor digests."""
    read_with = rec.read_regions.get(rid, "") if read_with is None else read_with
    if read_with:
        same = {d for r, d in rec.content.items() if d and r != rid and rec.read_regions.get(r) == read_with}
        if digest and same and digest not in same:
            return (
                f"content_digest {digest} differs from the {min(same)} of other replicas that read this version by "
                "region with the same engine layout: the bytes its workers read differ"
            )
        return ""
    if _sent_regions(rec, rid):
        if not rec.sent:
            return ""  # checked when the trainer's report arrives (``report_sent``)
        sent = rec.region_digests.get(rid, "")
        if digest != sent:
            return (
                f"content_digest {digest or 'none'} is not the {sent or 'no'} combined region digest the trainer's "
                "ranks sent: the regions this replica's workers received differ from what the ranks sent"
            )
        return ""
    if not digest:
        return ""
    if rec.content_digest:
        if digest != rec.content_digest:
            return (
                f"content_digest {digest} is not the {rec.content_digest} the trainer sent: the bytes this "
                "replica's engine loaded differ from the trainer's"
            )
        return ""
    others = {
        d for r, d in rec.content.items() if d and r != rid and not _sent_regions(rec, r) and r not in rec.read_regions
    }
    if others and digest not in others:
        return f"content_digest {digest} differs from other replicas' {min(others)}: the bytes it loaded differ"
    return ""


def _fall_back(
    state: CoreState, job: Job, rec: VersionRecord, member: Member, planned: ChannelPlan, error: str
) -> bool:
    """A live channel failed for this replica: plan it on the volume for this version (and keep it off the
    channel for a while, ``Member.fail_channel``). False when it cannot take the volume (no shared volume, or
    it was the volume)."""
    trainer = job.trainer()
    if planned.channel is Channel.VOLUME:
        return False
    member.fail_channel(planned.channel, state.clock.monotonic())
    job.groups = job.groups.without(_group_key(planned))
    reason = rules.between(
        Channel.VOLUME,
        trainer.capabilities if trainer else Capabilities(),
        trainer.offers.get(Channel.VOLUME) if trainer else None,
        member.capabilities,
    )
    if reason:
        return False
    plan = ChannelPlan(
        member.member_id,
        Channel.VOLUME,
        Rendezvous(Channel.VOLUME, root=member.capabilities.volume_mount),
        f"volume: {planned.channel.value} failed ({error[:200]})",
        rec.manifest_checksum,
    )
    rec.replan(plan)
    rec.errors[member.member_id] = f"{planned.channel.value} failed, loading from the volume: {error}"
    log.warning("job %s v%d: %s", job.name, rec.version, rec.errors[member.member_id])
    if rec.durable:
        streams.assign(member, job, rec, plan)
    state.wake()
    return True


def _trainers_version(state: CoreState, lease_id: str, version: int) -> tuple[Job, VersionRecord]:
    trainer = state.member(lease_id, Role.TRAINER)
    job = state.job(trainer.job)
    rec = state.record(job, version)
    if rec.incarnation != trainer.incarnation:
        raise faults.PermissionDenied(f"version {version} was opened by another trainer incarnation")
    return job, rec


def _lost(state: CoreState, job: Job, rec: VersionRecord, lost: Mapping[str, str]) -> None:
    """The publisher's senders lost these receivers (they missed the join deadline, or their channel failed
    mid-transfer): each one still waiting on a live plan falls back to the volume now, alone (its channel is kept
    off for it only). One that cannot take the volume keeps its plan with the trainer's word recorded: its own
    ack or its lease decides (a replica that died is dropped, and does not fail the version for the others). The
    others' plans are not touched. The caller settles the version."""
    for rid, why in sorted(lost.items()):
        planned, member = rec.plans.get(rid), job.members.get(rid)
        if planned is None or planned.channel not in LIVE_CHANNELS:
            continue  # fell back already
        job.groups = job.groups.without(_group_key(planned))
        if rec.status.get(rid) not in lifecycle.WAITING:
            continue  # loaded already, or dropped with its lease
        error = f"the trainer's sender lost it: {why}"
        if member is None or not _fall_back(state, job, rec, member, planned, error):
            rec.errors.setdefault(rid, f"{error}; it has no volume to fall back to")
    state.dirty = True


def plan_regions(state: CoreState, lease_id: str, plan_key: str, replica_id: str) -> tuple[Region, ...]:
    """Replica ``replica_id``'s regions of the plan computed under ``plan_key``: for the job's trainer (rank 0 reads
    every replica's part) or the replica itself, while the job's plan cache holds the plan."""
    member = state.member(lease_id)
    if member.role is Role.REPLICA and member.member_id != replica_id:
        raise faults.PermissionDenied(
            f"replica {member.member_id!r} asked for replica {replica_id!r}'s regions; a replica reads its own only"
        )
    found = state.job(member.job).transfer_plans.find(plan_key)
    if found is None:
        raise faults.NotFound(
            f"job {member.job!r} holds no plan {plan_key[:19]}... any more (its layouts or membership changed since): "
            "the next version carries the new plan"
        )
    part = next((r for r in found.replicas if r.replica_id == replica_id), None)
    if part is None:
        raise faults.NotFound(f"plan {plan_key[:19]}... of job {member.job!r} has no replica {replica_id!r}")
    return part.regions


def report_lost(state: CoreState, lease_id: str, version: int, lost: Mapping[str, str]) -> None:
    job, rec = _trainers_version(state, lease_id, version)
    if rec.state is VersionState.STAGING:
        _lost(state, job, rec, lost)
        verdicts.settle(state, job, rec)


def report_sent(state: CoreState, lease_id: str, version: int, sent: SentReport) -> VersionInfo:
    job, rec = _trainers_version(state, lease_id, version)
    rec.content_digest, rec.sent = sent.content_digest, True
    rec.region_digests = dict(sent.region_digests)
    if rec.state is VersionState.STAGING:
        _lost(state, job, rec, sent.failed)  # those not reported lost already
    if sent.volume_error and rec.state is VersionState.STAGING:
        for rid in rec.volume_waiting():  # nothing to fall back to from the volume
            rec.set(rid, ReplicaState.FAILED)
            rec.errors[rid] = f"the trainer could not write the volume copy: {sent.volume_error}"
    for rid, digest in list(rec.content.items()):
        mismatch = _content_mismatch(rec, rid, digest)
        if mismatch and rec.status.get(rid) is ReplicaState.LOADED and rec.state is VersionState.STAGING:
            rec.set(rid, ReplicaState.FAILED)
            rec.errors[rid] = mismatch
    verdicts.settle(state, job, rec)
    state.dirty = True
    return rec.info()


def reached(rec: VersionRecord, until: WaitFor) -> bool:
    """Whether a ``wait_version(until)`` on ``rec`` may return: it settled, or reached what was asked."""
    if rec.state in SETTLED_STATES:
        return True
    if until is WaitFor.RECEIVERS_JOINED:
        return rec.receivers_joined()
    return until is WaitFor.SETTLED_OR_DURABLE_NEEDED and rec.durable_needed
