"""One engine worker's updates, without vLLM: receivers, in-place destinations, fail-stop state, receipts.

vLLM's weight-transfer engine (``engine.py``) runs this inside every worker; the GPU
host, where vLLM's GPU build cannot be installed, runs the very same class against a
vLLM-layout parameter set (``tests/gpu/harness.py``). So what the GPU tests prove about
receiving into vLLM's parameters is the code vLLM runs; only the ``Model`` adapter
differs (vLLM's layerwise reload there, plain copies in the harness).

Where the bytes land:

- **In place.** When the receiver knows the version's table, the updater gives it views
  of the model's own parameters (``placement``: fused q/k/v and gate/up row blocks
  included) for every tensor whose dtype and shape a parameter holds as such, in modules
  it can write whole. GPU channels receive those tensors straight into the parameters,
  at the addresses CUDA graphs captured: no staging, no loader copy.
- **Through the model's loader** for the rest (tensor-parallel shards, dtype casts,
  quantised or repacked layers, renamed tensors).

Once any byte landed in a parameter the update cannot be rolled back: if a later step
fails the updater is ``torn`` and its receipt says so; the agent keeps the replica paused
and loads a whole version before it serves again.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from weightsync import channels
from weightsync.channels import placement, region_groups
from weightsync.channels.base import Receiver, Rendezvous, UpdateTicket, WorkerContext
from weightsync.errors import IntegrityError, PermanentError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel, SyncPhase
from weightsync_inference.receipts import Receipt
from weightsync_inference.staging import Stager


class Model(Protocol):
    """The model an update writes into."""

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]: ...

    def fused_mapping(self) -> Mapping[str, tuple[str, str | int]]:
        """Trainer name parts -> fused engine parameter parts (``placement.FUSED_LLAMA_QWEN``)."""
        ...

    def writes_in_place(self) -> bool:
        """Whether trainer tensors may be written into parameters at all (not for sharded or renamed models)."""
        ...

    def check(self, table: TensorTable) -> None:
        """Refuse a table the model would not load whole (``ModelMismatchError`` naming the tensor), changing
        nothing: before the first byte lands in a parameter, in place or through the loader."""
        ...

    def begin_load(self, table: TensorTable) -> None:
        """Before the first tensor goes through the loader (``check``ed already: nothing changed yet)."""
        ...

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None: ...

    def end_load(self, wrote_in_place: bool) -> None:
        """After the last tensor: finish what ``begin_load`` started; refresh what depends on in-place writes."""
        ...

    def abandon_load(self) -> None:
        """A failed update: end what ``begin_load`` started so the next update starts clean (the model stays torn)."""
        ...


class Updater:
    """One worker's receivers and update state; drive it start -> receive* -> finish."""

    def __init__(self, model: Model, ctx: WorkerContext) -> None:
        self.model, self.ctx = model, ctx
        self.receivers: dict[Channel, Receiver] = {}
        self.receiver: Receiver | None = None
        self.torn = False
        self._receipt = Receipt()
        self._ticket: UpdateTicket | None = None
        self._loaded: set[str] = set()
        self._loading = False
        self._seconds = 0.0
        self._load_seconds = 0.0
        self._places: dict[str, dict[str, torch.Tensor]] = {}
        self._checked: set[str] = set()
        self.stager = Stager(ctx)
        self.regions = region_groups.Kept()
        """The sharded path's region group of this worker's replica, kept across versions (``sharded``)."""
        self.parts: dict[str, Any] = {}
        """The sharded path's parts of plans this worker parsed, by plan key, the newest last (``sharded.Part``,
        typed Any: that module imports this one)."""

    def init(self, rdv: Rendezvous) -> None:
        """Start (or restart) the receiver of the rendezvous' channel; one receiver per channel."""
        old = self.receivers.pop(rdv.channel, None)
        if old is not None:
            old.close()
        self.receivers[rdv.channel] = channels.receiver_class(rdv.channel).start(rdv, self.ctx)

    def record(self, receipt: Receipt) -> None:
        """The receipt of an update that did not go through the receivers (a volume's region read,
        ``volume_reads``): what the engine answers from now on, as if ``finish`` or a failure had set it."""
        self._receipt = receipt

    def stage(self, ticket: UpdateTicket, nbytes: int) -> None:
        """Receive ``ticket``'s version into the stage beside generation (``staging``); ``nbytes`` sizes the stage."""
        self.stager.begin(ticket, self._receiver_for(ticket), nbytes)

    def _receiver_for(self, ticket: UpdateTicket) -> Receiver:
        if ticket.staged:
            return self.stager.receiver(ticket)
        receiver = self.receivers.get(ticket.channel)
        if receiver is None and ticket.channel is Channel.VOLUME and ticket.root:
            # the volume needs no rendezvous: its root travels in the ticket
            self.init(Rendezvous(Channel.VOLUME, root=ticket.root))
            receiver = self.receivers[Channel.VOLUME]
        if receiver is None:
            have = ", ".join(c.value for c in self.receivers) or "none"
            raise PermanentError(
                f"no {ticket.channel.value!r} receiver: call init_weight_transfer_engine with a "
                f"{ticket.channel.value!r} rendezvous first (initialised: {have})"
            )
        return receiver

    @property
    def receipt(self) -> Receipt:
        """The last update's receipt; torn while an update that reached the parameters has not finished
        (in progress, or left so by a caller that died): what an agent restarted beside the engine reads."""
        if self.torn and not self._receipt.torn:
            ticket = self._ticket
            return Receipt(
                version=ticket.version if ticket else 0,
                channel=ticket.channel if ticket else None,
                ok=False,
                torn=True,
                error="an update reached the parameters and has not finished",
            )
        return self._receipt

    def start(self) -> None:
        # Loading through the model's loader starts only when the first verified group is
        # about to load, so a version refused earlier leaves the serving weights as they were.
        self._ticket, self.receiver, self._loaded, self._loading = None, None, set(), False
        self._seconds = self._load_seconds = 0.0

    def place(self, table: TensorTable) -> Mapping[str, torch.Tensor]:
        """Views of the model's parameters for the tensors of ``table`` it can take in place.

        The same mapping object for the same layout, so channels keep what they prepared for
        it (recorded copies, registered memory). Receivers call it right before they post
        receives: from then on the parameters may change, so the update is torn until it
        finishes.
        """
        self._check(table)
        key = table.layout_digest()
        views = self._places.get(key)
        if views is None:
            views = self._places[key] = self._in_place_views(table)
        if views:
            self.torn = True
        return views

    def _check(self, table: TensorTable) -> None:
        """The model's check, once per layout: a layout loads alike every version (and a switch is milliseconds)."""
        key = table.layout_digest()
        if key not in self._checked:
            self.model.check(table)
            self._checked.add(key)

    def _in_place_views(self, table: TensorTable) -> dict[str, torch.Tensor]:
        if not self.model.writes_in_place():
            return {}
        params = dict(self.model.named_parameters())
        layout = placement.layout_of(params.items())
        direct = placement.direct_plan(table, layout, self.model.fused_mapping())
        return placement.resolve(placement.whole_modules(direct, layout), params)

    def receive(self, ticket: UpdateTicket) -> None:
        t0 = time.perf_counter()
        try:
            self._receive(ticket)
        except Exception as e:
            self._fail(ticket, e)
            raise
        finally:
            self._seconds += time.perf_counter() - t0

    def _receive(self, ticket: UpdateTicket) -> None:
        receiver = self.receiver = self._receiver_for(ticket)
        if self._ticket is not None and self._ticket.version != ticket.version:
            raise PermanentError(f"update for version {ticket.version} inside the update of {self._ticket.version}")
        self._ticket = ticket
        for group in receiver.receive(ticket, self.place):
            self._load([(spec.name, tensor) for spec, tensor in group], receiver)
            self._loaded.update(spec.name for spec, _ in group)
        self._loaded.update(receiver.in_place)
        if ticket.verify:
            unverified = sorted(self._loaded - receiver.verified.keys())
            if unverified:
                raise IntegrityError(f"tensors {unverified[:5]!r} were loaded without a digest to check them against")

    def _load(self, weights: list[tuple[str, torch.Tensor]], receiver: Receiver) -> None:
        if not self._loading:
            assert receiver.table is not None
            self._check(receiver.table)  # raises ModelMismatchError having changed nothing
            self.model.begin_load(receiver.table)
            self._loading = True
            self.torn = True
        t0 = time.perf_counter()
        self.model.load(weights)
        self._load_seconds += time.perf_counter() - t0

    def finish(self) -> None:
        ticket, receiver = self._ticket, self.receiver
        try:
            if ticket is not None and receiver is not None and receiver.table is not None:
                missing = [s.name for s in receiver.table if s.name not in self._loaded]
                if missing:
                    raise PermanentError(
                        f"version {ticket.version} is incomplete: {len(missing)} tensors never arrived "
                        f"(first: {missing[:3]!r}); the replica must stay paused until a whole version loads"
                    )
            t0 = time.perf_counter()
            if self._loading or (receiver is not None and receiver.in_place):
                self.model.end_load(wrote_in_place=receiver is not None and bool(receiver.in_place))
            self._loading = False
            finish_seconds = time.perf_counter() - t0
        except Exception as e:
            self._fail(ticket, e)
            raise
        self.torn = False
        if ticket is not None and receiver is not None:
            self._receipt = self._success(ticket, receiver, finish_seconds)

    def _success(self, ticket: UpdateTicket, receiver: Receiver, finish_seconds: float) -> Receipt:
        in_place = receiver.in_place
        transfer = max(0.0, self._seconds - receiver.verify_seconds - self._load_seconds)
        return Receipt(
            version=ticket.version,
            channel=ticket.channel,
            layout_digest=receiver.table.layout_digest() if receiver.table is not None else "",
            digests=dict(receiver.verified) if ticket.verify else {},
            in_place=tuple(sorted(in_place)),
            loader=tuple(sorted(self._loaded - in_place)),
            seconds={
                SyncPhase.TRANSFER: transfer,
                SyncPhase.VERIFY: receiver.verify_seconds,
                SyncPhase.LOAD: self._load_seconds + finish_seconds,
            },
        )

    def _fail(self, ticket: UpdateTicket | None, error: BaseException) -> None:
        """Record the failure; end a load it left open, so the next version starts from clean state
        (vLLM skips layers it thinks are mid-load, and would count a half-loaded layer's old weights as loaded).
        The model stays torn until a whole version loads."""
        if self._loading:
            self._loading = False
            self.model.abandon_load()
        self._receipt = Receipt(
            version=ticket.version if ticket else 0,
            channel=ticket.channel if ticket else None,
            ok=False,
            torn=self.torn,
            error=f"{type(error).__name__}: {error}",
        )

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
        self.receivers.clear()
        self.receiver = None


__all__ = ["Model", "Updater"]
