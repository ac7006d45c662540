"""One update of one replica, through vLLM's weight-transfer lifecycle, failing stop.

    pause -> start -> update (concurrently with the sender) -> finish(version) -> resume

A staged version (``staging``) is switched in the same way, or, where requests in flight are
kept across an update anyway (``PauseMode.KEEP``), with no pause at all: one call that the
engine runs between two of its steps (``switch``), bracketed by the version it reports.

The rules this module keeps (see DESIGN.md, failure rules):
- Nothing computed under the old weights is served after a switch: the engine's caches
  keyed by tokens (vLLM's prefix cache, encoder outputs, a KV connector's cache) are reset
  here, explicitly, at the moment the new weights became visible: after ``finish`` and
  before ``resume``, or right after a switch between steps. Requests in flight are computed
  again under the new weights (their tokens so far stay: they are attributed to both).
- What the replica serves is kept on its ``served.Board`` at each of these moments (both
  versions from just before the pause or switch until the caches are reset), which the
  proxy reads instead of asking a busy engine.
- A failure before any byte reached a parameter (a corrupt shard refused, a peer
  that never connected) resumes the replica on the version it had.
- A failure after bytes landed leaves the replica PAUSED and ``TORN``: it must not
  serve a mix. Only a whole version (``recover``) makes it serve again. A switch between
  steps that tears leaves the engine refusing to step (``worker.weightsync_switch``) and
  paused once the lifecycle's pause lands.
- Every step has a timeout; a step that times out counts as a failure of that step.

The engine tells the two failures apart in its receipt (``Receipt.torn``), which the
lifecycle reads back after a failure: a field, not text in an error message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from weightsync.channels.base import UpdateTicket
from weightsync.errors import RetryableError, WeightsyncError
from weightsync.sharding.fills import EngineLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import EngineState, SyncPhase
from weightsync_inference.receipts import Identity, Receipt
from weightsync_inference.served import Board, Served
from weightsync_inference.staging import StageStatus, StagingUnavailable


class EngineControl(Protocol):
    """What the lifecycle needs from an engine: vLLM's offline ``LLM`` or its HTTP server."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def is_paused(self) -> bool: ...

    def init_transfer(self, init_info: dict[str, Any]) -> None: ...

    def start(self) -> None: ...

    def update(self, update_info: dict[str, Any]) -> None: ...

    def finish(self, version: str) -> None: ...

    def reset_caches(self) -> None:
        """Drop what the engine computed under its previous weights and keyed by tokens: the prefix cache (requests
        in flight are computed again), encoder outputs, a KV connector's cache. Raises when it could not."""
        ...

    def receipt(self) -> Receipt:
        """The engine's own record of its last update (its workers' receipts, merged)."""
        ...

    def identity(self) -> list[Identity]:
        """Each worker's identity (rank, device, GPU UUID, NIXL)."""
        ...

    def weight_version(self) -> str:
        """The version the engine last finished loading (not a number before the first update)."""
        ...

    @property
    def between_steps(self) -> bool:
        """Whether a staged version may switch in between two steps with no pause around it: where a pause would
        keep the requests in flight (``PauseMode.KEEP``), they straddle the switch either way."""
        ...

    def switch(self, update_info: dict[str, Any]) -> Receipt:
        """Switch a staged version in with one call that the engine runs between two of its steps; its receipt."""
        ...

    def label(self, version: str) -> None:
        """Set the weight version the engine reports (``/weight_info``: an agent restarted beside it reads it)."""
        ...

    def stage(self, update_info: dict[str, Any], nbytes: int) -> str:
        """Start receiving a version into the workers' stage while the engine serves (``staging``); the reason
        when a worker cannot allocate the stage (nothing was started), else empty."""
        ...

    def stage_status(self) -> StageStatus:
        """The workers' stage, merged."""
        ...


@runtime_checkable
class RegionControl(Protocol):
    """What the sharded path needs beside the lifecycle (``OfflineEngine``, ``HttpEngine``): the workers' engine
    layout of a table, the table they last received, and a sharded update (``sharded.request``)."""

    def last_table(self) -> TensorTable | None:
        """The table of the last version the workers received whole (None before any)."""
        ...

    def engine_layout(self, table: TensorTable) -> EngineLayout: ...

    def receive_regions(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker receives and lands its regions; one answer per worker (``sharded.receive``)."""
        ...

    def release_regions(self) -> list[int]:
        """Every worker lets its region groups (and IPC mappings) go: its replica left the sharded path. How many
        each let go, in worker order."""
        ...


@runtime_checkable
class VolumeRegionControl(RegionControl, Protocol):
    """An engine whose workers read a sharded volume version by region (``OfflineEngine``, ``HttpEngine``;
    ``volume_reads``)."""

    def read_regions(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker reads and lands its fills; one answer per worker (``volume_reads.read``)."""
        ...


class UpdateFailed(WeightsyncError):
    def __init__(self, message: str, state: EngineState) -> None:
        super().__init__(message)
        self.state = state


@dataclass
class UpdateOutcome:
    version: int
    receipt: Receipt
    seconds: dict[SyncPhase, float] = field(default_factory=dict)
    """The engine's phases (transfer, verify, load), the lifecycle's ``pause`` and ``resume`` calls, and ``total``
    (pause to resume; what it leaves out of the others is the start/finish/receipt round trips)."""


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


def _loaded(receipt: Receipt, ticket: UpdateTicket) -> Receipt:
    """``receipt``, if it says the engine loaded ``ticket``'s version whole; else the error that it did not."""
    if receipt.version != ticket.version or not receipt.ok:
        raise WeightsyncError(
            f"the engine's receipt is for version {receipt.version} ({'ok' if receipt.ok else receipt.error}), "
            f"not a successful load of {ticket.version}"
        )
    return receipt


class Replica:
    """Drives one engine through updates and remembers whether it may serve."""

    def __init__(self, control: EngineControl, version: int = 0, board: Board | None = None) -> None:
        """``version``: what the engine serves now (an agent restarted beside a running engine reads it there);
        ``board``: where what it serves is shown (the agent serves it to the proxy), set from ``adopt`` on."""
        self.control = control
        self.state = EngineState.SERVING
        self.version = version
        self.board = board or Board()

    def _show(self, one: int, other: int, state: EngineState) -> None:
        """What the engine may be generating with from now on: versions ``one`` to ``other``, and its state."""
        self.board.set(Served(min(one, other), max(one, other), state))

    def adopt(self) -> EngineState:
        """Take the engine over as it is found (an agent restarted beside a running engine).

        Serving: nothing to do. Paused with whole weights (the previous agent died between pause and the
        first byte): resume it, or no agent ever would. Paused and torn by the engine's receipt: stay
        paused; only a whole version (``recover``) makes it serve again.
        """
        if not self.control.is_paused():
            self.state = EngineState.SERVING
        elif self._torn():
            self.state = EngineState.TORN
        else:
            self.control.resume()
            self.state = EngineState.SERVING
        self._show(self.version, self.version, self.state)
        return self.state

    def init_transfer(
        self, init_info: dict[str, Any], rendezvous: Callable[[], None] | None = None, timeout_s: float = 120
    ) -> None:
        """Initialise the engine's receiver; ``rendezvous`` runs the sender's side concurrently. A receiver its
        workers could not start (vLLM's executor raises its plain ``Exception`` for a worker's error) fails as
        ``RetryableError``, which the agent acks as its channel's failure, the weights untouched."""

        def start() -> None:
            try:
                self.control.init_transfer(init_info)
            except WeightsyncError:
                raise
            except Exception as e:
                channel = init_info.get("channel", "its channel")
                raise RetryableError(f"the engine could not start its {channel} receiver: {e}") from e

        _concurrently(start, rendezvous, timeout_s, "init_weight_transfer_engine")

    def apply(self, ticket: UpdateTicket, send: Callable[[], None] | None = None) -> UpdateOutcome:
        """Load ``ticket``'s version; ``send`` runs the sender concurrently when it lives in this process."""

        def lifecycle() -> Receipt:
            self.control.start()
            _concurrently(
                lambda: self.control.update(ticket.to_update_info()), send, ticket.timeout_s, "update_weights"
            )
            self.control.finish(str(ticket.version))
            return _loaded(self.control.receipt(), ticket)

        return self._update(ticket, lifecycle)

    def apply_regions(self, ticket: UpdateTicket, receive: Callable[[], Receipt]) -> UpdateOutcome:
        """Load ``ticket``'s version on the sharded path: ``receive`` has every worker receive and land its regions
        (inside its own layerwise reload, not vLLM's weight-transfer lifecycle) and returns the receipt the agent
        made of the workers' answers; the engine then reports the version (``label``). Pause, cache reset, resume
        and the fail-stop rule are ``apply``'s."""

        def regions() -> Receipt:
            receipt = receive()
            self.control.label(str(ticket.version))  # vLLM's /weight_info: what an agent restarted beside it reads
            return receipt

        return self._update(ticket, regions)

    def _update(self, ticket: UpdateTicket, load: Callable[[], Receipt]) -> UpdateOutcome:
        t_total = time.perf_counter()
        paused = 0.0
        previous = self.version
        if self.state is EngineState.SERVING:
            self._show(previous, ticket.version, EngineState.PAUSED)  # before the pause: either version from here
            self.control.pause()
            self.state = EngineState.PAUSED
            paused = time.perf_counter() - t_total
        try:
            receipt = load()
        except Exception as e:
            raise self._failed(ticket, e, self.control.resume) from e
        self.version = ticket.version
        t_resume = time.perf_counter()
        self._reset_caches(previous)
        self.control.resume()
        self.state = EngineState.SERVING
        self._show(ticket.version, ticket.version, EngineState.SERVING)
        end = time.perf_counter()
        seconds = {**receipt.seconds, SyncPhase.PAUSE: paused, SyncPhase.RESUME: end - t_resume}
        seconds[SyncPhase.TOTAL] = end - t_total
        return UpdateOutcome(ticket.version, receipt, seconds)

    def _reset_caches(self, previous: int, pause: bool = False) -> None:
        """The new weights are in: drop what the engine computed under ``previous`` before it serves again. When it
        cannot, the replica must not serve (it would reuse the old weights' KV): TORN, paused (``pause``: now) until a
        whole version loads."""
        try:
            self.control.reset_caches()
        except WeightsyncError as e:
            self.state = EngineState.TORN
            self._show(previous, self.version, EngineState.TORN)
            if pause:
                with contextlib.suppress(WeightsyncError):
                    self.control.pause()
            raise UpdateFailed(
                f"version {self.version} loaded, but the engine's caches from version {previous} could not be "
                f"dropped ({e}); the replica stays paused until a whole version loads",
                EngineState.TORN,
            ) from e

    def stage(self, ticket: UpdateTicket, nbytes: int) -> None:
        """Start receiving ``ticket``'s version into the engine's stage while it serves the one it has.

        ``StagingUnavailable`` when the engine cannot hold a second copy (nothing started: load it in place)."""
        error = self.control.stage(ticket.to_update_info(), nbytes)
        if error:
            raise StagingUnavailable(error)

    def wait_staged(self, ticket: UpdateTicket, poll_s: float = 0.01) -> StageStatus:
        """Wait until ``ticket``'s version is staged; ``UpdateFailed`` when its stage failed or timed out (no
        parameter was touched: the replica keeps serving what it had)."""
        waits = ticket.join_timeout_s + ticket.timeout_s  # the sender starts at the latest at the join deadline
        deadline = time.monotonic() + waits
        while True:
            status = self.control.stage_status()
            if status.version == ticket.version and status.state in ("staged", "failed"):
                break
            if time.monotonic() > deadline:
                status = StageStatus(ticket.version, "failed", f"not staged within {waits:.0f}s")
                break
            time.sleep(poll_s)
        if status.state == "failed":
            raise UpdateFailed(
                f"version {ticket.version} was not staged: {status.error}; the replica keeps serving version "
                f"{self.version}",
                self.state,
            )
        return status

    def switch(self, ticket: UpdateTicket, staged: StageStatus | None = None) -> UpdateOutcome:
        """Switch ``ticket``'s staged version in (waiting for its stage unless ``staged`` says it is done): the
        pause lasts for the switch only, and there is none where the engine switches between steps."""
        status = staged or self.wait_staged(ticket)
        switch_ticket = dataclasses.replace(ticket, staged=True)
        if self.state is EngineState.SERVING and self.control.between_steps:
            outcome = self._between_steps(switch_ticket)
        else:
            outcome = self.apply(switch_ticket)
        # the stage's transfer and verification happened while the replica served; the switch's own copy and
        # check are part of its load
        switch = outcome.seconds
        outcome.seconds = {
            **switch,
            **status.seconds,
            SyncPhase.LOAD: sum(switch.get(p, 0.0) for p in (SyncPhase.TRANSFER, SyncPhase.VERIFY, SyncPhase.LOAD)),
        }
        return outcome

    def _between_steps(self, ticket: UpdateTicket) -> UpdateOutcome:
        """One engine call, run between two steps, with no pause: generation stops for that call only; then the
        caches are reset (a step between the two sees the old weights' prefix KV: only requests already attributed
        to both versions can be in it) and vLLM's version names the new one. From before the switch until then the
        board shows both versions (the proxy holds new completions meanwhile; one across it is attributed to
        both)."""
        previous = self.version
        self._show(previous, ticket.version, EngineState.PAUSED)
        t_switch = time.perf_counter()
        try:
            receipt = _loaded(self.control.switch(ticket.to_update_info()), ticket)
        except Exception as e:
            raise self._failed(ticket, e, lambda: None, pause=True) from e
        t_switched = time.perf_counter()
        self.version = ticket.version
        self._reset_caches(previous, pause=True)
        self.control.label(str(ticket.version))  # vLLM's /weight_info: what an agent restarted beside it reads
        self._show(ticket.version, ticket.version, EngineState.SERVING)
        end = time.perf_counter()
        seconds = {
            **receipt.seconds,
            SyncPhase.PAUSE: 0.0,
            SyncPhase.RESUME: end - t_switched,
            SyncPhase.TOTAL: end - t_switch,
        }
        return UpdateOutcome(ticket.version, receipt, seconds)

    def _failed(
        self, ticket: UpdateTicket, error: Exception, restore: Callable[[], None], pause: bool = False
    ) -> UpdateFailed:
        """The failure of ``ticket``'s update: TORN when bytes reached the parameters (paused first with ``pause``:
        the engine refuses to step until then) or it was torn before (a recovery that changed nothing leaves the
        torn weights of the update before it), else ``restore`` the serving version."""
        if self.state is EngineState.TORN or self._torn():
            self.state = EngineState.TORN
            self._show(self.version, ticket.version, EngineState.TORN)
            if pause:
                with contextlib.suppress(WeightsyncError):  # an engine that stepped since has stopped: vLLM failed
                    self.control.pause()
            return UpdateFailed(
                f"version {ticket.version} failed after bytes reached the parameters: {error}; "
                "the replica stays paused until a whole version loads",
                EngineState.TORN,
            )
        # vLLM names the version at ``finish`` even when the workers' receipts say the update failed
        self.control.label(str(self.version))
        restore()
        self.state = EngineState.SERVING
        self._show(self.version, self.version, EngineState.SERVING)
        return UpdateFailed(
            f"version {ticket.version} was refused before any parameter changed: {error}; "
            f"the replica keeps serving version {self.version}",
            EngineState.SERVING,
        )

    def _torn(self) -> bool:
        """Whether a failed (or unfinished) update left bytes in the parameters, by the engine's own receipt.

        When the engine cannot say (it died, or does not answer), the replica counts as torn:
        serving a possibly mixed version is the one thing it must not do. That includes an error that is not
        ours: vLLM's ``collective_rpc`` raises a plain ``Exception`` when a worker failed, and after a worker
        failed inside an update the next call can fail the same way (the failure escaping here would end the
        agent's thread, leaving the replica without an agent).
        """
        try:
            return self.control.receipt().torn
        except Exception:  # noqa: BLE001 - any failure to answer is an unknown state: fail-stop
            return True
