"""Trainer names -> the checkpoint names vLLM's ``load_weights`` expects, in one place.

A trainer's parameter names carry wrappers that vLLM has never heard of:
``torch.compile`` (``_orig_mod.``), activation checkpointing
(``_checkpoint_wrapped_module.``), FSDP1 (``_fsdp_wrapped_module.``), PEFT
(``base_model.model.`` and ``.base_layer``). vLLM loads HF checkpoint names, so we
strip exactly those and nothing else, and skip what must never move (rotary caches
and other non-persistent state that vLLM recomputes).
"""

from __future__ import annotations

import re

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
