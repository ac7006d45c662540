"""Trainer names -> the checkpoint names vLLM's ``load_weights`` expects, in one place.

A trainer's parameter names carry wrappers that vLLM has never heard of:
``torch.compile`` (``_orig_mod.``), activation checkpointing
(``_checkpoint_wrapped_module.``), FSDP1 (``_fsdp_wrapped_module.``), PEFT
(``base_model.model.`` and ``.base_layer``). vLLM loads HF checkpoint names, so we
strip exactly those and nothing else, and skip what must never move (rotary caches
and other non-persistent state that vLLM recomputes).

Then transformers' own conversion (``Conversion``): transformers 5 holds some models'
weights in another form than their checkpoints (a mixture-of-experts layer's experts
fused into one 3-D parameter, ``mlp.experts.gate_up_proj``; Mixtral's
``block_sparse_moe`` renamed ``mlp``) and converts them back when it saves
(``revert_weight_conversion``). The published names and tensors are what
``save_pretrained`` would write, computed by that same function, never a table of ours.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightsync.errors import PermanentError

if TYPE_CHECKING:
    import torch

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_PEFT_PREFIX = "base_model.model."
_SKIP = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")


def to_checkpoint_name(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    name = name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def is_skipped(name: str) -> bool:
    """True for tensors the engine recomputes itself (rotary caches)."""
    return bool(_SKIP.search(name))


def layer_groups(names: list[str]) -> list[list[str]]:
    """Partition names into gather/send groups: one per decoder layer, plus what comes before and after.

    A layer is keyed on the outermost integer path segment (``model.layers.3.mlp...`` ->
    3), so any architecture's stack partitions alike. Names without an index go before
    the first layer (embeddings) or after the last (final norm, head).
    """
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    for name in names:
        parts = name.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        if index is None:
            (post if stacks else pre).append(name)
            continue
        stacks.setdefault((".".join(parts[:index]), int(parts[index])), []).append(name)
    prefix_rank: dict[str, int] = {}
    for prefix, _ in stacks:
        prefix_rank.setdefault(prefix, len(prefix_rank))
    ordered = [stacks[k] for k in sorted(stacks, key=lambda k: (prefix_rank[k[0]], k[1]))]
    return [g for g in (pre, *ordered, post) if g]


class Conversion:
    """transformers' reverse conversion of one model, applied a layer group at a time.

    Built from the module a trainer publishes (plain, ``torch.compile``d, FSDP2 or PEFT: the
    first transformers model inside it); ``of`` returns None when nothing needs converting (not
    a transformers model, or one whose checkpoint form is its in-memory form), so dense models
    pay nothing. Each layer group converts alone: transformers' conversions merge or split
    tensors within one module, never across layers (``layout`` checks it on meta tensors).
    """

    def __init__(self, model: Any) -> None:
        self.model = model

    @classmethod
    def of(cls, module: torch.nn.Module) -> Conversion | None:
        try:
            from transformers import PreTrainedModel
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # an older transformers converts nothing
            return None
        model = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
        if model is None:
            return None
        probe = {n: _meta(p) for n, p in model.named_parameters()}
        converted = revert_weight_conversion(model, probe)
        if converted.keys() == probe.keys() and all(converted[n] is probe[n] for n in probe):
            return None
        return cls(model)

    def convert(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model names -> checkpoint names and tensors (views where transformers splits)."""
        from transformers.core_model_loading import revert_weight_conversion

        converted: dict[str, torch.Tensor] = revert_weight_conversion(self.model, dict(tensors))
        return converted

    def layout(self, groups: list[dict[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        """Each group's checkpoint names with a meta tensor of their shape and dtype, in the order they are sent;
        refused when a group's conversion needs a tensor of another group."""
        out = []
        for group in groups:
            meta = {n: _meta(t) for n, t in group.items()}
            try:
                converted = self.convert(meta)
            except Exception as e:  # noqa: BLE001 - transformers' own error, named with the group that raised it
                first = next(iter(group), "")
                raise PermanentError(
                    f"transformers' weight conversion of {type(self.model).__name__} fails on the layer group "
                    f"starting at {first!r} ({type(e).__name__}: {e}): its checkpoint names cannot be published "
                    "a layer at a time"
                ) from None
            out.append(sorted(converted.items(), key=lambda item: _natural(item[0])))
        return out

    def views(self, groups: list[dict[str, torch.Tensor]]) -> dict[str, View | None]:
        """Every published tensor the conversion computes, as a box of one parameter (``View``; None where it is
        not one). Groups of the same shapes under the same names but for their layer index convert alike: the
        first of each is probed, the others renamed."""
        out: dict[str, View | None] = {}
        probed: dict[tuple[tuple[str, tuple[int, ...]], ...], tuple[str, dict[str, View | None]]] = {}
        for group in groups:
            index = _layer_index(next(iter(group), ""))
            key = tuple((_unindexed(n, index), tuple(t.shape)) for n, t in group.items())
            if key not in probed:
                probed[key] = (index, _views(self, group))
            first, views = probed[key]
            for name, view in views.items():
                renamed = None if view is None else View(_reindexed(view.param, first, index), view.offsets, view.axes)
                out[_reindexed(name, first, index)] = renamed
        return out


def _layer_index(name: str) -> str:
    return next((p for p in name.split(".") if p.isdigit()), "")


def _unindexed(name: str, index: str) -> str:
    return _reindexed(name, index, "#")


def _reindexed(name: str, old: str, new: str) -> str:
    """``name`` with its layer index (its first integer segment, ``layer_groups``' key) ``old`` made ``new``."""
    if not old:
        return name
    parts = name.split(".")
    at = next(i for i, p in enumerate(parts) if p.isdigit())
    return ".".join([*parts[:at], new, *parts[at + 1 :]]) if parts[at] == old else name


@dataclass(frozen=True)
class View:
    """A published tensor that is a box of one trainer parameter (an expert's ``gate_proj`` of the fused
    ``gate_up_proj``): its dimension ``i`` runs along the parameter's dimension ``axes[i]``, from ``offsets`` (one
    per parameter dimension); a parameter dimension no axis runs along is one long there (the expert's index)."""

    param: str
    offsets: tuple[int, ...]
    axes: tuple[int, ...]

    def lengths(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The box's lengths in the parameter, for the published ``shape``."""
        return tuple(shape[self.axes.index(d)] if d in self.axes else 1 for d in range(len(self.offsets)))

    def cut(self, local: torch.Tensor, local_offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The published tensor from ``local``, a shard of the parameter starting at ``local_offsets`` that holds
        the whole box (a view where the axes keep their order, as they do for the experts transformers fuses)."""
        box = tuple(
            slice(o - lo, o - lo + n) for o, lo, n in zip(self.offsets, local_offsets, self.lengths(shape), strict=True)
        )
        rest = tuple(d for d in range(len(self.offsets)) if d not in self.axes)
        return local[box].permute(*self.axes, *rest).reshape(shape)


def _views(conversion: Conversion, group: Mapping[str, torch.Tensor]) -> dict[str, View | None]:
    """Each checkpoint tensor the group converts to, as a box of one parameter (None where it is not one).

    Found by converting index probes with transformers' own conversion: one probe per parameter dimension whose
    values are the coordinate along it, one whose values say which parameter; broadcast views, so only what the
    conversion copies takes memory (int32, the size of the group's published tensors)."""
    import torch

    params = list(group)
    ndim = max(t.dim() for t in group.values())

    def probe(k: int) -> dict[str, torch.Tensor]:
        out = {}
        for i, (name, t) in enumerate(group.items()):
            shape = tuple(t.shape)
            if k < len(shape):
                v = torch.arange(shape[k], dtype=torch.int32).view([-1 if d == k else 1 for d in range(len(shape))])
            else:  # k == ndim: which parameter; past a parameter's own dimensions: 0
                v = torch.full((1,) * len(shape), i if k == ndim else 0, dtype=torch.int32)
            out[name] = v.expand(shape)
        return out

    coords = [conversion.convert(probe(k)) for k in range(ndim + 1)]
    views: dict[str, View | None] = {}
    for name, which in coords[ndim].items():
        source = int(which.flatten()[0])
        views[name] = _box(params[source], [c[name] for c in coords[: group[params[source]].dim()]])
        if views[name] is not None and not bool((which == source).all()):
            views[name] = None
    return views


def _box(param: str, coords: list[torch.Tensor]) -> View | None:
    """The view whose coordinates ``coords`` (one tensor per parameter dimension, of the published shape) are."""
    import torch

    shape = tuple(coords[0].shape)
    offsets = tuple(int(c.flatten()[0]) if c.numel() else 0 for c in coords)
    axes: list[int] = []
    for a, n in enumerate(shape):  # the parameter dimension that steps by one along each published axis
        step = [0] * len(shape)
        step[a] = 1 if n > 1 else 0
        moved = [d for d, c in enumerate(coords) if n > 1 and int(c[tuple(step)]) != offsets[d]]
        free = [d for d in range(len(coords)) if d not in axes and d not in moved]
        if len(moved) > 1 or not (moved or free):
            return None
        axes.append(moved[0] if moved else free[-1])
    if len(set(axes)) != len(axes):
        return None
    view = View(param, offsets, tuple(axes))
    for d, c in enumerate(coords):  # every element where the view says: a box, not merely its corners
        expected = torch.full(shape, offsets[d], dtype=torch.int32)
        if d in axes:
            a = axes.index(d)
            expected += torch.arange(shape[a], dtype=torch.int32).view([-1 if i == a else 1 for i in range(len(shape))])
        if not torch.equal(c, expected):
            return None
    return view


def _meta(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s whole shape (a DTensor's global one: no collective, no copy)."""
    import torch

    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """``experts.2`` before ``experts.10``: the order a human reads the checkpoint in."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))
