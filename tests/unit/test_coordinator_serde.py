"""Wire <-> domain conversion: round trips, enums mapped 1:1 onto the vocabulary, field-naming errors."""

from __future__ import annotations

import pytest

from weightsync.coordinator import faults, models, serde
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.vocabulary import Channel, SyncPhase, VersionState

pytestmark = pytest.mark.unit


def test_enums_map_one_to_one_onto_the_vocabulary() -> None:
    for c in Channel:
        assert serde.channel(serde.channel_to(c), "x") is c
    for s in VersionState:
        assert serde.state(serde.state_to(s)) is s
    assert len(pb.Channel.keys()) == len(Channel) + 1  # + UNSPECIFIED
    assert len(pb.SyncPhase.keys()) == len(SyncPhase) + 1
    assert len(pb.VersionState.keys()) == len(VersionState) + 1


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
    plan = models.ChannelPlan(
        "r", Channel.IPC, models.Rendezvous("h", 1, 2, 3, "g", {"GPU-1": b"\x00\x01"}, b"n", "/m"), "why"
    )
    assert serde.plan(serde.plan_to(plan)) == plan
    event = models.Assignment(models.EventKind.CATCH_UP, "job", 3, 7, plan, models.TableSummary(1, 2, "d"), "r")
    assert serde.event(serde.event_to(event)) == event


def test_ack_round_trip_and_validation() -> None:
    report = models.AckReport(3, "d", True, {SyncPhase.LOAD: 0.5, SyncPhase.TOTAL: 1.0}, content_digest="c")
    assert serde.ack(serde.ack_to("lease", report)) == report
    with pytest.raises(faults.InvalidArgument, match=r"phases\[0\].phase is 0 \(unset or unknown\); valid values"):
        serde.ack(pb.AckRequest(version=1, ok=True, phases=[pb.PhaseSeconds(seconds=1)]))
    with pytest.raises(faults.InvalidArgument, match="error is empty on a failed ack"):
        serde.ack(pb.AckRequest(version=1, ok=False))


def test_unset_enum_names_the_field_path() -> None:
    wire = pb.Capabilities(channels=[pb.CHANNEL_CPU, pb.CHANNEL_UNSPECIFIED])
    with pytest.raises(faults.InvalidArgument, match=r"capabilities.channels\[1\] is 0 .*valid values: ipc, nccl"):
        serde.capabilities(wire)


def test_table_summary_validation() -> None:
    with pytest.raises(faults.InvalidArgument, match=r"table: table\.tensor_count must be >= 1"):
        serde.table(pb.TableSummary(tensor_count=0, table_digest="d"))


def test_summarize_is_layout_only_and_stable() -> None:
    from weightsync.tensors import TensorTable

    table = TensorTable.build([[("a", "float32", (2, 3)), ("b", "bfloat16", (4,))]])
    s = models.summarize(table)
    assert s.tensor_count == 2 and s.total_bytes == 32 and s.table_digest.startswith("sha256:")
    assert models.summarize(table.with_digests({"a": "x", "b": "y"})) == s
    other = TensorTable.build([[("a", "float32", (3, 2)), ("b", "bfloat16", (4,))]])
    assert models.summarize(other).table_digest != s.table_digest
