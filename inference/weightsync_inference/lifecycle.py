"""One update of one replica, through vLLM's weight-transfer lifecycle, failing stop.

    pause -> start -> update (concurrently with the sender) -> finish(version) -> resume

The rules this module keeps (see DESIGN.md, failure rules):
- A failure before any byte reached a parameter (a corrupt shard refused, a peer
  that never connected) resumes the replica on the version it had.
- A failure after bytes landed leaves the replica PAUSED and ``TORN``: it must not
  serve a mix. Only a whole version (``recover``) makes it serve again.
- Every step has a timeout; a step that times out counts as a failure of that step.

The engine tells the two failures apart: it marks refusals that touched nothing with
``UNTOUCHED`` in the error text, which survives vLLM's process and HTTP boundaries.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from weightsync.channels.base import UpdateTicket
from weightsync.errors import RetryableError, WeightsyncError
from weightsync.vocabulary import SyncPhase

UNTOUCHED = "[weightsync: parameters untouched]"


class EngineControl(Protocol):
    """What the lifecycle needs from an engine: vLLM's offline ``LLM`` or its HTTP server."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def init_transfer(self, init_info: dict[str, Any]) -> None: ...

    def start(self) -> None: ...

    def update(self, update_info: dict[str, Any]) -> None: ...

    def finish(self, version: str) -> None: ...


class ReplicaState(enum.StrEnum):
    SERVING = "serving"
    PAUSED = "paused"
    TORN = "torn"


class UpdateFailed(WeightsyncError):
    def __init__(self, message: str, state: ReplicaState) -> None:
        super().__init__(message)
        self.state = state


@dataclass
class UpdateOutcome:
    version: int
    seconds: dict[str, float] = field(default_factory=dict)


def _concurrently(main: Callable[[], None], side: Callable[[], None] | None, timeout_s: float, what: str) -> None:
    """Run ``main`` on a thread and ``side`` (the sender, in-process) here; raise the first error."""
    if side is None:
        main()
        return
    errors: list[BaseException] = []

    def target() -> None:
        try:
            main()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=target, name=f"weightsync-{what}", daemon=True)
    thread.start()
    try:
        side()
    finally:
        thread.join(timeout_s)
    if thread.is_alive():
        raise RetryableError(f"{what} did not finish within {timeout_s:.0f}s")
    if errors:
        raise errors[0]


class Replica:
    """Drives one engine through updates and remembers whether it may serve."""

    def __init__(self, control: EngineControl) -> None:
        self.control = control
        self.state = ReplicaState.SERVING
        self.version = 0

    def init_transfer(
        self, init_info: dict[str, Any], rendezvous: Callable[[], None] | None = None, timeout_s: float = 120
    ) -> None:
        """Initialise the engine's receiver; ``rendezvous`` runs the sender's side concurrently."""
        _concurrently(
            lambda: self.control.init_transfer(init_info), rendezvous, timeout_s, "init_weight_transfer_engine"
        )

    def apply(self, ticket: UpdateTicket, send: Callable[[], None] | None = None) -> UpdateOutcome:
        """Load ``ticket``'s version; ``send`` runs the sender concurrently when it lives in this process."""
        seconds: dict[str, float] = {}
        t_total = time.perf_counter()
        if self.state is ReplicaState.SERVING:
            self.control.pause()
            self.state = ReplicaState.PAUSED
        try:
            self.control.start()
            t0 = time.perf_counter()
            _concurrently(
                lambda: self.control.update(ticket.to_update_info()), send, ticket.timeout_s, "update_weights"
            )
            seconds[SyncPhase.TRANSFER.value] = time.perf_counter() - t0
            t0 = time.perf_counter()
            self.control.finish(str(ticket.version))
            seconds[SyncPhase.LOAD.value] = time.perf_counter() - t0
        except Exception as e:
            torn = UNTOUCHED not in str(e)
            if torn:
                self.state = ReplicaState.TORN
                raise UpdateFailed(
                    f"version {ticket.version} failed after bytes reached the parameters: {e}; "
                    "the replica stays paused until a whole version loads",
                    ReplicaState.TORN,
                ) from e
            self.control.resume()
            self.state = ReplicaState.SERVING
            raise UpdateFailed(
                f"version {ticket.version} was refused before any parameter changed: {e}; "
                f"the replica keeps serving version {self.version}",
                ReplicaState.SERVING,
            ) from e
        self.version = ticket.version
        self.control.resume()
        self.state = ReplicaState.SERVING
        seconds[SyncPhase.TOTAL.value] = time.perf_counter() - t_total
        return UpdateOutcome(ticket.version, seconds)
