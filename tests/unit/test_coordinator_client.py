"""The coordinator client's retries: what a caller learns when the coordinator stays unreachable.

The client retries UNAVAILABLE with backoff until its deadline. Its last try may run into that deadline while gRPC
is still connecting (a TLS handshake that fails, on a loaded machine, took longer than the time left: seen in CI,
``test_clients_without_a_trusted_certificate_cannot_connect``), so gRPC answers DEADLINE_EXCEEDED for a coordinator
that was never reached. Which try lands in the handshake is a race of gRPC's reconnect timers against the deadline,
so the calls here are stand-ins that answer in a fixed order (a mock, for a fault no real server causes on demand).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from weightsync.coordinator import faults
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import Capabilities
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit

CAPS = Capabilities(host="n", channels=(Channel.CPU,))


class _Answer(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _calls(*answers: _Answer) -> tuple[list[float], object]:
    timeouts: list[float] = []
    it: Iterator[_Answer] = iter(answers)

    def call(request: object, timeout: float, metadata: object) -> object:
        timeouts.append(timeout)
        raise next(it)

    return timeouts, call


UNAVAILABLE = _Answer(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; Handshake failed")
DEADLINE = _Answer(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def test_a_deadline_reached_while_retrying_an_unreachable_coordinator_is_reported_unavailable() -> None:
    c = CoordinatorClient("127.0.0.1:9", insecure=True, timeout_s=5.0)
    try:
        tried, c._rpc["Register"] = _calls(UNAVAILABLE, DEADLINE)  # type: ignore[assignment]
        with pytest.raises(faults.Unavailable, match=r"coordinator 127.0.0.1:9 unavailable for 5s: Deadline Exceeded"):
            c.register_replica("job", "r", CAPS)
        assert len(tried) == 2

        # a coordinator that was reached and answered nothing in time is slow, not unreachable
        tried, c._rpc["Register"] = _calls(DEADLINE)  # type: ignore[assignment]
        with pytest.raises(faults.DeadlineExceeded):
            c.register_replica("job", "r", CAPS)
    finally:
        c.close()
