"""The weight-transfer engine that vLLM runs in each worker, one subclass per channel.

vLLM drives it through its lifecycle (init -> start -> update* -> finish). ``init``
starts the planned channel's receiver from the plan's typed ``Rendezvous`` (vLLM's
``init_info`` is its JSON form); each ``update_info`` is an ``UpdateTicket``. The work is
``updates.Updater``'s (receivers, in-place destinations, fail-stop state, receipts), the
same class the GPU host's harness runs; this module adapts vLLM's model to it:

- tensors that cannot be written in place (tensor-parallel shards, dtype casts,
  quantised or repacked layers, renamed tensors) load through vLLM's layerwise reload
  (``initialize_layerwise_reload`` when the first such group arrives, after checking the
  version fits the model; ``finalize_layerwise_reload`` at finish), which is what makes
  the CPU backend's repacked linear layers and quantised layers load correctly;
- a version is checked against vLLM's own loader before the first tensor loads
  (``dryrun``: renames, stacked and merged expert parameters, tensor-parallel shards), so
  a version that cannot load is refused naming the tensor, with no parameter changed;
- with tied embeddings, the layers sharing the embedding's weight are post-processed
  again after every reload or in-place write (the CPU backend keeps a packed copy of the
  head's weight);
- mixture-of-experts layers on the CPU backend are prepacked again after a reload: vLLM
  0.32 prepacks their expert weights for its CPU kernel only when the model first loads,
  so its layerwise reload left them in the loader's layout, which that kernel reads as
  other numbers (vLLM's own ``reload_weights`` of an unchanged checkpoint moved a tiny
  Mixtral's log-probabilities by up to 5.3; see ``_prepack_moe_again``).

Each worker keeps the receipt of its last update; the agent reads it through vLLM's
``collective_rpc`` (``weightsync_inference.worker``) and acks from it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from weightsync.channels import placement
from weightsync.channels.base import Rendezvous, UpdateTicket, WorkerContext
from weightsync.errors import PermanentError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel
from weightsync_inference import dryrun
from weightsync_inference.receipts import Identity, Receipt
from weightsync_inference.updates import Updater

log = logging.getLogger(__name__)
RENAMES = ("prefix", "substr", "suffix", "regex", "renaming")
"""``WeightsMapper`` rules that rename checkpoint tensors (the model's names then differ from the checkpoint's)."""
_RELOAD_LOG = "vllm.model_executor.model_loader.reload.layerwise"
PREPACKS = "weightsync_prepacks_moe"
"""Marks a MoE layer's post-processing that ``VllmModel`` made prepack the experts again (installed once)."""


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


class VllmModel:
    """vLLM's model behind ``updates.Model``: its layerwise reload for what goes through the loader."""

    def __init__(self, engine: WeightsyncEngine) -> None:
        self.engine = engine
        self._reloading = False

    @property
    def _model(self) -> Any:
        return self.engine.model

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        params: Iterable[tuple[str, torch.Tensor]] = self._model.named_parameters()
        return params

    def fused_mapping(self) -> Mapping[str, tuple[str, str | int]]:
        return placement.fused_mapping(self._model)

    def _renames(self) -> bool:
        mapper = getattr(type(self._model), "hf_to_vllm_mapper", None)
        return any(getattr(mapper, f"orig_to_new_{kind}", None) for kind in RENAMES)

    def _sharded(self) -> bool:
        return int(self.engine.parallel_config.tensor_parallel_size) > 1

    def writes_in_place(self) -> bool:
        return not self._renames() and not self._sharded()

    def check(self, table: TensorTable) -> None:
        """Refuse a version that does not fit the model before any of its bytes lands: vLLM's own loader, run on
        meta tensors in checkpoint layout (``dryrun``); and a float tensor of another dtype than its parameter's."""
        tied = bool(getattr(self.engine.model_config.hf_config, "tie_word_embeddings", False))
        dryrun.check(self._model, table, optional=frozenset({"lm_head.weight"}) if tied else frozenset())

    def begin_load(self, table: TensorTable) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._prepack_moe_again()
        initialize_layerwise_reload(self._model)
        self._reloading = True

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self._model.load_weights(weights)

    def end_load(self, wrote_in_place: bool) -> None:
        reloaded = self._reloading
        self._finalize()
        if reloaded or wrote_in_place:
            self._refresh_tied_layers()

    def abandon_load(self) -> None:
        try:
            self._finalize()
        except Exception as e:  # noqa: BLE001 - the update already failed; keep its error, say this one
            log.warning("finalising the failed reload raised %s: %s", type(e).__name__, e)

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._reloading:
            return
        self._reloading = False
        quiet = _SkipWrittenInPlace()
        reload_log = logging.getLogger(_RELOAD_LOG)
        reload_log.addFilter(quiet)
        try:
            finalize_layerwise_reload(self._model, self.engine.model_config)
        finally:
            reload_log.removeFilter(quiet)

    def _prepack_moe_again(self) -> None:
        """Make vLLM's CPU mixture-of-experts layers prepack their expert weights after every reload, as they do once
        at load (an upstream gap in vLLM 0.32, CPU backend only).

        A reload runs the layer's ``process_weights_after_loading`` with the loaded (unpacked) weights, which sets
        the kernel format up but prepacks only on a layer's first load; the unpacked result is then copied over
        the prepacked parameters the CPU kernel reads. Running the experts' own prepack step there again, where
        vLLM would on a first load, gives the kernel what it expects. Installed once per layer, however many
        adapters a worker makes (recording a layout makes its own): prepacking twice scrambles the experts."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for module in self._model.modules():
            method = getattr(module, "quant_method", None)
            kernel = getattr(method, "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if method is None or experts is None or not type(experts).__module__.endswith(".cpu_moe"):
                continue
            process = method.process_weights_after_loading
            if getattr(process, PREPACKS, False):
                continue

            def process_and_prepack(layer: Any, process: Any = process, experts: Any = experts) -> None:
                process(layer)
                experts.process_weights_after_loading(layer)

            setattr(process_and_prepack, PREPACKS, True)
            method.process_weights_after_loading = process_and_prepack

    def _refresh_tied_layers(self) -> None:
        """Re-run post-processing for layers that share their weight with another layer.

        With tied embeddings the head receives no tensor of its own, so the layerwise
        reload leaves its processed state as it was; vLLM's CPU backend keeps a packed
        GEMM copy of the head's weight there, which would go on computing logits with the
        previous version. Processing it again from the (updated) shared weight fixes that;
        on backends without such a copy it is a no-op.
        """
        by_storage: dict[int, list[torch.nn.Module]] = {}
        for module in self._model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and not weight.is_meta:
                by_storage.setdefault(weight.data_ptr(), []).append(module)
        for modules in by_storage.values():
            if len(modules) > 1:
                for module in modules:
                    method = getattr(module, "quant_method", None)
                    if method is not None:
                        method.process_weights_after_loading(module)


class WeightsyncEngine(WeightTransferEngine[InitInfo, UpdateInfo]):  # type: ignore[misc]
    channel: ClassVar[Channel]
    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.updater = Updater(VllmModel(self), self._context())
        self._failed = False

    def _context(self) -> WorkerContext:
        pc = self.parallel_config
        return WorkerContext(rank=int(getattr(pc, "rank", 0)), world_size=int(pc.world_size), device=str(self.device))

    @property
    def receipt(self) -> Receipt:
        return self.updater.receipt

    def identity(self) -> Identity:
        """What this worker is (the agent registers the replica with it)."""
        ctx = self._context()
        device = torch.device(ctx.device)
        nixl = importlib.util.find_spec("nixl") is not None
        if device.type != "cuda":
            return Identity(ctx.rank, ctx.world_size, str(device), "", nixl)
        from weightsync.channels import gpu

        on = gpu.cuda_device(device)
        return Identity(ctx.rank, ctx.world_size, str(device), gpu.uuid(on), nixl, gpu.peers(on))

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        return InitInfo(rendezvous=Rendezvous.from_dict(init_dict))

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        return UpdateInfo(ticket=UpdateTicket.from_update_info(update_dict))

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Start (or restart) the receiver of the rendezvous' channel.

        One engine holds a receiver per channel, so the coordinator can move a replica
        between channels (a live stream, and the volume for catch-up and recovery)
        without restarting vLLM.
        """
        if init_info.rendezvous is None:
            raise PermanentError("init_info carried no rendezvous")
        self.updater.init(init_info.rendezvous)

    def start_weight_update(self) -> None:
        self._failed = False
        self.updater.start()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        """Receive a version; a failure is recorded in the receipt, not raised.

        vLLM 0.32's multiprocess executor reads its workers' replies in order and raises at the first failed one,
        leaving the other workers' replies queued for the engine's next call, which then reads a stale one: at
        tensor-parallel size 2 a replica torn by a failed update read "engine receipt is malformed" on every
        recovery and never served again. So every worker answers, ``finish_weight_update`` leaves a failed update
        as it is, and the agent's lifecycle learns of the failure from the workers' receipts (``lifecycle._loaded``),
        as it always checked them."""
        if update_info.ticket is None:
            raise PermanentError("update_info carried no ticket")
        try:
            self.updater.receive(update_info.ticket)
        except Exception as e:  # noqa: BLE001 - recorded by the updater (its receipt); raising would desync vLLM
            self._failed = True
            log.warning("worker %d: version %d failed: %s", self.updater.ctx.rank, update_info.ticket.version, e)

    def finish_weight_update(self) -> None:
        if self._failed:
            return  # the failure and whether it tore the weights are in the receipt
        try:
            self.updater.finish()
        except Exception as e:  # noqa: BLE001 - recorded by the updater (its receipt), as in ``receive_weights``
            log.warning("worker %d: finishing the update failed: %s", self.updater.ctx.rank, e)

    def stage(self, update_dict: dict[str, Any], nbytes: int) -> None:
        """Start receiving a version beside generation (``staging``); the switch is an update naming it staged."""
        self.updater.stage(UpdateTicket.from_update_info(update_dict), nbytes)

    def shutdown(self) -> None:
        self.updater.close()


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


__all__ = ["CpuEngine", "IpcEngine", "NcclEngine", "NixlEngine", "VllmModel", "VolumeEngine", "WeightsyncEngine"]
