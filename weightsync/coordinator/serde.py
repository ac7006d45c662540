"""The edge between wire messages and domain objects: every conversion, in both directions.

Only this module (and the service table) touches the generated ``_proto`` code.
Parsing validates as it goes and raises ``faults.InvalidArgument`` naming the
field path (``capabilities.channels[1]``), the value received, and the fix, so the
servicer can return it as-is with the INVALID_ARGUMENT status.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from weightsync.coordinator import faults, models
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.errors import PermanentError
from weightsync.vocabulary import Channel, SyncPhase, VersionState


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
        engine=_EN_OUT[c.engine.value],
    )


def offer(m: pb.SenderOffer, field: str) -> models.SenderOffer:
    if m.port > 65535:
        raise faults.InvalidArgument(f"{field}.port is {m.port}; a TCP port is 1-65535 (0: none)")
    return models.SenderOffer(
        channel(m.channel, f"{field}.channel"), m.host, m.port, dict(m.ipc_handles), m.nixl_metadata
    )


def offer_to(o: models.SenderOffer) -> pb.SenderOffer:
    return pb.SenderOffer(
        channel=channel_to(o.channel),
        host=o.host,
        port=o.port,
        ipc_handles=dict(o.ipc_handles),
        nixl_metadata=o.nixl_metadata,
    )


def policy(m: pb.JobPolicy, default: models.JobPolicy, field: str = "policy") -> models.JobPolicy:
    pref = tuple(channel(c, f"{field}.channel_preference[{i}]") for i, c in enumerate(m.channel_preference))
    try:
        return models.JobPolicy(
            channel_preference=pref or default.channel_preference,
            ack_quorum=m.ack_quorum or default.ack_quorum,
            version_timeout_s=m.version_timeout_s or default.version_timeout_s,
        )
    except PermanentError as e:
        raise faults.InvalidArgument(str(e)) from None


def policy_to(p: models.JobPolicy) -> pb.JobPolicy:
    return pb.JobPolicy(
        channel_preference=[channel_to(c) for c in p.channel_preference],
        ack_quorum=p.ack_quorum,
        version_timeout_s=p.version_timeout_s,
    )


# ---- versions ----------------------------------------------------------------------------------------------------


def table(m: pb.TableSummary, field: str = "table") -> models.TableSummary:
    try:
        return models.TableSummary(m.tensor_count, m.total_bytes, m.table_digest)
    except PermanentError as e:
        raise faults.InvalidArgument(f"{field}: {e}") from None


def table_to(t: models.TableSummary | None) -> pb.TableSummary | None:
    return (
        None
        if t is None
        else pb.TableSummary(tensor_count=t.tensor_count, total_bytes=t.total_bytes, table_digest=t.table_digest)
    )


def rendezvous(m: pb.Rendezvous) -> models.Rendezvous:
    return models.Rendezvous(
        m.host, m.port, m.rank_offset, m.world_size, m.group_id, dict(m.ipc_handles), m.nixl_metadata, m.volume_path
    )


def rendezvous_to(r: models.Rendezvous) -> pb.Rendezvous:
    return pb.Rendezvous(
        host=r.host,
        port=r.port,
        rank_offset=r.rank_offset,
        world_size=r.world_size,
        group_id=r.group_id,
        ipc_handles=dict(r.ipc_handles),
        nixl_metadata=r.nixl_metadata,
        volume_path=r.volume_path,
    )


def plan(m: pb.ChannelPlan, field: str = "plan") -> models.ChannelPlan:
    return models.ChannelPlan(m.replica_id, channel(m.channel, f"{field}.channel"), rendezvous(m.rendezvous), m.reason)


def plan_to(p: models.ChannelPlan) -> pb.ChannelPlan:
    return pb.ChannelPlan(
        replica_id=p.replica_id, channel=channel_to(p.channel), rendezvous=rendezvous_to(p.rendezvous), reason=p.reason
    )


def event(m: pb.WatchEvent) -> models.Assignment:
    return models.Assignment(
        kind=models.EventKind(_parse(_EV_IN, m.kind, "kind")),
        job=m.job,
        version=m.version,
        step=m.step,
        plan=plan(m.plan) if m.HasField("plan") else None,
        table=table(m.table) if m.HasField("table") else None,
        reason=m.reason,
    )


def event_to(a: models.Assignment) -> pb.WatchEvent:
    return pb.WatchEvent(
        kind=_EV_OUT[a.kind.value],
        job=a.job,
        version=a.version,
        step=a.step,
        plan=plan_to(a.plan) if a.plan else None,
        table=table_to(a.table),
        reason=a.reason,
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
    return models.AckReport(m.version, m.table_digest, m.ok, phases, m.error, m.channel_failed, m.content_digest)


def ack_to(lease_id: str, r: models.AckReport) -> pb.AckRequest:
    return pb.AckRequest(
        lease_id=lease_id,
        version=r.version,
        table_digest=r.table_digest,
        ok=r.ok,
        error=r.error,
        channel_failed=r.channel_failed,
        content_digest=r.content_digest,
        phases=[pb.PhaseSeconds(phase=_PH_OUT[k.value], seconds=v) for k, v in r.phases.items()],
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
        manifest_sha256=m.manifest_sha256,
        table=table(m.table) if m.HasField("table") else None,
        reason=m.reason,
        opened_at=m.opened_at,
        settled_at=m.settled_at,
        replicas=tuple(
            models.ReplicaStatus(
                r.replica_id, channel(r.channel, "channel") if r.channel else None, r.status, r.error, r.content_digest
            )
            for r in m.replicas
        ),
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
        manifest_sha256=v.manifest_sha256,
        table=table_to(v.table),
        reason=v.reason,
        opened_at=v.opened_at,
        settled_at=v.settled_at,
        replicas=[
            pb.ReplicaStatus(
                replica_id=r.replica_id,
                channel=channel_to(r.channel) if r.channel else None,
                status=r.status,
                error=r.error,
                content_digest=r.content_digest,
            )
            for r in v.replicas
        ],
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
