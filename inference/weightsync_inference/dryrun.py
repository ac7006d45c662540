"""Would vLLM's own loader take this version? Asked by running it on meta tensors, before any byte is loaded.

Which parameter a checkpoint tensor lands in is the model's own business: a rename
(``WeightsMapper``, Mixtral's ``block_sparse_moe``), stacked parameters (q/k/v into one
``qkv_proj``), experts merged into one parameter per layer (``experts.N.gate_proj.weight``
into rows of ``experts.w13_weight``), tensor-parallel shards, GGUF reshapes. Rather than a
table of ours, ``check`` asks the model: it puts every layer's parameters, for the length of
the check, back in checkpoint layout on the meta device (from the metadata vLLM recorded when
it built the model for its layerwise reload: the CPU backend keeps only packed copies of
linear weights), feeds ``model.load_weights`` a meta tensor of each tensor's name, dtype and
shape, with every weight loader replaced by one that runs the loader against a meta parameter
and counts what it would copy (vLLM's own ``get_numel_loaded``), then puts the layers' own
tensors back: nothing is buffered, processed or written, and no reload is left begun. Then:

- a tensor the loader refuses (no such module, a shape its loader asserts against) is named,
  with vLLM's own message;
- a tensor the loader silently skips (some models ``continue`` past names they do not know)
  is named: it would never reach the engine;
- a parameter the version does not fill completely is named, with how much of it was filled;
- a float tensor the model holds under its own name as another float dtype is named
  (``validation.check_dtypes``: a misconfigured trainer, never cast).

vLLM's sharded RDT engine bakes its plan the same way (``sharded_rdt_engine._bake``); like it,
this leans on layerwise internals (the loader wrapper it unwraps) that vLLM exposes no public
call for.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightsync.channels import placement
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import ModelMismatchError
from weightsync.tensors import TensorTable
from weightsync_inference import validation

_LAYERWISE_LOADER = "online_process_loader"


def _original(loader: Callable[..., Any]) -> Callable[..., Any]:
    """The weight loader under vLLM's layerwise wrapper (what ``_layerwise_process`` calls once a layer is whole)."""
    while getattr(loader, "__name__", "") == _LAYERWISE_LOADER:
        loader = loader.__wrapped__  # type: ignore[attr-defined]
    return loader


def _source(tensor: object, fakes: dict[int, str]) -> str | None:
    """Which fed tensor ``tensor`` is, or is a view of (a loader narrows, transposes, reshapes)."""
    while isinstance(tensor, torch.Tensor):
        name = fakes.get(id(tensor))
        if name is not None:
            return name
        tensor = tensor._base
    return None


@contextlib.contextmanager
def _checkpoint_layout(model: torch.nn.Module) -> Iterator[None]:
    """Every layer's tensors in checkpoint layout on the meta device for the block, its own tensors after."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    saved = []
    try:
        for layer in model.modules():
            params, buffers = get_layer_params_buffers(layer)
            saved.append((layer, params, buffers, set(layer._non_persistent_buffers_set)))
            restore_layer_on_meta(layer, get_layerwise_info(layer))
        yield
    finally:
        for layer, params, buffers, non_persistent in saved:
            for name in get_layer_tensors(layer):
                delattr(layer, name)
            for name, param in params.items():
                layer.register_parameter(name, param)
            for name, buffer in buffers.items():
                layer.register_buffer(name, buffer, persistent=name not in non_persistent)


def check(model: torch.nn.Module, table: TensorTable, optional: frozenset[str] = frozenset()) -> None:
    """Raise ``ModelMismatchError`` naming the first tensor or parameter of ``table`` the model would not load whole.

    Call it outside a layerwise reload (it lays the parameters out as a reload does, for its own length).
    ``optional``: parameters (and tensors) the version may leave out or the model may skip (a tied head)."""
    with _checkpoint_layout(model):
        validation.check_dtypes(table, placement.layout_of(model.named_parameters()))
        _dry_run(model, table, optional)


def _dry_run(model: torch.nn.Module, table: TensorTable, optional: frozenset[str]) -> None:
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, get_numel_loaded, to_meta_tensor
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors, get_tensor_load_numel
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    copied: dict[str, int] = {}
    fed: dict[str, int] = {}
    fakes: dict[int, str] = {}
    keep: list[torch.Tensor] = []
    current = [""]
    wrapped: list[tuple[torch.Tensor, Callable[..., Any] | None]] = []
    expected: dict[str, int] = {}

    def counting(full: str, loader: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(loader)

        def dry_loader(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            param = bound.arguments.get("param")
            if isinstance(param, torch.Tensor) and not param.is_meta:
                # the reload leaves some tensors where they are (a bias is made after the weights): a meta copy,
                # with the loader's attributes, takes the dry copy instead
                bound.arguments["param"] = to_meta_tensor(param)
            numel, answer = get_numel_loaded(loader, bound)
            copied[full] = copied.get(full, 0) + numel
            source = _source(bound.arguments.get("loaded_weight"), fakes) or current[0]
            fed[source] = fed.get(source, 0) + 1
            return answer

        return dry_loader

    for prefix, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        for name, tensor in get_layer_tensors(module).items():
            if name in SKIP_LOAD_TENSORS:
                continue
            full = f"{prefix}.{name}" if prefix else name
            loader = getattr(tensor, "weight_loader", None)
            wrapped.append((tensor, loader))
            tensor.weight_loader = counting(full, _original(loader or default_weight_loader))
            if name in params and full not in optional:
                expected[full] = get_tensor_load_numel(tensor)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for spec in table:
            fake = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device="meta")
            fakes[id(fake)] = current[0] = spec.name
            keep.append(fake)  # alive until the end: its id names it
            yield spec.name, fake

    kind = type(model).__name__
    try:
        model.load_weights(weights())  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - vLLM's loaders raise anything; the tensor and its message are named
        raise ModelMismatchError(
            f"tensor {current[0]!r}: vLLM's loader for {kind} refuses it ({type(e).__name__}: {e}); publish the "
            "checkpoint's names and shapes (what save_pretrained writes)"
        ) from None
    finally:
        for tensor, loader in wrapped:
            if loader is None:
                del tensor.weight_loader  # type: ignore[attr-defined]
            else:
                tensor.weight_loader = loader  # type: ignore[attr-defined]
    for spec in table:
        if spec.name not in fed and spec.name not in optional:
            raise ModelMismatchError(
                f"tensor {spec.name!r} was sent but vLLM's loader for {kind} loads no parameter from it; publish "
                "the checkpoint's names (what save_pretrained writes)"
            )
    for full, numel in expected.items():
        got = copied.get(full, 0)
        if numel and got < numel:
            raise ModelMismatchError(
                f"parameter {full!r} would be filled with {got} of its {numel} elements: the version lacks "
                "tensors it needs (a missing tensor, or one of another shape)"
            )


__all__ = ["check"]
