"""Weight sources: what a trainer publishes, gathered one layer group at a time.

A source describes its tensors up front (``layout``: wire names, wire dtypes, full
shapes — without gathering anything) and then yields them group by group
(``groups``), already materialised and cast to the wire dtype. Materialising is a
collective for sharded trainers (FSDP2's ``DTensor.full_tensor()``), so every rank
iterates every group in the same order; the extra memory a rank holds at once is one
group, not the model.

Sources:
- ``ModuleSource``: any ``nn.Module`` — plain, transformers, FSDP2-sharded (DTensor)
  or ``torch.compile``d. Tied embeddings travel once (``named_parameters`` already
  de-duplicates shared tensors, and vLLM ties the head itself). A transformers model
  whose in-memory weights differ from its checkpoint (mixtures of experts) is published
  under the checkpoint's names and shapes, converted by transformers itself
  (``naming.Conversion``), a layer group at a time.
- ``LoraMergedSource``: a PEFT model published as merged base weights
  (W + scale * B @ A computed per group, the training model untouched).
- ``LoraAdapterSource``: only the adapter tensors of a PEFT model, under the names
  PEFT saves them with, plus the adapter config: the engine serves them as a LoRA
  adapter next to its unchanged base weights (``publish_adapter``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from weightsync.channels.wire import dtype_name
from weightsync.errors import PermanentError
from weightsync.tensors import TensorTable
from weightsync_trainer import naming

Layout = list[list[tuple[str, str, tuple[int, ...]]]]


class WeightSource(Protocol):
    def table(self) -> TensorTable: ...

    def groups(self) -> Iterator[list[torch.Tensor]]: ...


def _materialize(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather, collective across its mesh), or the tensor itself."""
    full = getattr(t, "full_tensor", None)
    if callable(full):
        gathered: torch.Tensor = full()
        return gathered
    return t


class ModuleSource:
    """Publishes ``module.named_parameters()`` under checkpoint names, cast to ``wire_dtype``."""

    def __init__(self, module: torch.nn.Module, wire_dtype: torch.dtype | None = torch.bfloat16) -> None:
        self.module = module
        self.wire_dtype = wire_dtype
        self._params = self._select()
        self._groups = naming.layer_groups(list(self._params))
        self._conversion = self._converter()
        self._published: list[list[tuple[str, torch.Tensor]]] | None = None
        """With a conversion: per group, the checkpoint names and (meta) tensors it publishes."""
        self._views: dict[str, naming.View | None] | None = None
        if self._conversion is not None:
            self._published = self._conversion.layout(self._group_params())

    def _group_params(self) -> list[dict[str, torch.Tensor]]:
        return [{n: self._params[n] for n in g} for g in self._groups]

    def _converter(self) -> naming.Conversion | None:
        return naming.Conversion.of(self.module)

    def _select(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, param in self.module.named_parameters():
            wire = naming.to_checkpoint_name(name)
            if naming.is_skipped(wire):
                continue
            out[wire] = param
        return out

    def _wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        if self.wire_dtype is not None and t.dtype.is_floating_point:
            return self.wire_dtype
        return t.dtype

    def table(self) -> TensorTable:
        published = self._published or [[(n, self._params[n]) for n in g] for g in self._groups]
        return TensorTable.build(
            [[(n, dtype_name(self._wire_dtype(t)), tuple(t.shape)) for n, t in g] for g in published]
        )

    def parameter(self, name: str) -> torch.Tensor:
        """The trainer's own tensor published as ``name``: a DTensor on a sharded trainer, neither gathered nor
        cast (``weightsync_trainer.layouts`` reads its placements)."""
        return self._params[name]

    def view(self, name: str) -> naming.View | None:
        """How published tensor ``name``, which no parameter is, is cut from one (``naming.View``: an expert of a
        fused expert parameter), or None when it is not a box of one. Probed once, on first use."""
        if self._conversion is None:
            return None
        if self._views is None:
            self._views = self._conversion.views(self._group_params())
        return self._views.get(name)

    def tensor(self, name: str) -> torch.Tensor:
        """One parameter by its model name, whole (gathered), in its own dtype."""
        return _materialize(self._params[name].detach())

    def groups(self) -> Iterator[list[torch.Tensor]]:
        with torch.no_grad():
            for i, group in enumerate(self._groups):
                tensors = {n: self.tensor(n) for n in group}
                if self._conversion is not None and self._published is not None:
                    converted = self._conversion.convert(tensors)
                    out = [converted[n] for n, _ in self._published[i]]
                else:
                    out = list(tensors.values())
                yield [t.to(self._wire_dtype(t)) for t in out]


class LoraMergedSource(ModuleSource):
    """A PEFT LoRA model published as merged base weights; adapter tensors never travel."""

    def _select(self) -> dict[str, torch.Tensor]:
        self._lora_layers: dict[str, Any] = {}  # PEFT LoraLayer modules (untyped)
        for mod_name, mod in self.module.named_modules():
            if hasattr(mod, "get_delta_weight") and hasattr(mod, "base_layer"):
                wire = naming.to_checkpoint_name(mod_name + ".base_layer.weight")
                self._lora_layers[wire] = mod
        out = {}
        for name, t in super()._select().items():
            if ".lora_" in name or "lora_embedding" in name:
                continue
            out[name] = t
        return out

    def tensor(self, name: str) -> torch.Tensor:
        t = _materialize(self._params[name].detach())
        layer = self._lora_layers.get(name)
        if layer is not None:
            for adapter in getattr(layer, "active_adapters", []):
                if adapter in getattr(layer, "lora_A", {}):
                    delta: torch.Tensor = layer.get_delta_weight(adapter)
                    t = t + delta.to(t.dtype)
        return t


class LoraAdapterSource(ModuleSource):
    """The trainable LoRA tensors of a PEFT model, named as in PEFT's ``adapter_model.safetensors``."""

    def __init__(self, module: torch.nn.Module, wire_dtype: torch.dtype | None = torch.bfloat16) -> None:
        self.adapter = str(getattr(module, "active_adapter", "default"))
        super().__init__(module, wire_dtype)

    def _select(self) -> dict[str, torch.Tensor]:
        suffix = f".{self.adapter}.weight"
        out: dict[str, torch.Tensor] = {}
        for name, param in self.module.named_parameters():
            if ".lora_" in name and name.endswith(suffix):
                out[name.removesuffix(suffix) + ".weight"] = param
        if not out:
            raise PermanentError(f"no LoRA tensors for adapter {self.adapter!r}: is this a PEFT LoRA model?")
        return out

    def _converter(self) -> naming.Conversion | None:
        return None  # adapter tensors travel under the names PEFT saves them with

    def adapter_config(self) -> str:
        """The adapter's ``adapter_config.json`` as PEFT writes it."""
        import json

        configs: Any = getattr(self.module, "peft_config", {})
        data = configs[self.adapter].to_dict()
        return json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in data.items()}, indent=1)
