"""Staged updates: a version received beside generation, then switched in with one copy.

``Stager.begin`` allocates (or reuses) one flat buffer the size of the version on the
worker's device, then receives the version into it on a thread of its own while the
engine goes on generating with the weights it has: channels that write in place write
straight into the buffer's views, the others' groups are copied there, and everything is
checked against the trainer's digests as the channel always does. No parameter is
touched, so a stage that fails leaves the replica serving what it served.

The switch is an ordinary update through vLLM's lifecycle (pause, start, update, finish,
resume) whose receiver is the stage (``StagedReceiver``): tensors the model holds as such
are copied into their parameters (one batched copy kernel, into the same
addresses, so CUDA graphs stay valid), the rest go through the model's loader as any
channel's would; with verification on, what landed in the parameters is digested again
and compared with what was verified at the stage. The pause then lasts for the copy and
the loader, not for the transfer.

The cost is one more copy of the weights per replica, kept between versions. A worker
that cannot allocate it refuses the stage before anything is received; the agent then
loads that version in place.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weightsync.channels import batched, digests, gpu
from weightsync.channels.base import Placement, Receiver, Rendezvous, UpdateTicket, WorkerContext
from weightsync.channels.wire import Group, view_from_bytes
from weightsync.errors import IntegrityError, PermanentError, WeightsyncError
from weightsync.tensors import ALIGNMENT, TensorSpec, TensorTable, align
from weightsync.vocabulary import Channel, SyncPhase

STAGE_NICE = 19  # the staging thread's nice value (the engine's is 0): it gets the cores generation leaves


class StagingUnavailable(WeightsyncError):
    """The worker cannot hold a second copy of the weights; the version loads in place instead."""


def staging_bytes(total_bytes: int, tensor_count: int) -> int:
    """What a version's stage needs: its bytes, each tensor at an aligned offset (the table's layout)."""
    return total_bytes + tensor_count * ALIGNMENT


@dataclass
class StageStatus:
    """One worker's stage, as the agent polls it (plain data across vLLM's process boundaries)."""

    version: int = 0
    state: str = "none"
    """``none``, ``receiving``, ``staged`` or ``failed``."""
    error: str = ""
    seconds: Mapping[SyncPhase, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        seconds = {p.value: s for p, s in self.seconds.items()}
        return {"version": self.version, "state": self.state, "error": self.error, "seconds": seconds}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StageStatus:
        try:
            seconds = {SyncPhase(k): float(v) for k, v in dict(d.get("seconds", {})).items()}
            return cls(int(d["version"]), str(d["state"]), str(d.get("error", "")), seconds)
        except (KeyError, TypeError, ValueError) as e:
            raise PermanentError(f"engine stage status {dict(d)!r:.200} is malformed: {e}") from None


def merge(statuses: list[StageStatus]) -> StageStatus:
    """One replica's stage from its workers': failed if any failed, as the first when all agree, else receiving."""
    if not statuses:
        raise PermanentError("the engine returned no stage status (no worker answered)")
    failed = next((s for s in statuses if s.state == "failed"), None)
    if failed is not None:
        return failed
    first = statuses[0]
    if all(s.version == first.version and s.state == first.state for s in statuses):
        return first
    return StageStatus(first.version, "receiving")


class Stager:
    """One worker's staging buffer and the version being (or last) staged into it."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.device = torch.device(ctx.device)
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._thread: threading.Thread | None = None
        self.status = StageStatus()
        self.ticket: UpdateTicket | None = None
        self.table: TensorTable | None = None
        self.verified: dict[str, str] = {}
        self._views: dict[str, torch.Tensor] = {}
        self._layout = ""
        self._switch: tuple[tuple[str, int, int], _Switch] | None = None

    def begin(self, ticket: UpdateTicket, receiver: Receiver, nbytes: int) -> None:
        """Allocate the stage (``StagingUnavailable`` if it cannot be), then receive ``ticket`` into it on a thread."""
        if self._thread is not None and self._thread.is_alive():
            raise PermanentError(f"version {self.status.version} is still being staged; stage one version at a time")
        if self._buffer.numel() < nbytes or self._buffer.device != self.device:
            self._release()
            try:
                self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                raise StagingUnavailable(
                    f"cannot allocate {nbytes / 1e9:.2f} GB on {self.device} to stage version {ticket.version} "
                    f"beside the serving weights ({type(e).__name__}: {e}); it loads in place"
                ) from e
        self.ticket, self.table, self.verified = ticket, None, {}
        self.status = StageStatus(ticket.version, "receiving")
        self._thread = threading.Thread(
            target=self._receive, args=(ticket, receiver), name=f"weightsync-stage-v{ticket.version}", daemon=True
        )
        self._thread.start()

    def _release(self) -> None:
        self._buffer, self._views, self._layout = torch.empty(0, dtype=torch.uint8), {}, ""
        self._switch = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _place(self, table: TensorTable) -> Mapping[str, torch.Tensor]:
        """Views of the stage for every tensor of ``table`` (the same mapping for the same layout)."""
        layout = table.layout_digest()
        if layout != self._layout:
            end = max((align(s.end) for s in table), default=0)
            if end > self._buffer.numel():
                raise PermanentError(
                    f"version {self.status.version} needs {end} bytes of stage; {self._buffer.numel()} "
                    "were allocated from the version's summary"
                )
            self._views = {s.name: view_from_bytes(self._buffer, s) for s in table}
            self._layout = layout
        return self._views

    def _receive(self, ticket: UpdateTicket, receiver: Receiver) -> None:
        # below generation's CPU priority (Linux nice is per thread; threads this one starts inherit it): on a
        # CPU backend a stage running flat out beside generation took half the replica's tokens/s on 2 cores
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), STAGE_NICE)
        t0 = time.perf_counter()
        try:
            if self.device.type == "cuda":
                batched.warm(self.device)  # the switch's copy kernel compiles here, beside generation
                # its own stream: the copies and the channel's kernels overlap the engine's forward passes
                stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                with torch.cuda.stream(stream), gpu.in_background():
                    self._receive_all(ticket, receiver)
                torch.cuda.synchronize(self.device)  # the channel's own streams too
            else:
                self._receive_all(ticket, receiver)
        except Exception as e:  # noqa: BLE001 - reported through the status the agent polls
            self.status = StageStatus(ticket.version, "failed", f"{type(e).__name__}: {e}")
            return
        transfer = time.perf_counter() - t0 - receiver.verify_seconds
        seconds = {SyncPhase.TRANSFER: max(0.0, transfer), SyncPhase.VERIFY: receiver.verify_seconds}
        self.status = StageStatus(ticket.version, "staged", seconds=seconds)

    def _receive_all(self, ticket: UpdateTicket, receiver: Receiver) -> None:
        for group in receiver.receive(ticket, self._place):
            assert receiver.table is not None  # known before the first group
            views = self._place(receiver.table)  # channels that do not write in place never asked for it
            for spec, tensor in group:
                views[spec.name].copy_(tensor)
        if receiver.table is None:
            raise PermanentError(f"the {ticket.channel.value} receiver finished version {ticket.version} with no table")
        if ticket.verify:
            unverified = [s.name for s in receiver.table if s.name not in receiver.verified]
            if unverified:
                raise IntegrityError(f"tensors {unverified[:5]!r} were staged without a digest to check them against")
        self.table, self.verified = receiver.table, dict(receiver.verified)

    def switch_for(self, table: TensorTable, dests: Mapping[str, torch.Tensor]) -> _Switch:
        """The switch of ``table``'s stage into ``dests`` (the model's in-place views), prepared once per layout and
        set of views: a switch then does no per-tensor work in Python beyond what verification needs."""
        key = (table.layout_digest(), id(dests), self._buffer.data_ptr())  # the views' addresses never change
        if self._switch is None or self._switch[0] != key:
            self._switch = key, _Switch.prepare(table, dests, self._views)
        return self._switch[1]

    def receiver(self, ticket: UpdateTicket) -> StagedReceiver:
        """The receiver that switches ``ticket``'s version in: refused unless exactly that version is staged."""
        status = self.status
        if status.version != ticket.version or status.state != "staged" or self.table is None:
            raise PermanentError(
                f"version {ticket.version} is not staged here (the stage holds version {status.version}, "
                f"{status.state}{': ' + status.error if status.error else ''})"
            )
        if ticket.layout_digest and ticket.layout_digest != self.table.layout_digest():
            raise IntegrityError(f"the staged version {ticket.version} has another layout than the switch names")
        return StagedReceiver(self, ticket.channel)


def _coalesced(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same copies, each run of pairs that lie back to back in memory on both sides (q, k and v in a fused qkv
    parameter and in the stage) merged into one byte copy: on a GPU each copy costs a few microseconds beyond its
    bytes, most of a small model's switch."""
    out_d: list[torch.Tensor] = []
    out_s: list[torch.Tensor] = []
    run: list[tuple[torch.Tensor, torch.Tensor]] = []

    def flush() -> None:
        if len(run) == 1:
            out_d.append(run[0][0])
            out_s.append(run[0][1])
        elif run:
            nbytes = sum(d.numel() * d.element_size() for d, _ in run)
            out_d.append(_bytes(run[0][0], nbytes))
            out_s.append(_bytes(run[0][1], nbytes))
        run.clear()

    for d, s in zip(dests, srcs, strict=True):
        mergeable = d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous()
        if run and not (mergeable and _follows(run[-1][0], d) and _follows(run[-1][1], s)):
            flush()
        run.append((d, s))
        if not mergeable:
            flush()
    flush()
    return out_d, out_s


def _follows(before: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` starts where contiguous ``before`` ends, in the same storage."""
    return (
        before.is_contiguous()
        and t.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()
        and t.data_ptr() == before.data_ptr() + before.numel() * before.element_size()
    )


def _bytes(first: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` of ``first``'s storage as bytes, from where ``first`` starts."""
    raw = torch.empty(0, dtype=torch.uint8, device=first.device)
    return raw.set_(first.untyped_storage(), first.storage_offset() * first.element_size(), (nbytes,), (1,))


@dataclass
class _Switch:
    """What one switch does for one layout: the pairs copied into parameters and the rest, per group, for the
    loader."""

    pairs: list[tuple[TensorSpec, torch.Tensor]]
    """(spec, the parameter's view) of every tensor copied in place, in table order."""
    names: frozenset[str]
    copy: Callable[[], None]
    """``dest <- stage`` for every pair: the copies merged where they lie back to back on both sides and, on a
    GPU, one batched kernel (``batched.copies``): one launch instead of one per tensor, which would be most of a
    switch's time for a few hundred tensors."""
    rest: list[list[tuple[TensorSpec, torch.Tensor]]]
    """Per table group, (spec, stage view) of the tensors that go through the model's loader (groups with none
    left out)."""

    @classmethod
    def prepare(
        cls, table: TensorTable, dests: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]
    ) -> _Switch:
        pairs = [(spec, dests[spec.name]) for spec in table if spec.name in dests]
        copy = batched.copies(*_coalesced([d for _, d in pairs], [views[s.name] for s, _ in pairs]))
        rest = [[(s, views[s.name]) for s in group if s.name not in dests] for group in table.groups()]
        return cls(pairs, frozenset(s.name for s, _ in pairs), copy, [r for r in rest if r])


class StagedReceiver(Receiver):
    """Replays a staged version into the engine: the switch's receiver (see the module docstring)."""

    channel: ClassVar[Channel] = Channel.VOLUME  # per instance below: the channel the version was staged from

    def __init__(self, stage: Stager, channel: Channel) -> None:
        self.stage = stage
        self.channel = channel  # type: ignore[misc]
        self.begin()

    @classmethod
    def from_rendezvous(cls, rendezvous: Rendezvous, ctx: WorkerContext) -> Receiver:
        raise PermanentError("a staged version is switched in from its stage, not started from a rendezvous")

    def receive(self, ticket: UpdateTicket, place: Placement | None = None) -> Iterator[Group]:
        self.begin()
        stage = self.stage
        table = self.table = stage.table
        assert table is not None
        switch = stage.switch_for(table, place(table) if place is not None else {})
        if switch.pairs:
            switch.copy()
            self.in_place = set(switch.names)
            if ticket.verify:
                # what the parameters hold now, against what was verified at the stage
                expected = digests.to_words([stage.verified[s.name] for s, _ in switch.pairs], stage.device)
                self.check_later(switch.pairs, expected)
                self.checks_done()
        for rest in switch.rest:
            if ticket.verify:
                self.verified.update({s.name: stage.verified[s.name] for s, _ in rest})
            yield rest


__all__ = ["StageStatus", "StagedReceiver", "Stager", "StagingUnavailable", "merge", "staging_bytes"]
