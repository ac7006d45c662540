"""The direct plan: which trainer tensor lands in which rows of which engine parameter.

A GPU channel is only as fast as the copies it avoids. vLLM holds some trainer
tensors fused (q/k/v as row blocks of one ``qkv_proj``, gate/up of one
``gate_up_proj``) and the rest one to one, each parameter its own allocation. A row
block of a contiguous parameter is itself a contiguous tensor, so a channel can
write the trainer's ``q_proj.weight`` straight into rows ``[0, q)`` of
``qkv_proj.weight``: no staging buffer, no loader copy.

The plan is computed once per model from the engine's parameter layout (names,
dtypes, shapes) and the trainer's tensor table, and is plain JSON-able data::

    {"model.layers.0.self_attn.k_proj.weight": ["model.layers.0.self_attn.qkv_proj.weight", 2048, 1024], ...}

so it can be computed where vLLM runs and carried to where it does not (the GPU
benchmark builds an engine-layout parameter set from it). A trainer tensor is left
out of the plan, and goes through a staging buffer and vLLM's loaders instead,
whenever writing it in place would be wrong: another dtype (the loader casts), a
tensor-parallel shard (the fused rows do not add up to the trainer's rows), or a
name the engine does not hold as such (quantized layers, tied heads).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from weightsync.channels.wire import DTYPE_NAMES
from weightsync.errors import ModelMismatchError
from weightsync.tensors import TensorSpec

Layout = Mapping[str, tuple[str, tuple[int, ...]]]
"""Engine parameter name -> (dtype name, shape)."""

Plan = dict[str, tuple[str, int, int]]
"""Trainer tensor name -> (engine parameter name, first row, row count)."""

FUSED_LLAMA_QWEN: Mapping[str, tuple[str, str | int]] = {
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}
"""vLLM's stacked-parameter mapping for Llama, Qwen2 and Qwen3 (their ``hf_to_vllm_mapper``)."""

_SHARD_ORDER = {"q": 0, "k": 1, "v": 2}


def fused_mapping(model: object) -> Mapping[str, tuple[str, str | int]]:
    """The model class's own stacked mapping when vLLM exposes it, else the Llama/Qwen one."""
    mapper = getattr(type(model), "hf_to_vllm_mapper", None)
    stacked = getattr(mapper, "orig_to_new_stacked", None)
    return dict(stacked) if stacked else FUSED_LLAMA_QWEN


def layout_of(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The engine's layout from ``model.named_parameters()`` (dtypes the wire cannot carry are skipped)."""
    return {name: (DTYPE_NAMES[p.dtype], tuple(p.shape)) for name, p in named_parameters if p.dtype in DTYPE_NAMES}


def fused_target(name: str, mapping: Mapping[str, tuple[str, str | int]]) -> tuple[str, int] | None:
    for trainer_part, (engine_part, shard) in mapping.items():
        if trainer_part + "." in name:
            order = _SHARD_ORDER[shard] if isinstance(shard, str) else int(shard)
            return name.replace(trainer_part + ".", engine_part + ".", 1), order
    return None


def direct_plan(
    specs: Iterable[TensorSpec],
    layout: Layout,
    mapping: Mapping[str, tuple[str, str | int]] = FUSED_LLAMA_QWEN,
) -> Plan:
    """Every trainer tensor that can be written in place, with its engine rows.

    Fused shards are stacked in shard order (q, k, v; 0, 1) and must fill the fused
    parameter exactly: if they do not (a tensor-parallel shard, a missing shard), the
    whole fused parameter is left to the loader.
    """
    plan: Plan = {}
    fused: dict[str, list[tuple[int, TensorSpec]]] = {}
    for spec in specs:
        target = fused_target(spec.name, mapping)
        if target is not None and target[0] in layout:
            fused.setdefault(target[0], []).append((target[1], spec))
        elif layout.get(spec.name) == (spec.dtype, spec.shape):
            plan[spec.name] = (spec.name, 0, spec.shape[0] if spec.shape else 1)
    for param, shards in fused.items():
        dtype, shape = layout[param]
        shards.sort(key=lambda item: item[0])
        rows = [s.shape[0] for _, s in shards]
        fits = (
            len({order for order, _ in shards}) == len(shards)
            and sum(rows) == shape[0]
            and all(s.dtype == dtype and s.shape[1:] == shape[1:] for _, s in shards)
        )
        if not fits:
            continue
        start = 0
        for (_, spec), count in zip(shards, rows, strict=True):
            plan[spec.name] = (param, start, count)
            start += count
    return plan


def whole_modules(plan: Plan, layout: Layout) -> Plan:
    """The plan restricted to engine modules whose every parameter it fills completely.

    vLLM reloads weights module by module: a module that receives any tensor through its
    loader is rebuilt from what the loader got and copied back over its parameters, which
    would overwrite a parameter of it written in place. So a module is written in place
    whole or not at all (the CPU backend, which repacks linear weights, keeps e.g. a fused
    q/k/v bias in checkpoint layout but not the weight beside it).
    """
    filled: dict[str, int] = {}
    for param, _, rows in plan.values():
        filled[param] = filled.get(param, 0) + rows
    complete = {param for param, rows in filled.items() if rows == (layout[param][1][0] if layout[param][1] else 1)}
    modules: dict[str, set[str]] = {}
    for param in layout:
        modules.setdefault(param.rpartition(".")[0], set()).add(param)
    whole = {m for m, params in modules.items() if params <= complete}
    return {name: entry for name, entry in plan.items() if entry[0].rpartition(".")[0] in whole}


def plan_to_json(plan: Plan) -> dict[str, list[Any]]:
    return {name: [param, start, rows] for name, (param, start, rows) in plan.items()}


def plan_from_json(data: Mapping[str, Sequence[Any]]) -> Plan:
    plan: Plan = {}
    for name, v in data.items():
        try:
            plan[str(name)] = (str(v[0]), int(v[1]), int(v[2]))
        except (IndexError, TypeError, ValueError) as e:
            raise ModelMismatchError(
                f"direct plan entry {name!r}: got {v!r} ({e}); expected [param name, first row, row count]"
            ) from None
    return plan


def resolve(plan: Plan, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of the engine's parameters for every planned tensor (row blocks of fused ones).

    Raises naming the tensor when the plan points outside the parameter or at a layout
    that cannot be written in place (the plan was computed for another model).
    """
    views: dict[str, torch.Tensor] = {}
    for name, (param_name, start, rows) in plan.items():
        param = params.get(param_name)
        if param is None:
            raise ModelMismatchError(f"direct plan maps {name!r} to parameter {param_name!r}, which the engine lacks")
        data = param.detach()
        if data.dim() == 0 or (start, rows) == (0, data.shape[0]):
            view = data
        elif start >= 0 and start + rows <= data.shape[0]:
            view = data.narrow(0, start, rows)
        else:
            raise ModelMismatchError(
                f"direct plan maps {name!r} to rows [{start}, {start + rows}) of {param_name!r}, "
                f"which has {data.shape[0]} rows"
            )
        if not view.is_contiguous():
            raise ModelMismatchError(f"parameter {param_name!r} is not contiguous; {name!r} cannot be written in place")
        views[name] = view
    return views
