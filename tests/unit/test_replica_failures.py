"""A failed update's fail-stop rule when the engine cannot answer (``lifecycle.Replica._torn``)."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.channels.base import UpdateTicket
from weightsync.errors import RetryableError
from weightsync.vocabulary import Channel
from weightsync_inference import lifecycle

pytestmark = pytest.mark.unit


class FailingEngine:
    """An offline vLLM engine after a worker failed inside an update: every ``collective_rpc`` raises vLLM's plain
    ``Exception``, the receipt's included."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name in ("pause", "resume", "start", "is_paused"):
                return False
            raise Exception("Call to collective_rpc method failed: Worker failed with error 'cpu channel: ...'")

        return call


def test_an_update_whose_engine_cannot_give_its_receipt_leaves_the_replica_torn_not_the_agent_dead() -> None:
    engine = FailingEngine()
    replica = lifecycle.Replica(engine, version=1)  # type: ignore[arg-type]
    with pytest.raises(lifecycle.UpdateFailed) as failed:
        replica.apply(UpdateTicket(2, Channel.CPU, timeout_s=5))
    assert failed.value.state is lifecycle.EngineState.TORN and replica.state is lifecycle.EngineState.TORN
    assert "failed after bytes reached the parameters" in str(failed.value)
    assert "receipt" in engine.calls and "resume" not in engine.calls  # torn: stays paused


class RefusingEngine(FailingEngine):
    """An engine that refuses an update before touching a parameter: its receipt says so (not torn)."""

    def __getattr__(self, name: str) -> Any:
        if name == "receipt":
            from weightsync_inference.receipts import Receipt

            def receipt() -> Receipt:
                self.calls.append(name)
                return Receipt(1, Channel.VOLUME, ok=False, torn=False, error="refused")

            return receipt
        return super().__getattr__(name)


def test_a_torn_replica_whose_recovery_is_refused_untouched_stays_torn_and_paused() -> None:
    """The refused load changed nothing, but the weights are still the torn ones of the update before it: the
    replica must not resume (seen when a stale reply made a recovery's load fail untouched)."""
    replica = lifecycle.Replica(FailingEngine(), version=1)  # type: ignore[arg-type]
    with pytest.raises(lifecycle.UpdateFailed):
        replica.apply(UpdateTicket(2, Channel.CPU, timeout_s=5))
    assert replica.state is lifecycle.EngineState.TORN
    engine = replica.control = RefusingEngine()  # type: ignore[assignment]
    with pytest.raises(lifecycle.UpdateFailed) as failed:
        replica.apply(UpdateTicket(1, Channel.VOLUME, timeout_s=5))
    assert failed.value.state is lifecycle.EngineState.TORN and replica.state is lifecycle.EngineState.TORN
    assert "resume" not in engine.calls and "pause" not in engine.calls


def test_a_version_one_worker_finished_and_another_refused_is_torn() -> None:
    """Each worker records its failure rather than raising it, so a worker whose part went well finishes the
    version while another refused it untouched: the replica holds a mix, which is torn, never served."""
    from weightsync_inference.receipts import Receipt, merge

    done = Receipt(2, Channel.CPU, digests={"a": "sha256:1"})
    refused = Receipt(2, Channel.CPU, ok=False, torn=False, error="ModelMismatchError: ...")
    assert merge([done, refused]).torn and not merge([done, refused]).ok
    assert merge([refused, done]).torn
    both = merge([refused, Receipt(2, Channel.CPU, ok=False, torn=False, error="refused too")])
    assert not both.ok and not both.torn  # refused everywhere: the previous version is whole


def test_a_receiver_the_engine_cannot_start_fails_as_the_channels_failure_not_the_agents() -> None:
    """vLLM's executor raises its plain ``Exception`` when a worker could not start its receiver (seen for real: a
    NIXL worker that could not load the trainer's agent metadata, UCX finding no route); it used to end the agent's
    thread. It fails as a ``RetryableError`` naming the channel, which the agent acks as its channel's failure
    (``Agent._assign``), with nothing loaded."""
    engine = FailingEngine()
    replica = lifecycle.Replica(engine, version=1)  # type: ignore[arg-type]
    with pytest.raises(RetryableError, match="the engine could not start its nixl receiver: Call to collective_rpc"):
        replica.init_transfer({"channel": "nixl"}, timeout_s=5)
    assert engine.calls == ["init_transfer"] and replica.state is lifecycle.EngineState.SERVING
