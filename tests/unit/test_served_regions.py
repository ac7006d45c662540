"""``HttpEngine``'s audit of what a served replica's workers hold (``weightsync_parameter_digests`` through vLLM's
``/collective_rpc``), against a stand-in for vLLM's server; the real server answers it in
``tests/integration/test_served_sharded.py``."""

from __future__ import annotations

from typing import Any

import pytest

from tests import vllm_stub
from weightsync.errors import PermanentError
from weightsync_inference.http_engine import HttpEngine

pytestmark = pytest.mark.unit


def test_a_served_engine_answers_each_workers_parameter_digests_in_worker_order_bounded_like_a_transfer() -> None:
    calls: list[dict[str, Any]] = []
    held = [{"model.embed_tokens.weight": "sha256:" + "a" * 64}, {"model.embed_tokens.weight": "sha256:" + "b" * 64}]

    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        calls.append(body)
        return 200, {"results": held}

    with vllm_stub.serving(answer) as url, HttpEngine(url, transfer_timeout_s=90.0) as engine:
        assert engine.parameter_digests() == held
    # every parameter is read (packed ones through their kernels): bounded like a transfer, not a 30 s query
    assert calls == [{"method": "weightsync_parameter_digests", "timeout": 90.0, "args": []}]


def test_a_served_engine_without_the_extension_is_named_when_asked_for_its_digests() -> None:
    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        return 200, {"results": ["not a dict"]}

    with (
        vllm_stub.serving(answer) as url,
        HttpEngine(url) as engine,
        pytest.raises(PermanentError, match="worker-extension"),
    ):
        engine.parameter_digests()
