"""Checking a version's table against a model's plain parameter layout before any byte is loaded.

vLLM's loaders fail late and vaguely on a mismatched checkpoint (a KeyError deep in a
weight loader, an assertion on sizes), after earlier layers already took new values.
This check runs once per version, before the first tensor loads, and names the tensor:
a name the model has no parameter for, a parameter no tensor fills, or a shape that
does not fit (fused q/k/v and gate/up rows included). It knows only that layout: the GPU
host's harness runs it; vLLM's engine asks vLLM's own loader instead (``dryrun``), which
knows every model's renames and merged parameters, and keeps the dtype rule from here.
"""

from __future__ import annotations

from collections.abc import Mapping

from weightsync.channels import placement
from weightsync.errors import ModelMismatchError
from weightsync.tensors import TensorTable

Layout = Mapping[str, tuple[str, tuple[int, ...]]]
FLOATS = frozenset({"float16", "bfloat16", "float32"})
"""Unquantised dtypes: a difference between these is a misconfigured trainer, not a quantised layer."""


def check_dtype(name: str, sent: str, held: str) -> None:
    """A float tensor the engine holds as another float dtype: a misconfigured trainer, refused (never cast)."""
    if held in FLOATS and sent in FLOATS and held != sent:
        raise ModelMismatchError(
            f"tensor {name!r}: dtype {sent}, the engine holds {held}; publish with the engine's dtype as the wire dtype"
        )


def check_dtypes(table: TensorTable, layout: Layout) -> None:
    """``check_dtype`` for every tensor the engine holds under its own name."""
    for spec in table:
        if spec.name in layout:
            check_dtype(spec.name, spec.dtype, layout[spec.name][0])


def check_table(
    table: TensorTable,
    layout: Layout,
    mapping: Mapping[str, tuple[str, str | int]],
    *,
    optional: frozenset[str] = frozenset(),
    sharded: bool = False,
) -> None:
    """Raise ``ModelMismatchError`` naming the first tensor or parameter that does not fit.

    ``optional`` parameters may be absent from the table (a tied head); ``sharded`` engines
    (tensor parallel) hold slices, so only names are compared there.
    """
    fused_rows: dict[str, int] = {}
    for spec in table:
        target = placement.fused_target(spec.name, mapping)
        if target is not None and target[0] in layout:
            param, _ = target
            _, shape = layout[param]
            if not sharded and tuple(spec.shape[1:]) != tuple(shape[1:]):
                raise ModelMismatchError(
                    f"tensor {spec.name!r}: shape {list(spec.shape)} does not fit the engine's fused parameter "
                    f"{param!r} of shape {list(shape)}"
                )
            fused_rows[param] = fused_rows.get(param, 0) + (spec.shape[0] if spec.shape else 1)
        elif spec.name in layout:
            dtype, shape = layout[spec.name]
            if not sharded and tuple(spec.shape) != tuple(shape):
                raise ModelMismatchError(
                    f"tensor {spec.name!r}: shape {list(spec.shape)}, the engine's parameter has shape {list(shape)}"
                )
            check_dtype(spec.name, spec.dtype, dtype)
        else:
            raise ModelMismatchError(
                f"tensor {spec.name!r} was sent but the engine has no such parameter; check the trainer's name mapping"
            )
    sent = {s.name for s in table}
    for param, (_, shape) in layout.items():
        if param in optional or param in sent:
            continue
        if param in fused_rows:
            if not sharded and fused_rows[param] != shape[0]:
                raise ModelMismatchError(
                    f"parameter {param!r}: the sent tensors fill {fused_rows[param]} of its {shape[0]} rows"
                )
            continue
        raise ModelMismatchError(
            f"parameter {param!r} (shape {list(shape)}) is not in the version: a tensor is missing"
        )
