"""What an agent reads from its engine at startup: a slow engine is waited out, never taken for version 0."""

from __future__ import annotations

import socket

import pytest

from tests import vllm_stub
from weightsync.errors import RetryableError, TransferTimeoutError
from weightsync_inference.agent import served_version
from weightsync_inference.http_engine import HttpEngine

pytestmark = pytest.mark.unit


def test_an_engine_that_does_not_answer_in_time_is_not_taken_for_version_0() -> None:
    # a real socket that accepts and never answers: vLLM's workers busy at startup, as the agent sees them
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen()
        engine = HttpEngine(f"http://127.0.0.1:{frozen.getsockname()[1]}", control_timeout_s=0.3)
        with pytest.raises(TransferTimeoutError, match="/weight_info did not answer"):
            served_version(engine)


def test_an_engine_not_up_yet_is_not_taken_for_version_0() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RetryableError, match="unreachable"):
        served_version(HttpEngine(f"http://127.0.0.1:{port}", control_timeout_s=0.3))


def test_a_vllm_started_without_the_worker_extension_is_named_with_the_fix() -> None:
    """vLLM's answer, word for word, when a worker lacks the method (it was started without the extension)."""
    from weightsync.errors import PermanentError

    body = {"error": {"message": "'CPUWorker' object has no attribute 'weightsync_identity'", "type": "Internal"}}
    with vllm_stub.serving(lambda _: (500, body)) as url:
        engine = HttpEngine(url)
        with pytest.raises(PermanentError, match=r"no weightsync_identity: start vLLM with --worker-extension-cls "):
            engine.identity()
