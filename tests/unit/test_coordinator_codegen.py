"""The committed generated code is what the .proto produces today (the drift check CI runs)."""

from __future__ import annotations

import pytest

from weightsync.coordinator import _service, codegen
from weightsync.coordinator._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.unit


def test_generated_code_is_current() -> None:
    stale = codegen.stale()
    assert not stale, f"{stale} are stale: run `python -m weightsync.coordinator.codegen` and commit the result"


def test_generated_code_does_not_pin_the_protobuf_runtime() -> None:
    text = (codegen.OUT / "coordinator_pb2.py").read_text()
    assert "ValidateProtobufRuntimeVersion" not in text and "runtime_version" not in text


def test_service_table_covers_the_proto() -> None:
    methods = _service.methods()
    assert set(methods) == {
        "Register",
        "Renew",
        "OpenVersion",
        "WatchVersions",
        "ReportProgress",
        "Ack",
        "WaitVersion",
        "ReportSent",
        "ReportLost",
        "MarkDurable",
        "GetJob",
        "ListVersions",
        "GetPlanRegions",
    }
    assert methods["WatchVersions"].server_streaming and not methods["Ack"].server_streaming
    assert methods["GetPlanRegions"].server_streaming
    assert methods["Ack"].path == "/weightsync.v1.Coordinator/Ack"
    assert not methods["ReportSent"].server_streaming
    assert methods["ReportSent"].path == "/weightsync.v1.Coordinator/ReportSent"
    assert methods["ReportSent"].request is pb.ReportSentRequest
    assert methods["ReportSent"].response is pb.ReportSentResponse
