"""The edge between wire messages and domain objects: every conversion, in both directions.

Only this module (and the service table) touches the generated ``_proto`` code.
Parsing validates as it goes and raises ``faults.InvalidArgument`` naming the
field path (``capabilities.channels[1]``), the value received, and the fix, so the
servicer can return it as-is with the INVALID_ARGUMENT status.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from weightsync.channels.base import Endpoint, Offer, Rendezvous
from weightsync.coordinator import faults, models
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.errors import PermanentError
from weightsync.jobconfig import DEFAULT_JOIN_TIMEOUT_S
from weightsync.sharding import fills, plans, shards
from weightsync.sharding.boxes import Box
from weightsync.tensors import TensorTable, is_digest
from weightsync.vocabulary import Channel, ReplicaState, SyncPhase, VersionState


def _enum_maps(prefix: str, values: Iterable[str], wire: object) -> tuple[dict[int, str], dict[str, Any]]:
    # outgoing values are typed Any: the stubs type enum fields as the generated enum classes, which are ints
    to_domain = {getattr(wire, prefix + v.upper()): v for v in values}
    return to_domain, {v: k for k, v in to_domain.items()}


_CH_IN, _CH_OUT = _enum_maps("CHANNEL_", [c.value for c in Channel], pb)
_VS_IN, _VS_OUT = _enum_maps("VERSION_STATE_", [s.value for s in VersionState], pb)
_PH_IN, _PH_OUT = _enum_maps("SYNC_PHASE_", [p.value for p in SyncPhase], pb)
_RO_IN, _RO_OUT = _enum_maps("ROLE_", [r.value for r in models.Role], pb)
_EN_IN, _EN_OUT = _enum_maps("ENGINE_KIND_", [e.value for e in models.EngineKind], pb)
_EV_IN, _EV_OUT = _enum_maps("EVENT_KIND_", [e.value for e in models.EventKind], pb)
_PR_IN, _PR_OUT = _enum_maps("PROGRESS_", [p.value for p in models.Progress], pb)
_WF_IN, _WF_OUT = _enum_maps("WAIT_FOR_", [w.value for w in models.WaitFor], pb)
_RS_IN, _RS_OUT = _enum_maps("REPLICA_STATE_", [r.value for r in ReplicaState], pb)
_T = TypeVar("_T")


def _parse(table: Mapping[int, str], value: int, field: str) -> str:
    try:
        return table[value]
    except KeyError:
        valid = ", ".join(table.values())
        raise faults.InvalidArgument(f"{field} is {value} (unset or unknown); valid values: {valid}") from None


def channel(value: int, field: str) -> Channel:
    return Channel(_parse(_CH_IN, value, field))


def channel_to(value: Channel) -> Any:
    return _CH_OUT[value.value]


def state(value: int, field: str = "state") -> VersionState:
    return VersionState(_parse(_VS_IN, value, field))


def role(value: int, field: str = "role") -> models.Role:
    return models.Role(_parse(_RO_IN, value, field))


def progress(value: int, field: str = "progress") -> models.Progress:
    return models.Progress(_parse(_PR_IN, value, field))


def wait_for(value: int, field: str = "until") -> models.WaitFor:
    return models.WaitFor(_parse(_WF_IN, value, field))


def wait_for_to(value: models.WaitFor) -> Any:
    return _WF_OUT[value.value]


def progress_to(value: models.Progress) -> Any:
    return _PR_OUT[value.value]


def state_to(value: VersionState) -> Any:
    return _VS_OUT[value.value]


# ---- capabilities, offers, policy ------------------------------------------------------------------------------


def capabilities(m: pb.Capabilities, field: str = "capabilities") -> models.Capabilities:
    engine = models.EngineKind(_parse(_EN_IN, m.engine, f"{field}.engine")) if m.engine else models.EngineKind.CPU
    return models.Capabilities(
        host=m.host,
        gpu_uuids=tuple(m.gpu_uuids),
        devices=m.devices or 1,
        channels=tuple(channel(c, f"{field}.channels[{i}]") for i, c in enumerate(m.channels)),
        nccl_domain=m.nccl_domain,
        nixl=m.nixl,
        volume_id=m.volume_id,
        volume_mount=m.volume_mount,
        engine=engine,
        rank_gpu_uuids=tuple(m.rank_gpu_uuids),
        peer_gpu_uuids=tuple(m.peer_gpu_uuids),
    )


def capabilities_to(c: models.Capabilities) -> pb.Capabilities:
    return pb.Capabilities(
        host=c.host,
        gpu_uuids=list(c.gpu_uuids),
        devices=c.devices,
        channels=[channel_to(x) for x in c.channels],
        nccl_domain=c.nccl_domain,
        nixl=c.nixl,
        volume_id=c.volume_id,
        volume_mount=c.volume_mount,
        rank_gpu_uuids=list(c.rank_gpu_uuids),
        peer_gpu_uuids=list(c.peer_gpu_uuids),
        engine=_EN_OUT[c.engine.value],
    )


def _endpoint(host: str, port: int, field: str) -> Endpoint | None:
    if not host and not port:
        return None
    try:
        return Endpoint(host, port)
    except PermanentError as e:
        raise faults.InvalidArgument(f"{field}: {e}") from None


def offer(m: pb.SenderOffer, field: str) -> Offer:
    return Offer(
        channel(m.channel, f"{field}.channel"),
        _endpoint(m.host, m.port, field),
        tuple(m.devices),
        m.agent,
        m.metadata,
        m.epoch,
    )


def offer_to(o: Offer) -> pb.SenderOffer:
    return pb.SenderOffer(
        channel=channel_to(o.channel),
        host=o.endpoint.host if o.endpoint else "",
        port=o.endpoint.port if o.endpoint else 0,
        devices=list(o.devices),
        agent=o.agent,
        metadata=o.metadata,
        epoch=o.epoch,
    )


def policy(m: pb.JobPolicy, default: models.JobPolicy, field: str = "policy") -> models.JobPolicy:
    pref = tuple(channel(c, f"{field}.channel_preference[{i}]") for i, c in enumerate(m.channel_preference))
    try:
        return models.JobPolicy(
            channel_preference=pref or default.channel_preference,
            ack_quorum=m.ack_quorum or default.ack_quorum,
            version_timeout_s=m.version_timeout_s or default.version_timeout_s,
            retention=m.retention or default.retention,
            ready_without_acks=m.ready_without_acks or default.ready_without_acks,
            all_or_nothing=m.all_or_nothing or default.all_or_nothing,
            join_timeout_s=m.join_timeout_s or default.join_timeout_s,
        )
    except PermanentError as e:
        raise faults.InvalidArgument(str(e)) from None


def policy_to(p: models.JobPolicy) -> pb.JobPolicy:
    return pb.JobPolicy(
        channel_preference=[channel_to(c) for c in p.channel_preference],
        ack_quorum=p.ack_quorum,
        version_timeout_s=p.version_timeout_s,
        retention=p.retention,
        ready_without_acks=p.ready_without_acks,
        all_or_nothing=p.all_or_nothing,
        join_timeout_s=p.join_timeout_s,
    )


# ---- versions ----------------------------------------------------------------------------------------------------


def table(m: pb.TableSummary, field: str = "table") -> models.TableSummary:
    try:
        return models.TableSummary(m.tensor_count, m.total_bytes, m.layout_digest, not m.unverified)
    except PermanentError as e:
        raise faults.InvalidArgument(f"{field}: {e}") from None


def table_to(t: models.TableSummary | None) -> pb.TableSummary | None:
    return (
        None
        if t is None
        else pb.TableSummary(
            tensor_count=t.tensor_count,
            total_bytes=t.total_bytes,
            layout_digest=t.layout_digest,
            unverified=not t.verified,
        )
    )


def rendezvous(m: pb.Rendezvous, ch: Channel, field: str) -> Rendezvous:
    try:
        return Rendezvous(
            ch,
            endpoint=_endpoint(m.host, m.port, f"{field}.rendezvous"),
            group=m.group,
            secret=m.secret,
            generation=m.generation,
            rank=m.rank,
            world_size=m.world_size,
            agent=m.agent,
            metadata=m.metadata,
            epoch=m.epoch,
            root=m.root,
            join_timeout_s=m.join_timeout_s or DEFAULT_JOIN_TIMEOUT_S,
        )
    except PermanentError as e:
        raise faults.InvalidArgument(f"{field}.rendezvous: {e}") from None


def rendezvous_to(r: Rendezvous) -> pb.Rendezvous:
    return pb.Rendezvous(
        host=r.endpoint.host if r.endpoint else "",
        port=r.endpoint.port if r.endpoint else 0,
        group=r.group,
        secret=r.secret,
        generation=r.generation,
        rank=r.rank,
        world_size=r.world_size,
        agent=r.agent,
        metadata=r.metadata,
        epoch=r.epoch,
        root=r.root,
        join_timeout_s=r.join_timeout_s,
    )


def plan(m: pb.ChannelPlan, field: str = "plan", held: HeldRegions | None = None) -> models.ChannelPlan:
    ch = channel(m.channel, f"{field}.channel")
    transfer = transfer_part(m.transfer, f"{field}.transfer", held) if m.HasField("transfer") else None
    return models.ChannelPlan(
        m.replica_id, ch, rendezvous(m.rendezvous, ch, field), m.reason, _digest(m.manifest_checksum, field), transfer
    )


def plan_to(p: models.ChannelPlan, held: HeldRegions | None = None, room: Room | None = None) -> pb.ChannelPlan:
    return pb.ChannelPlan(
        replica_id=p.replica_id,
        channel=channel_to(p.channel),
        rendezvous=rendezvous_to(p.rendezvous),
        reason=p.reason,
        manifest_checksum=p.manifest_checksum,
        transfer=transfer_part_to(p.transfer, held, room) if p.transfer is not None else None,
    )


def _digest(value: str, field: str) -> str:
    """An optional digest field: empty, or ``sha256:<64 hex>``."""
    if value and not is_digest(value):
        raise faults.InvalidArgument(f"{field} {value[:80]!r} is not sha256:<64 lowercase hex digits>")
    return value


def event(m: pb.WatchEvent, held: HeldRegions | None = None) -> models.Assignment:
    return models.Assignment(
        kind=models.EventKind(_parse(_EV_IN, m.kind, "kind")),
        job=m.job,
        version=m.version,
        step=m.step,
        plan=plan(m.plan, held=held) if m.HasField("plan") else None,
        table=table(m.table) if m.HasField("table") else None,
        reason=m.reason,
        await_commit=m.await_commit,
    )


def event_to(a: models.Assignment, held: HeldRegions | None = None, room: Room | None = None) -> pb.WatchEvent:
    """``held``: what this watch stream sent in full so far; ``room``: the event's for regions (as
    ``transfer_part_to``)."""
    return pb.WatchEvent(
        kind=_EV_OUT[a.kind.value],
        job=a.job,
        version=a.version,
        step=a.step,
        plan=plan_to(a.plan, held, room) if a.plan else None,
        table=table_to(a.table),
        reason=a.reason,
        await_commit=a.await_commit,
    )


def ack(m: pb.AckRequest) -> models.AckReport:
    phases: dict[SyncPhase, float] = {}
    for i, p in enumerate(m.phases):
        phase = SyncPhase(_parse(_PH_IN, p.phase, f"phases[{i}].phase"))
        if not 0 <= p.seconds < 86400 * 7:
            raise faults.InvalidArgument(f"phases[{i}].seconds is {p.seconds}; send the phase's duration in seconds")
        phases[phase] = p.seconds
    if m.version < 1:
        raise faults.InvalidArgument("version is 0; ack the version number from the assignment")
    if not m.ok and not m.error:
        raise faults.InvalidArgument("error is empty on a failed ack; say what went wrong")
    if m.ok and m.torn:
        raise faults.InvalidArgument("torn is set on a successful ack; a torn replica did not load the version")
    return models.AckReport(
        m.version,
        m.layout_digest,
        m.ok,
        phases,
        m.error,
        m.channel_failed,
        _digest(m.content_digest, "content_digest"),
        m.torn,
        m.regions_read,
    )


MAX_ERROR_CHARS = 2048
"""Error text a client sends (a failed ack, a lost receiver); longer text is cut here, on the client's side."""


def _error_text(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 15] + " ...[truncated]"


def ack_to(lease_id: str, r: models.AckReport) -> pb.AckRequest:
    return pb.AckRequest(
        lease_id=lease_id,
        version=r.version,
        layout_digest=r.layout_digest,
        ok=r.ok,
        error=_error_text(r.error),
        channel_failed=r.channel_failed,
        content_digest=r.content_digest,
        torn=r.torn,
        regions_read=r.regions_read,
        phases=[pb.PhaseSeconds(phase=_PH_OUT[k.value], seconds=v) for k, v in r.phases.items()],
    )


def _receivers(failed: Iterable[pb.FailedReceiver], field: str) -> dict[str, str]:
    out = {}
    for i, f in enumerate(failed):
        if not f.replica_id or not f.error:
            raise faults.InvalidArgument(f"{field}[{i}] needs a replica_id and an error")
        out[f.replica_id] = f.error
    return out


def _receivers_to(failed: Mapping[str, str]) -> list[pb.FailedReceiver]:
    return [pb.FailedReceiver(replica_id=r, error=_error_text(e)) for r, e in sorted(failed.items())]


def report_sent(m: pb.ReportSentRequest) -> models.SentReport:
    """The publisher's content digest, the receivers its channels lost (replica id -> error), and why the volume
    copy failed, if it did."""
    failed = _receivers(m.failed, "failed")
    regions = {}
    for i, r in enumerate(m.region_digests):
        if not r.replica_id or not r.content_digest:
            raise faults.InvalidArgument(f"region_digests[{i}] needs a replica_id and a content_digest")
        regions[r.replica_id] = _digest(r.content_digest, f"region_digests[{i}].content_digest")
    return models.SentReport(_digest(m.content_digest, "content_digest"), failed, m.volume_error, regions)


def report_lost(m: pb.ReportLostRequest) -> dict[str, str]:
    """The receivers the publisher lost mid-version (replica id -> why); at least one."""
    if not m.lost:
        raise faults.InvalidArgument("lost is empty; report the receivers the sender lost")
    return _receivers(m.lost, "lost")


def report_lost_to(lease_id: str, version: int, lost: Mapping[str, str]) -> pb.ReportLostRequest:
    return pb.ReportLostRequest(lease_id=lease_id, version=version, lost=_receivers_to(lost))


def report_sent_to(lease_id: str, version: int, sent: models.SentReport, wait_s: float = 0.0) -> pb.ReportSentRequest:
    return pb.ReportSentRequest(
        lease_id=lease_id,
        version=version,
        content_digest=sent.content_digest,
        failed=_receivers_to(sent.failed),
        volume_error=_error_text(sent.volume_error),
        wait_s=wait_s,
        region_digests=[
            pb.RegionDigest(replica_id=r, content_digest=d) for r, d in sorted(sent.region_digests.items())
        ],
    )


def version_info(m: pb.VersionInfo) -> models.VersionInfo:
    return models.VersionInfo(
        job=m.job,
        version=m.version,
        step=m.step,
        incarnation=m.incarnation,
        state=state(m.state),
        durable=m.durable,
        manifest_path=m.manifest_path,
        manifest_checksum=m.manifest_checksum,
        table=table(m.table) if m.HasField("table") else None,
        reason=m.reason,
        opened_at=m.opened_at,
        settled_at=m.settled_at,
        replicas=tuple(
            models.ReplicaStatus(
                r.replica_id,
                channel(r.channel, "channel") if r.channel else None,
                ReplicaState(_parse(_RS_IN, r.state, "replicas.state")),
                r.error,
                r.content_digest,
            )
            for r in m.replicas
        ),
        content_digest=m.content_digest,
        durable_needed=m.durable_needed,
    )


def version_info_to(v: models.VersionInfo) -> pb.VersionInfo:
    return pb.VersionInfo(
        job=v.job,
        version=v.version,
        step=v.step,
        incarnation=v.incarnation,
        state=state_to(v.state),
        durable=v.durable,
        manifest_path=v.manifest_path,
        manifest_checksum=v.manifest_checksum,
        table=table_to(v.table),
        reason=v.reason,
        opened_at=v.opened_at,
        settled_at=v.settled_at,
        replicas=[
            pb.ReplicaStatus(
                replica_id=r.replica_id,
                channel=channel_to(r.channel) if r.channel else None,
                state=_RS_OUT[r.state.value],
                error=r.error,
                content_digest=r.content_digest,
            )
            for r in v.replicas
        ],
        content_digest=v.content_digest,
        durable_needed=v.durable_needed,
    )


def job_info(m: pb.JobInfo) -> models.JobInfo:
    return models.JobInfo(
        job=m.job,
        policy=policy(m.policy, models.JobPolicy()),
        newest_ready=m.newest_ready,
        newest_durable_ready=m.newest_durable_ready,
        members=tuple(
            models.MemberInfo(
                x.member_id,
                role(x.role),
                x.incarnation,
                x.current_version,
                x.lease_expires_in_s,
                capabilities(x.capabilities),
            )
            for x in m.members
        ),
    )


def job_info_to(j: models.JobInfo) -> pb.JobInfo:
    return pb.JobInfo(
        job=j.job,
        policy=policy_to(j.policy),
        newest_ready=j.newest_ready,
        newest_durable_ready=j.newest_durable_ready,
        members=[
            pb.MemberInfo(
                member_id=x.member_id,
                role=_RO_OUT[x.role.value],
                incarnation=x.incarnation,
                current_version=x.current_version,
                lease_expires_in_s=x.lease_expires_in_s,
                capabilities=capabilities_to(x.capabilities),
            )
            for x in j.members
        ],
    )


# ---- sharded transfer: both sides' layouts and each side's part of the plan ------------------------------------


def _built(field: str, make: Callable[[], _T]) -> _T:
    """Construct a domain object, turning its own validation error into one naming the wire field."""
    try:
        return make()
    except PermanentError as e:
        raise faults.InvalidArgument(f"{field}: {e}") from None


def box(m: pb.Box, field: str) -> Box:
    return _built(field, lambda: Box(tuple(m.offsets), tuple(m.lengths)))


def box_to(b: Box) -> pb.Box:
    return pb.Box(offsets=list(b.offsets), lengths=list(b.lengths))


def _metas(metas: Iterable[pb.TensorMeta]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(t.name, t.dtype, tuple(t.shape)) for t in metas]


def _mesh(m: pb.DeviceMesh, field: str) -> shards.Mesh:
    return _built(field, lambda: shards.Mesh(tuple(m.shape), tuple(m.ranks)))


def trainer_layout(m: pb.TrainerLayout, field: str = "trainer_layout") -> shards.TrainerLayout:
    metas = _metas(m.tensors)
    bounds = [*m.group_starts, len(metas)] if metas else []
    table = _built(f"{field}.tensors", lambda: TensorTable.build(metas[a:b] for a, b in itertools.pairwise(bounds)))
    if metas and (len(table) != len(metas) or list(table.group_starts) != list(m.group_starts)):
        raise faults.InvalidArgument(
            f"{field}.group_starts {list(m.group_starts)} do not partition {len(metas)} tensors; "
            "give the start of each send group, from 0, increasing"
        )
    meshes = tuple(_mesh(x, f"{field}.meshes[{i}]") for i, x in enumerate(m.meshes))
    placements = tuple(shards.Placement(p.mesh, tuple(p.shard_dims)) for p in m.placements)
    return _built(field, lambda: shards.TrainerLayout(table, m.world_size, meshes, placements, m.unsupported))


def trainer_layout_to(layout: shards.TrainerLayout) -> pb.TrainerLayout:
    return pb.TrainerLayout(
        world_size=layout.world_size,
        tensors=[pb.TensorMeta(name=s.name, dtype=s.dtype, shape=list(s.shape)) for s in layout.table],
        group_starts=list(layout.table.group_starts) if len(layout.table) else [],
        meshes=[pb.DeviceMesh(shape=list(x.shape), ranks=list(x.ranks)) for x in layout.meshes],
        placements=[pb.TensorPlacement(mesh=p.mesh, shard_dims=list(p.shard_dims)) for p in layout.placements],
        unsupported=layout.unsupported,
    )


def _worker(m: pb.WorkerLayout, field: str) -> fills.WorkerLayout:
    params = tuple(fills.ParamSpec(n, d, s) for n, d, s in _metas(m.params))
    entries = tuple(
        fills.Fill(
            f.tensor, box(f.source, f"{field}.fills[{i}].source"), f.param, box(f.dest, f"{field}.fills[{i}].dest")
        )
        for i, f in enumerate(m.fills)
    )
    return _built(field, lambda: fills.WorkerLayout(m.rank, params, entries, m.why_whole))


def engine_layout(m: pb.EngineLayout, field: str = "engine_layout") -> fills.EngineLayout:
    workers = tuple(_worker(w, f"{field}.workers[{i}]") for i, w in enumerate(m.workers))
    if m.table_digest and not is_digest(m.table_digest):
        raise faults.InvalidArgument(f"{field}.table_digest {m.table_digest[:80]!r} is not sha256:<64 hex digits>")
    return _built(field, lambda: fills.EngineLayout(m.table_digest, workers, m.unsupported))


def engine_layout_to(layout: fills.EngineLayout) -> pb.EngineLayout:
    return pb.EngineLayout(
        table_digest=layout.table_digest,
        workers=[
            pb.WorkerLayout(
                rank=w.rank,
                params=[pb.TensorMeta(name=p.name, dtype=p.dtype, shape=list(p.shape)) for p in w.params],
                fills=[
                    pb.Fill(tensor=f.tensor, source=box_to(f.source), param=f.param, dest=box_to(f.dest))
                    for f in w.fills
                ],
                why_whole=w.why_whole,
            )
            for w in layout.workers
        ],
        unsupported=layout.unsupported,
    )


def _region(m: pb.TransferRegion, field: str) -> plans.Region:
    return plans.Region(
        m.tensor, m.rank, m.worker, box(m.source, f"{field}.source"), m.param, box(m.dest, f"{field}.dest"), m.nbytes
    )


class NotHeld(PermanentError):
    """A part came without its regions (``ReplicaRegions.held``), and this end neither holds nor can read them."""


Fetch = Callable[[str, str], tuple[plans.Region, ...]]
"""Reads replica ``replica_id``'s regions of plan ``key`` from the coordinator (``(key, replica_id)``)."""


class Room:
    """Bytes of regions one message may still carry: a part past them is left out (``ReplicaRegions.held``) and its
    end reads it with ``GetPlanRegions`` (Qwen3-235B's part is 12.7 MB a replica, rank 0's response every replica's).
    The servicer gives each message half its message limit; the rest of a message is small."""

    def __init__(self, nbytes: int) -> None:
        self.left = nbytes

    def take(self, message: pb.ReplicaRegions, regions: Sequence[plans.Region]) -> bool:
        """Whether ``regions`` still fit (then taken, added to ``message``)."""
        if len(regions) * _REGION_BYTES_MIN > self.left:  # too many whatever their boxes: encoded for nothing
            return False
        out = [_region_to(g) for g in regions]
        nbytes = sum(g.ByteSize() for g in out)
        if nbytes > self.left:
            return False
        self.left -= nbytes
        message.regions.extend(out)
        return True


_REGION_BYTES_MIN = 16
"""A region's encoded bytes at least (its box alone takes more)."""


def _region_to(g: plans.Region) -> pb.TransferRegion:
    return pb.TransferRegion(
        tensor=g.tensor,
        rank=g.rank,
        worker=g.worker,
        source=box_to(g.source),
        param=g.param,
        dest=box_to(g.dest),
        nbytes=g.nbytes,
    )


def region_chunks(regions: Sequence[plans.Region], nbytes: int) -> Iterator[pb.PlanRegionsChunk]:
    """``GetPlanRegions``' answer: ``regions`` in plan order, in messages of about ``nbytes`` (at least one region
    each; an empty part is one empty chunk)."""
    chunk = pb.PlanRegionsChunk(total=len(regions))
    size = 0
    for g in regions:
        m = _region_to(g)
        if chunk.regions and size + m.ByteSize() > nbytes:
            yield chunk
            chunk, size = pb.PlanRegionsChunk(total=len(regions)), 0
        chunk.regions.append(m)
        size += m.ByteSize()
    yield chunk


def chunked_regions(chunks: Iterable[pb.PlanRegionsChunk], field: str) -> tuple[plans.Region, ...]:
    """The regions of ``GetPlanRegions``' chunks, checked to be the part's every one."""
    out: list[plans.Region] = []
    total = None
    for i, c in enumerate(chunks):
        if total is not None and c.total != total:
            raise faults.InvalidArgument(f"{field}: chunk {i} says the part has {c.total} regions, the first {total}")
        total = c.total
        out.extend(_region(g, f"{field}[{len(out) + j}]") for j, g in enumerate(c.regions))
    if total is None or len(out) != total:
        raise faults.InvalidArgument(f"{field}: {len(out)} regions arrived of the part's {total}")
    return tuple(out)


def plan_regions_request(lease_id: str, plan_key: str, replica_id: str) -> pb.PlanRegionsRequest:
    return pb.PlanRegionsRequest(lease_id=lease_id, plan_key=plan_key, replica_id=replica_id)


class HeldRegions:
    """The regions of the plan parts one end decoded, by plan key and replica: a part that comes again under its key
    comes without them (``ReplicaRegions.held``), so a version whose plan did not change moves and decodes none of
    its regions (hundreds a link: most of a version's control messages, and their host time on both ends). Only the
    parts of the newest ``keys`` keys are kept."""

    def __init__(self, keys: int = 2, fetch: Fetch | None = None) -> None:
        """``fetch``: how this end reads a part it does not hold (the client's ``GetPlanRegions``); without it such
        a part raises ``NotHeld``."""
        self.keys, self.fetch = keys, fetch
        self._parts: dict[str, dict[str, tuple[plans.Region, ...]]] = {}

    def holds(self, key: str, replica_id: str) -> bool:
        return replica_id in self._parts.get(key, {})

    @property
    def newest(self) -> str:
        """The key decoded last ("" when none): what a trainer names in ``OpenVersionRequest.held_plan_key``."""
        return next(reversed(self._parts), "")

    def keep(self, key: str, replica_id: str, regions: tuple[plans.Region, ...]) -> None:
        self._parts[key] = {**self._parts.pop(key, {}), replica_id: regions}  # newest last
        while len(self._parts) > self.keys:
            del self._parts[next(iter(self._parts))]

    def regions(self, key: str, replica_id: str, field: str) -> tuple[plans.Region, ...]:
        got = self._parts.get(key, {}).get(replica_id)
        if got is None and self.fetch is not None:
            got = self.fetch(key, replica_id)
            self.keep(key, replica_id, got)
        if got is None:
            raise NotHeld(
                f"{field}: the coordinator left out replica {replica_id!r}'s regions of plan {key[:19]}..., which this "
                f"end does not hold (it holds {len(self._parts)} plans' parts) and cannot read"
            )
        return got


def transfer_part(m: pb.TransferPart, field: str = "transfer", held: HeldRegions | None = None) -> plans.TransferPlan:
    """One replica's part of a plan (``TransferPlan.part_for_replica``), or every replica's, as it left the
    coordinator; a part's regions left out (``held``) are the ones ``held`` kept for its key, and those decoded are
    kept there."""
    replicas = []
    for i, r in enumerate(m.replicas):
        at = f"{field}.replicas[{i}]"
        if r.held and held is not None:
            regions = held.regions(m.plan_key, r.replica_id, at)
        elif r.held:
            raise NotHeld(f"{at}: the regions are left out (held), but this end keeps no regions of plans")
        else:
            regions = tuple(_region(g, f"{at}.regions[{j}]") for j, g in enumerate(r.regions))
            if held is not None:
                held.keep(m.plan_key, r.replica_id, regions)
        copied = frozenset((link.rank, link.worker) for link in r.copied)
        replicas.append(plans.ReplicaPlan(r.replica_id, regions, r.gathered, copied))
    return plans.TransferPlan(m.plan_key, tuple(replicas))


def transfer_part_to(
    p: plans.TransferPlan, held: HeldRegions | None = None, room: Room | None = None
) -> pb.TransferPart:
    """``held``: what the receiving end holds, as it keeps it (its events arrive in order, so a watch stream's copy
    forgets what the client's does); those regions are left out, and every part sent in full is kept there.
    ``room``: the message's room for regions; a part past it is left out too (its end reads it)."""
    out = pb.TransferPart(plan_key=p.key)
    for r in p.replicas:
        copied = [pb.RegionLink(rank=rank, worker=worker) for rank, worker in sorted(r.copied)]
        part = pb.ReplicaRegions(replica_id=r.replica_id, gathered=r.gathered, copied=copied)
        held_there = held is not None and held.holds(p.key, r.replica_id)
        if held_there or (room is not None and not room.take(part, r.regions)):
            part.held = True
        else:
            if room is None:
                part.regions.extend(_region_to(g) for g in r.regions)
            if held is not None:
                held.keep(p.key, r.replica_id, r.regions)
        out.replicas.append(part)
    return out


# ---- requests and responses: the only place the client and the servicer get wire messages from ------------------


def register_request(
    job: str,
    role_: models.Role,
    member_id: str,
    incarnation: str,
    caps: models.Capabilities,
    policy_: models.JobPolicy | None,
    offers: Iterable[Offer],
    current_version: int,
    layout_: models.Layout | None = None,
) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        job=job,
        role=_RO_OUT[role_.value],
        member_id=member_id,
        incarnation=incarnation,
        capabilities=capabilities_to(caps),
        policy=policy_to(policy_) if policy_ else None,
        offers=[offer_to(o) for o in offers],
        current_version=current_version,
        trainer_layout=trainer_layout_to(layout_) if isinstance(layout_, shards.TrainerLayout) else None,
        engine_layout=engine_layout_to(layout_) if isinstance(layout_, fills.EngineLayout) else None,
    )


def registered_layout(m: pb.RegisterRequest, role_: models.Role) -> models.Layout | None:
    """The layout a member registered for the sharded path (a trainer's or a replica's; the other is refused)."""
    mine, other = (
        ("trainer_layout", "engine_layout") if role_ is models.Role.TRAINER else ("engine_layout", "trainer_layout")
    )
    if m.HasField(other):
        raise faults.InvalidArgument(f"{other} is not a {role_.value}'s layout; a {role_.value} registers {mine}")
    if not m.HasField(mine):
        return None
    return trainer_layout(m.trainer_layout) if role_ is models.Role.TRAINER else engine_layout(m.engine_layout)


def lease(m: pb.Lease) -> models.Lease:
    return models.Lease(m.lease_id, m.ttl_s)


def register_response(x: models.Lease) -> pb.RegisterResponse:
    return pb.RegisterResponse(lease=pb.Lease(lease_id=x.lease_id, ttl_s=x.ttl_s))


def renew_request(lease_id: str) -> pb.RenewRequest:
    return pb.RenewRequest(lease_id=lease_id)


def renew_response(x: models.Lease) -> pb.RenewResponse:
    return pb.RenewResponse(lease=pb.Lease(lease_id=x.lease_id, ttl_s=x.ttl_s))


def open_request(
    lease_id: str,
    job: str,
    incarnation: str,
    step: int,
    summary: models.TableSummary,
    offers: Iterable[Offer],
    held_plan_key: str = "",
) -> pb.OpenVersionRequest:
    return pb.OpenVersionRequest(
        lease_id=lease_id,
        job=job,
        incarnation=incarnation,
        step=step,
        table=table_to(summary),
        offers=[offer_to(o) for o in offers],
        held_plan_key=held_plan_key,
    )


def opened(m: pb.OpenVersionResponse, held: HeldRegions | None = None) -> models.OpenedVersion:
    return models.OpenedVersion(m.version, tuple(plan(p, f"plans[{i}]", held) for i, p in enumerate(m.plans)), m.reused)


def opened_to(o: models.OpenedVersion, held_plan_key: str = "", room: Room | None = None) -> pb.OpenVersionResponse:
    """``held_plan_key``: the request's; every replica's regions of that plan are left out, and those past
    ``room``."""
    held = None
    if held_plan_key:
        held = HeldRegions()
        for p in o.plans:
            held.keep(held_plan_key, p.replica_id, ())
    plans_ = [plan_to(p, held, room) for p in o.plans]
    return pb.OpenVersionResponse(version=o.version, plans=plans_, reused=o.reused)


def watch_request(lease_id: str, keeps_regions: bool = True) -> pb.WatchRequest:
    return pb.WatchRequest(lease_id=lease_id, keeps_regions=keeps_regions)


def progress_request(lease_id: str, version: int, value: models.Progress) -> pb.ReportProgressRequest:
    return pb.ReportProgressRequest(lease_id=lease_id, version=version, progress=progress_to(value))


def progress_response() -> pb.ReportProgressResponse:
    return pb.ReportProgressResponse()


def report_lost_response() -> pb.ReportLostResponse:
    return pb.ReportLostResponse()


def ack_response(value: VersionState) -> pb.AckResponse:
    return pb.AckResponse(state=state_to(value))


def wait_request(job: str, version: int, until: models.WaitFor, timeout_s: float) -> pb.WaitVersionRequest:
    return pb.WaitVersionRequest(job=job, version=version, until=wait_for_to(until), timeout_s=timeout_s)


def wait_response(info: models.VersionInfo, met: bool) -> pb.WaitVersionResponse:
    return pb.WaitVersionResponse(info=version_info_to(info), condition_met=met)


def report_sent_response(info: models.VersionInfo) -> pb.ReportSentResponse:
    return pb.ReportSentResponse(info=version_info_to(info))


def mark_durable_request(
    job: str, version: int, manifest_path: str, checksum: str, content_digest: str = ""
) -> pb.MarkDurableRequest:
    return pb.MarkDurableRequest(
        job=job, version=version, manifest_path=manifest_path, manifest_checksum=checksum, content_digest=content_digest
    )


def mark_durable_response(info: models.VersionInfo) -> pb.MarkDurableResponse:
    return pb.MarkDurableResponse(info=version_info_to(info))


def get_job_request(job: str) -> pb.GetJobRequest:
    return pb.GetJobRequest(job=job)


def get_job_response(info: models.JobInfo) -> pb.GetJobResponse:
    return pb.GetJobResponse(job=job_info_to(info))


def list_request(job: str, limit: int) -> pb.ListVersionsRequest:
    return pb.ListVersionsRequest(job=job, limit=limit)


def list_response(infos: Iterable[models.VersionInfo], max_bytes: int) -> pb.ListVersionsResponse:
    """Versions in the order given (newest first) while the answer stays within ``max_bytes``."""
    response = pb.ListVersionsResponse()
    for info in infos:
        item = version_info_to(info)
        if response.ByteSize() + item.ByteSize() + 8 > max_bytes:
            response.truncated = True
            break
        response.versions.append(item)
    return response
