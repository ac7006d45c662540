"""The weight-transfer engine that vLLM runs in each worker, one subclass per channel.

vLLM drives it through its lifecycle (init -> start -> update* -> finish). ``init``
starts the planned channel's receiver from the plan's typed ``Rendezvous`` (vLLM's
``init_info`` is its JSON form); each ``update_info`` is an ``UpdateTicket``.

Where the bytes land:

- **In place.** When the receiver knows the version's table, the engine gives it views
  of its own parameters (``placement``: fused q/k/v and gate/up row blocks included) for
  every tensor whose dtype and shape the parameter holds as such, in modules it can
  write whole. GPU channels receive those tensors straight into the parameters, at the
  addresses CUDA graphs captured: no staging, no loader copy.
- **Through vLLM's loaders** for the rest (tensor-parallel shards, dtype casts,
  quantised or repacked layers, renamed tensors), inside vLLM's layerwise reload
  (``start`` initialises it lazily, ``finish`` finalises it), which is what makes the
  CPU backend's repacked linear layers and quantised layers load correctly.

The receipt says which tensors went which way.

Receivers verify each group against the trainer's digests; a version that does not fit
the model is refused before its first tensor loads. Once any byte landed in a parameter
the update cannot be rolled back: if a later step fails, the engine is ``torn`` and says
so in its receipt; the agent keeps the replica paused and loads a whole version before
it serves again. Each worker keeps the receipt of its last update (the digests it
computed where the bytes landed, the phase times, torn or not); the agent reads it
through vLLM's ``collective_rpc`` (``weightsync_inference.worker``) and acks from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from weightsync import channels
from weightsync.channels import placement
from weightsync.channels.base import Receiver, Rendezvous, UpdateTicket, WorkerContext
from weightsync.errors import IntegrityError, ModelMismatchError, PermanentError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel, SyncPhase
from weightsync_inference import validation
from weightsync_inference.receipts import Identity, Receipt

RENAMES = ("prefix", "substr", "suffix", "regex", "renaming")
"""``WeightsMapper`` rules that rename checkpoint tensors (the model's names then differ from the checkpoint's)."""
_RELOAD_LOG = "vllm.model_executor.model_loader.reload.layerwise"


@dataclass
class InitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    rendezvous: Rendezvous | None = None


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    ticket: UpdateTicket | None = None


class _SkipWrittenInPlace(logging.Filter):
    """vLLM warns "Failed to load weights" for modules the reload got no tensor for: ours were written in place."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()


class WeightsyncEngine(WeightTransferEngine[InitInfo, UpdateInfo]):  # type: ignore[misc]
    channel: ClassVar[Channel]
    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receivers: dict[Channel, Receiver] = {}
        self.receiver: Receiver | None = None
        self.torn = False
        self.receipt = Receipt()
        self._ticket: UpdateTicket | None = None
        self._loaded: set[str] = set()
        self._seconds = 0.0
        self._load_seconds = 0.0
        self._reloading = False
        self._places: dict[str, dict[str, torch.Tensor]] = {}

    # ---- identity and init ----------------------------------------------------------------------------------------

    def _context(self) -> WorkerContext:
        pc = self.parallel_config
        return WorkerContext(rank=int(getattr(pc, "rank", 0)), world_size=int(pc.world_size), device=str(self.device))

    def identity(self) -> Identity:
        """What this worker is (the agent registers the replica with it)."""
        import importlib.util

        ctx = self._context()
        device = torch.device(ctx.device)
        uuid = ""
        if device.type == "cuda":
            from weightsync.channels import gpu

            uuid = gpu.uuid(gpu.cuda_device(device))
        nixl = importlib.util.find_spec("nixl") is not None
        return Identity(ctx.rank, ctx.world_size, str(device), uuid, nixl)

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        return InitInfo(rendezvous=Rendezvous.from_dict(init_dict))

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        return UpdateInfo(ticket=UpdateTicket.from_update_info(update_dict))

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Start (or restart) the receiver of the rendezvous' channel.

        One engine holds a receiver per channel, so the coordinator can move a replica
        between channels (a live stream, and the volume for catch-up and recovery)
        without restarting vLLM. Restarting a channel's receiver replaces its group.
        """
        rdv = init_info.rendezvous
        if rdv is None:
            raise PermanentError("init_info carried no rendezvous")
        old = self.receivers.pop(rdv.channel, None)
        if old is not None:
            old.close()
        self.receivers[rdv.channel] = channels.receiver_class(rdv.channel).start(rdv, self._context())

    def _receiver_for(self, ticket: UpdateTicket) -> Receiver:
        receiver = self.receivers.get(ticket.channel)
        if receiver is None and ticket.channel is Channel.VOLUME and ticket.params.get("root"):
            # the volume needs no rendezvous: its root travels in the ticket
            rdv = Rendezvous(Channel.VOLUME, root=str(ticket.params["root"]))
            receiver = self.receivers[Channel.VOLUME] = channels.receiver_class(Channel.VOLUME).start(
                rdv, self._context()
            )
        if receiver is None:
            have = ", ".join(c.value for c in self.receivers) or "none"
            raise PermanentError(
                f"no {ticket.channel.value!r} receiver: call init_weight_transfer_engine with a "
                f"{ticket.channel.value!r} rendezvous first (initialised: {have})"
            )
        return receiver

    # ---- one update -------------------------------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        # The layerwise reload moves layers to the meta device; it starts only when the
        # first verified group is about to load, so a version refused earlier leaves the
        # serving weights exactly as they were.
        self._ticket, self._loaded, self._seconds, self._reloading = None, set(), 0.0, False
        self._load_seconds = 0.0
        self.receiver = None

    def place(self, table: TensorTable) -> Mapping[str, torch.Tensor]:
        """Views of this engine's parameters for the tensors of ``table`` it can take in place.

        The same mapping object for the same layout, so channels keep what they prepared
        for it (recorded copies, registered memory). Called by the receiver right before
        it posts receives: from then on the parameters may change, so the engine is torn
        until the version finishes.
        """
        key = table.layout_digest()
        views = self._places.get(key)
        if views is None:
            views = self._places[key] = self._in_place_views(table)
        if views:
            self.torn = True
        return views

    def _in_place_views(self, table: TensorTable) -> dict[str, torch.Tensor]:
        if self._renames() or int(self.parallel_config.tensor_parallel_size) > 1:
            return {}
        params = dict(self.model.named_parameters())
        layout = placement.layout_of(params.items())
        plan = placement.whole_modules(
            placement.direct_plan(table, layout, placement.fused_mapping(self.model)), layout
        )
        return placement.resolve(plan, params)

    def _renames(self) -> bool:
        mapper = getattr(type(self.model), "hf_to_vllm_mapper", None)
        return any(getattr(mapper, f"orig_to_new_{kind}", None) for kind in RENAMES)

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if not self._reloading:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._reloading = True
            try:
                self._check_table()
            except ModelMismatchError:
                self._finalize()  # nothing was loaded: this puts every layer's weights back as they were
                raise
            self.torn = True
        t0 = time.perf_counter()
        self.model.load_weights(weights)
        self._load_seconds += time.perf_counter() - t0

    def receive_weights(self, update_info: UpdateInfo) -> None:
        t0 = time.perf_counter()
        ticket = update_info.ticket
        try:
            if ticket is None:
                raise PermanentError("update_info carried no ticket")
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
            self._load([(spec.name, tensor) for spec, tensor in group])
            self._loaded.update(spec.name for spec, _ in group)
        self._loaded.update(receiver.in_place)
        if ticket.verify:
            unverified = sorted(self._loaded - receiver.verified.keys())
            if unverified:
                raise IntegrityError(f"tensors {unverified[:5]!r} were loaded without a digest to check them against")

    def finish_weight_update(self) -> None:
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
            self._finalize()
            finish_seconds = time.perf_counter() - t0
        except Exception as e:
            self._fail(ticket, e)
            raise
        self.torn = False
        if ticket is not None and receiver is not None:
            self.receipt = self._success(ticket, receiver, finish_seconds)

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
        """Record the failure; end a reload it left open, so the next version starts from clean per-layer state
        (vLLM skips layers it thinks are mid-load, and would count a half-loaded layer's old weights as loaded).
        The replica stays torn until a whole version loads."""
        if self._reloading:
            try:
                self._finalize()
            except Exception as e:  # noqa: BLE001 - the update already failed; say so and keep the first error
                logging.getLogger(__name__).warning("finalising the failed reload raised %s: %s", type(e).__name__, e)
            self._reloading = False
        self.receipt = Receipt(
            version=ticket.version if ticket else 0,
            channel=ticket.channel if ticket else None,
            ok=False,
            torn=self.torn,
            error=f"{type(error).__name__}: {error}",
        )

    def _check_table(self) -> None:
        """Refuse a version that does not fit the model before its first tensor loads.

        Runs after the layerwise reload began, because the CPU backend keeps only packed
        copies of linear weights; the reload restores their shapes (on the meta device).
        Models whose checkpoint names vLLM rewrites (a ``hf_to_vllm_mapper`` with renames)
        are left to vLLM's loader.
        """
        receiver = self.receiver
        table = receiver.table if receiver is not None else None
        if not table or self._renames():
            return
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        validation.check_table(
            table,
            placement.layout_of(self.model.named_parameters()),
            placement.fused_mapping(self.model),
            optional=frozenset({"lm_head.weight"}) if tied else frozenset(),
            sharded=int(self.parallel_config.tensor_parallel_size) > 1,
        )

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        wrote_in_place = self.receiver is not None and bool(self.receiver.in_place)
        if self._reloading:
            quiet = _SkipWrittenInPlace()
            reload_log = logging.getLogger(_RELOAD_LOG)
            reload_log.addFilter(quiet)
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            finally:
                reload_log.removeFilter(quiet)
        if self._reloading or wrote_in_place:
            self._refresh_tied_layers()
        self._reloading = False

    def _refresh_tied_layers(self) -> None:
        """Re-run post-processing for layers that share their weight with another layer.

        With tied embeddings the head receives no tensor of its own, so the layerwise
        reload leaves its processed state as it was; vLLM's CPU backend keeps a packed
        GEMM copy of the head's weight there, which would go on computing logits with the
        previous version. Processing it again from the (updated) shared weight fixes that;
        on backends without such a copy it is a no-op.
        """
        by_storage: dict[int, list[torch.nn.Module]] = {}
        for module in self.model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and not weight.is_meta:
                by_storage.setdefault(weight.data_ptr(), []).append(module)
        for modules in by_storage.values():
            if len(modules) > 1:
                for module in modules:
                    method = getattr(module, "quant_method", None)
                    if method is not None:
                        method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
        self.receivers.clear()
        self.receiver = None


class CpuEngine(WeightsyncEngine):
    channel = Channel.CPU


class VolumeEngine(WeightsyncEngine):
    channel = Channel.VOLUME


class NcclEngine(WeightsyncEngine):
    channel = Channel.NCCL


class IpcEngine(WeightsyncEngine):
    channel = Channel.IPC


class NixlEngine(WeightsyncEngine):
    channel = Channel.NIXL


__all__ = ["CpuEngine", "IpcEngine", "NcclEngine", "NixlEngine", "VolumeEngine", "WeightsyncEngine"]
