"""The weight-transfer engine that vLLM runs in each worker, one subclass per channel.

vLLM drives it through its lifecycle (init -> start -> update* -> finish). The engine
builds the channel's receiver from the plain-dict ``init_info``, turns each
``update_info`` into an ``UpdateTicket``, and loads what the receiver yields through
vLLM's layerwise reload (``start`` initialises it, ``finish`` finalises it), which is
what makes the CPU backend's repacked linear layers and quantised layers load
correctly. Receivers verify each group against the trainer's digests before it is
handed over, so a refused group never touches a parameter.

Once a group has been loaded the update cannot be rolled back: if a later group
fails, vLLM marks the update inactive and the model holds a mix. The engine records
that (``torn``); the replica agent must keep the replica paused and load a whole
version (start -> update -> finish) before serving again. A receipt of the digests the
engine saw is written per version when ``init_info`` names a ``receipt_dir``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from weightsync import channels
from weightsync.channels import placement
from weightsync.channels.base import Receiver, UpdateTicket, WorkerContext
from weightsync.errors import IntegrityError, ModelMismatchError, PermanentError, WeightsyncError
from weightsync.vocabulary import Channel
from weightsync_inference import validation
from weightsync_inference.lifecycle import UNTOUCHED

RENAMES = ("prefix", "substr", "suffix", "regex", "renaming")
"""``WeightsMapper`` rules that rename checkpoint tensors (the model's names then differ from the checkpoint's)."""


class UpdateRefused(WeightsyncError):
    """An update failed before any byte reached a parameter; the serving weights are intact."""


@dataclass
class InitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class UpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    ticket: UpdateTicket | None = None


class WeightsyncEngine(WeightTransferEngine[InitInfo, UpdateInfo]):  # type: ignore[misc]
    channel: ClassVar[Channel]
    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receivers: dict[Channel, Receiver] = {}
        self.receiver: Receiver | None = None
        self.receipt_dir: Path | None = None
        self.torn = False
        self._ticket: UpdateTicket | None = None
        self._loaded: dict[str, str] = {}
        self._seconds = 0.0
        self._load_seconds = 0.0
        self._finish_seconds = 0.0
        self._reloading = False

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        return InitInfo(fields=dict(init_dict))

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        return UpdateInfo(ticket=UpdateTicket.from_update_info(update_dict))

    def _context(self) -> WorkerContext:
        pc = self.parallel_config
        return WorkerContext(rank=int(getattr(pc, "rank", 0)), world_size=int(pc.world_size), device=str(self.device))

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Build (or rebuild) the receiver of ``init_info["channel"]`` (default: this engine's channel).

        One engine holds a receiver per channel, so the coordinator can move a replica
        between channels (a live stream, and the volume for catch-up and recovery)
        without restarting vLLM. Rebuilding a channel's receiver replaces its group.
        """
        init = dict(init_info.fields)
        channel = Channel.parse(str(init.pop("channel", self.channel.value)))
        receipt_dir = init.pop("receipt_dir", None)
        if receipt_dir:
            self.receipt_dir = Path(receipt_dir)
        old = self.receivers.pop(channel, None)
        if old is not None:
            old.close()
        self.receivers[channel] = channels.receiver_class(channel).from_init(init, self._context())

    def _receiver_for(self, ticket: UpdateTicket) -> Receiver:
        receiver = self.receivers.get(ticket.channel)
        if receiver is None and ticket.channel is Channel.VOLUME:
            # the volume needs no rendezvous: its root travels in the ticket
            receiver = channels.receiver_class(Channel.VOLUME).from_init({}, self._context())
            self.receivers[Channel.VOLUME] = receiver
        if receiver is None:
            have = ", ".join(c.value for c in self.receivers) or "none"
            raise PermanentError(
                f"no {ticket.channel.value!r} receiver: call init_weight_transfer_engine with channel "
                f"{ticket.channel.value!r} first (initialised: {have})"
            )
        return receiver

    def start_weight_update(self) -> None:
        # The layerwise reload moves layers to the meta device; it starts only when the
        # first verified group is about to load, so a version refused earlier leaves the
        # serving weights exactly as they were.
        self._ticket, self._loaded, self._seconds, self._reloading = None, {}, 0.0, False
        self._load_seconds = 0.0

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
        try:
            self._receive(update_info.ticket)
        except Exception as e:
            if not self._reloading:
                # nothing reached a parameter: say so, so the agent resumes the old version
                raise UpdateRefused(f"{type(e).__name__}: {e} {UNTOUCHED}") from e
            raise
        finally:
            self._seconds += time.perf_counter() - t0

    def _receive(self, ticket: UpdateTicket | None) -> None:
        if ticket is None:
            raise PermanentError("update_info carried no ticket")
        receiver = self.receiver = self._receiver_for(ticket)
        if self._ticket is not None and self._ticket.version != ticket.version:
            raise PermanentError(f"update for version {ticket.version} inside the update of {self._ticket.version}")
        self._ticket = ticket
        for group in receiver.receive(ticket):
            self._load([(spec.name, tensor) for spec, tensor in group])
            for spec, _ in group:
                self._loaded[spec.name] = ""
        if ticket.verify:
            unverified = [n for n in self._loaded if n not in receiver.verified]
            if unverified:
                raise IntegrityError(f"tensors {unverified[:5]!r} were loaded without a digest to check them against")
            self._loaded.update(receiver.verified)

    def finish_weight_update(self) -> None:
        ticket = self._ticket
        if ticket is not None:
            table = self.receiver.table if self.receiver is not None and self.receiver.table else ticket.table
            missing = [s.name for s in table if s.name not in self._loaded]
            if missing:
                raise PermanentError(
                    f"version {ticket.version} is incomplete: {len(missing)} tensors never arrived "
                    f"(first: {missing[:3]!r}); the replica must stay paused until a whole version loads"
                )
        t0 = time.perf_counter()
        self._finalize()
        self._finish_seconds = time.perf_counter() - t0
        self.torn = False
        if ticket is not None and self.receipt_dir is not None:
            self._write_receipt(ticket)

    def _check_table(self) -> None:
        """Refuse a version that does not fit the model before its first tensor loads.

        Runs after the layerwise reload began, because the CPU backend keeps only packed
        copies of linear weights; the reload restores their shapes (on the meta device).
        Models whose checkpoint names vLLM rewrites (a ``hf_to_vllm_mapper`` with renames)
        are left to vLLM's loader.
        """
        ticket = self._ticket
        table = self.receiver.table if self.receiver is not None and self.receiver.table else None
        table = table or (ticket.table if ticket is not None else None)
        mapper = getattr(type(self.model), "hf_to_vllm_mapper", None)
        renames = any(getattr(mapper, f"orig_to_new_{kind}", None) for kind in RENAMES)
        if not table or renames:
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

        if self._reloading:
            finalize_layerwise_reload(self.model, self.model_config)
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

    def _write_receipt(self, ticket: UpdateTicket) -> None:
        assert self.receipt_dir is not None
        self.receipt_dir.mkdir(parents=True, exist_ok=True)
        rank = self._context().rank
        path = self.receipt_dir / f"v{ticket.version:08d}-rank{rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "version": ticket.version,
                    "channel": ticket.channel.value,
                    "tensors": len(self._loaded),
                    "digests": self._loaded if ticket.verify else {},
                    "receive_seconds": self._seconds,
                    "load_seconds": self._load_seconds,
                    "finish_seconds": self._finish_seconds,
                }
            )
        )
        os.replace(tmp, path)

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


__all__ = ["CpuEngine", "IpcEngine", "NcclEngine", "VolumeEngine", "WeightsyncEngine"]


class NixlEngine(WeightsyncEngine):
    channel = Channel.NIXL
