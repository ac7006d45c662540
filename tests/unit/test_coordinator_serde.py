"""Wire <-> domain conversion: round trips, enums mapped 1:1 onto the vocabulary, field-naming errors."""

from __future__ import annotations

import pytest

from weightsync.channels.base import Endpoint, Offer, Rendezvous
from weightsync.coordinator import faults, models, serde
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.errors import PermanentError
from weightsync.tensors import DIGEST_PREFIX, TensorTable, content_digest, is_digest, manifest_checksum
from weightsync.vocabulary import Channel, ReplicaState, SyncPhase, VersionState

pytestmark = pytest.mark.unit

LAYOUT = DIGEST_PREFIX + "a" * 64
CONTENT = DIGEST_PREFIX + "b" * 64
CHECKSUM = manifest_checksum(b"{}")


def test_enums_map_one_to_one_onto_the_vocabulary() -> None:
    for c in Channel:
        assert serde.channel(serde.channel_to(c), "x") is c
    for s in VersionState:
        assert serde.state(serde.state_to(s)) is s
    for p in models.Progress:
        assert serde.progress(serde.progress_to(p)) is p
    for w in models.WaitFor:
        assert serde.wait_for(serde.wait_for_to(w)) is w
    assert len(pb.Channel.keys()) == len(Channel) + 1  # + UNSPECIFIED
    assert len(pb.SyncPhase.keys()) == len(SyncPhase) + 1
    assert len(pb.VersionState.keys()) == len(VersionState) + 1
    assert len(pb.ReplicaState.keys()) == len(ReplicaState) + 1
    assert len(pb.Progress.keys()) == len(models.Progress) + 1
    assert len(pb.WaitFor.keys()) == len(models.WaitFor) + 1


def test_capabilities_and_plans_round_trip() -> None:
    caps = models.Capabilities(
        host="n",
        gpu_uuids=("GPU-1",),
        devices=2,
        channels=(Channel.NCCL, Channel.VOLUME),
        nccl_domain="d",
        nixl=True,
        volume_id="v",
        volume_mount="/m",
        engine=models.EngineKind.GPU,
    )
    assert serde.capabilities(serde.capabilities_to(caps)) == caps
    rdv = Rendezvous(
        Channel.NIXL,
        endpoint=Endpoint("10.0.0.1", 29700),
        group="nixl-3",
        secret="ab" * 16,
        generation=3,
        rank=2,
        world_size=4,
        agent="trainer-0",
        metadata=b"\x00\x01md",
        epoch=5,
    )
    plan = models.ChannelPlan("r", Channel.NIXL, rdv, "why")
    assert serde.plan(serde.plan_to(plan)) == plan
    volume = models.ChannelPlan("v", Channel.VOLUME, Rendezvous(Channel.VOLUME, root="/m"), "vol", CHECKSUM)
    assert serde.plan(serde.plan_to(volume)) == volume
    ipv6 = models.ChannelPlan("r", Channel.NCCL, Rendezvous(Channel.NCCL, endpoint=Endpoint("fd00::1", 1)))
    assert serde.plan(serde.plan_to(ipv6)) == ipv6
    event = models.Assignment(
        models.EventKind.CATCH_UP, "job", 3, 7, volume, models.TableSummary(1, 2, LAYOUT), "reason"
    )
    assert serde.event(serde.event_to(event)) == event


def test_plan_validation_names_the_field() -> None:
    wire = serde.plan_to(models.ChannelPlan("r", Channel.NCCL, Rendezvous(Channel.NCCL, rank=1, world_size=2)))
    wire.rendezvous.rank = 5
    with pytest.raises(faults.InvalidArgument, match=r"plan\.rendezvous: nccl rendezvous: rank 5 is outside 1\.\.1"):
        serde.plan(wire)
    wire = serde.plan_to(models.ChannelPlan("r", Channel.NCCL, Rendezvous(Channel.NCCL)))
    wire.rendezvous.host, wire.rendezvous.port = "0.0.0.0", 29500
    with pytest.raises(faults.InvalidArgument, match=r"plan\.rendezvous: endpoint host '0\.0\.0\.0'"):
        serde.plan(wire)
    wire = serde.plan_to(models.ChannelPlan("v", Channel.VOLUME, Rendezvous(Channel.VOLUME, root="/m")))
    wire.manifest_checksum = "a" * 64
    with pytest.raises(faults.InvalidArgument, match="is not sha256:<64 lowercase hex digits>"):
        serde.plan(wire)


def test_offers_round_trip_and_validate_their_endpoint() -> None:
    offers = [
        Offer(Channel.IPC, Endpoint("10.0.0.1", 29400), devices=("GPU-0", "GPU-1")),
        Offer(Channel.NIXL, Endpoint("10.0.0.1", 29700), agent="a", metadata=b"\xffmd", epoch=2),
        Offer(Channel.VOLUME),
    ]
    for o in offers:
        assert serde.offer(serde.offer_to(o), "offers[0]") == o
    request = serde.register_request("job", models.Role.TRAINER, "t", "i", models.Capabilities(), None, offers, 0)
    assert [serde.offer(m, f"offers[{i}]") for i, m in enumerate(request.offers)] == offers
    with pytest.raises(faults.InvalidArgument, match=r"offers\[1\]: endpoint port 0 is outside 1-65535"):
        serde.offer(pb.SenderOffer(channel=pb.CHANNEL_NCCL, host="10.0.0.1"), "offers[1]")
    with pytest.raises(faults.InvalidArgument, match=r"offers\[0\]\.channel is 0"):
        serde.offer(pb.SenderOffer(), "offers[0]")


def test_ack_round_trip_and_validation() -> None:
    report = models.AckReport(3, LAYOUT, True, {SyncPhase.LOAD: 0.5, SyncPhase.TOTAL: 1.0}, content_digest=CONTENT)
    assert serde.ack(serde.ack_to("lease", report)) == report
    torn = models.AckReport(3, LAYOUT, False, error="load died halfway", channel_failed=True, torn=True)
    assert serde.ack(serde.ack_to("lease", torn)) == torn
    with pytest.raises(faults.InvalidArgument, match=r"phases\[0\].phase is 0 \(unset or unknown\); valid values"):
        serde.ack(pb.AckRequest(version=1, ok=True, phases=[pb.PhaseSeconds(seconds=1)]))
    with pytest.raises(faults.InvalidArgument, match="error is empty on a failed ack"):
        serde.ack(pb.AckRequest(version=1, ok=False))
    with pytest.raises(faults.InvalidArgument, match="torn is set on a successful ack"):
        serde.ack(pb.AckRequest(version=1, ok=True, torn=True))
    with pytest.raises(faults.InvalidArgument, match="version is 0"):
        serde.ack(pb.AckRequest(ok=True))
    for bad in ("c", "a" * 64, DIGEST_PREFIX + "A" * 64, DIGEST_PREFIX + "a" * 63):
        with pytest.raises(faults.InvalidArgument, match=r"content_digest .* is not sha256:<64 lowercase hex"):
            serde.ack(pb.AckRequest(version=1, ok=True, content_digest=bad))


def test_report_sent_round_trip_and_validation() -> None:
    sent = models.SentReport(CONTENT, {"r1": "reset", "r0": "timeout"}, "No space left on device")
    wire = serde.report_sent_to("lease", 4, sent)
    assert (wire.lease_id, wire.version) == ("lease", 4)
    assert serde.report_sent(wire) == sent
    off = models.SentReport("")  # verification off
    assert serde.report_sent(serde.report_sent_to("lease", 4, off)) == off
    with pytest.raises(faults.InvalidArgument, match=r"failed\[0\] needs a replica_id and an error"):
        serde.report_sent(pb.ReportSentRequest(version=1, failed=[pb.FailedReceiver(replica_id="r0")]))
    with pytest.raises(faults.InvalidArgument, match="content_digest 'nope' is not sha256"):
        serde.report_sent(pb.ReportSentRequest(version=1, content_digest="nope"))


def test_version_info_round_trip() -> None:
    info = models.VersionInfo(
        job="job",
        version=2,
        step=20,
        incarnation="t1",
        state=VersionState.STAGING,
        durable=True,
        manifest_path="/ckpt/v00000002/manifest.json",
        manifest_checksum=CHECKSUM,
        table=models.TableSummary(3, 300, LAYOUT),
        reason="",
        opened_at=1.5,
        settled_at=0.0,
        replicas=(
            *(
                models.ReplicaStatus(f"r{i}", Channel.CPU if i % 2 else Channel.VOLUME, s, f"e{i}", CONTENT)
                for i, s in enumerate(ReplicaState)
            ),
            models.ReplicaStatus("unplanned", None, ReplicaState.DROPPED),
        ),
        content_digest=CONTENT,
        durable_needed=True,
    )
    assert serde.version_info(serde.version_info_to(info)) == info
    assert serde.version_info(serde.report_sent_response(info).info) == info
    assert serde.version_info(serde.mark_durable_response(info).info) == info


def test_unset_enum_names_the_field_path() -> None:
    wire = pb.Capabilities(channels=[pb.CHANNEL_CPU, pb.CHANNEL_UNSPECIFIED])
    with pytest.raises(faults.InvalidArgument, match=r"capabilities.channels\[1\] is 0 .*valid values: ipc, nccl"):
        serde.capabilities(wire)


def test_table_summary_validation() -> None:
    with pytest.raises(faults.InvalidArgument, match=r"table: table\.tensor_count must be >= 1"):
        serde.table(pb.TableSummary(tensor_count=0, layout_digest=LAYOUT))
    with pytest.raises(faults.InvalidArgument, match=r"table: table\.layout_digest 'd' is not sha256:<64 hex>"):
        serde.table(pb.TableSummary(tensor_count=1, layout_digest="d"))
    with pytest.raises(PermanentError, match="is not sha256:<64 hex>"):
        models.TableSummary(1, 0, "a" * 64)
    summary = models.TableSummary(2, 64, LAYOUT)
    assert serde.table(serde.table_to(summary)) == summary  # type: ignore[arg-type]


def test_summarize_is_layout_only_and_stable() -> None:
    table = TensorTable.build([[("a", "float32", (2, 3)), ("b", "bfloat16", (4,))]])
    s = models.summarize(table)
    assert s.tensor_count == 2 and s.total_bytes == 32
    assert s.layout_digest == table.layout_digest() and is_digest(s.layout_digest)
    assert models.summarize(table.with_digests({"a": "x", "b": "y"})) == s
    other = TensorTable.build([[("a", "float32", (3, 2)), ("b", "bfloat16", (4,))]])
    assert models.summarize(other).layout_digest != s.layout_digest
    # whether digests follow travels with the table, so receivers check exactly what the trainer sends
    unverified = models.summarize(table, verified=False)
    assert serde.table(serde.table_to(unverified)) == unverified and not unverified.verified  # type: ignore[arg-type]
    assert serde.table(serde.table_to(s)).verified  # type: ignore[arg-type]


def test_the_three_digests_share_one_format() -> None:
    digest = content_digest({"b": "2", "a": "1"})
    assert is_digest(digest) and digest == content_digest({"a": "1", "b": "2"})  # name order, not insertion
    assert digest != content_digest({"a": "1", "b": "3"})
    assert is_digest(manifest_checksum(b"{}")) and manifest_checksum(b"{}") != manifest_checksum(b"{ }")


def test_a_version_list_is_cut_where_it_would_pass_the_message_limit() -> None:
    status = tuple(models.ReplicaStatus(f"r{i}", Channel.CPU, ReplicaState.FAILED, "e" * 2000, "") for i in range(100))
    infos = [models.VersionInfo("job", v, v, "i", VersionState.FAILED, replicas=status) for v in range(10, 0, -1)]
    one = serde.version_info_to(infos[0]).ByteSize()
    response = serde.list_response(infos, max_bytes=3 * one + 100)
    assert response.truncated and [v.version for v in response.versions] == [10, 9, 8]
    assert response.ByteSize() <= 3 * one + 100
    assert not serde.list_response(infos, max_bytes=100 * one).truncated


def test_client_error_text_is_cut_to_the_servers_bound() -> None:
    request = serde.ack_to("lease", models.AckReport(1, DIGEST_PREFIX + "1" * 64, ok=False, error="x" * 10_000))
    assert len(request.error) == serde.MAX_ERROR_CHARS and request.error.endswith("...[truncated]")
    sent = serde.report_sent_to("lease", 1, models.SentReport("", {"r0": "y" * 10_000}, "z" * 10_000))
    assert len(sent.failed[0].error) == len(sent.volume_error) == serde.MAX_ERROR_CHARS
