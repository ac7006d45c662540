"""What this worker keeps of every checkpoint tensor, recorded from vLLM's own loaders (the engine layout).

No table per architecture: ``record`` runs the model's own ``load_weights`` once over
recording tensors (vLLM's ``FakeRDTTensor``, which its ``sharded_rdt`` engine bakes
its plans with) named and shaped like the trainer's table. A loader narrows, selects
and chunks them as it would the real tensors and finally copies into a parameter;
each copy is recorded, nothing moves. The copy's source is replayed on a meta tensor
of the full shape and its destination read off the parameter's view, and both become
boxes (``weightsync.sharding.boxes.box_of_view``): the rows of a column-parallel
shard, the columns of a row-parallel one, the q/k/v rows of a fused ``qkv_proj``, an
expert's block of a stacked expert parameter. A tensor whose copy fires for no
parameter of this worker (another expert-parallel rank's expert) is not this
worker's. Tensor parallelism and expert parallelism are whatever the worker was
started with: the loaders ask vLLM's process groups themselves.

What a box cannot describe (a loader that transposes or casts through a view, a copy
outside any parameter's loader, two copies from one element) goes *whole* to vLLM's
loader, and with it every tensor of the module it feeds, because vLLM finalises a
module as a unit (``WorkerLayout.why_whole`` lists which and why). A loader that
does arithmetic on its input fails the recording (the fake raises, naming the op):
the replica then reports an unsupported layout and takes the gathered path.

``record`` needs the model's loadable parameters on the meta device: in a live
worker ``record_live`` puts them there through vLLM's layerwise reload and puts the
kernel tensors back afterwards (nothing loaded, so nothing changes); the benchmark
builds models on the meta device to begin with.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from weightsync.channels.wire import DTYPE_NAMES, TORCH_DTYPES
from weightsync.sharding.boxes import Box, aligned, box_of_view, contiguous_strides
from weightsync.sharding.fills import WHOLE, Fill, ParamSpec, WorkerLayout
from weightsync.tensors import TensorTable


def record(model: Any, table: TensorTable, rank: int) -> WorkerLayout:
    """This worker's layout for ``table``; raises ``NotImplementedError`` naming the op a loader needs data for."""
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor

    sink = BakeSink()
    fakes = [
        (s.name, FakeRDTTensor(s.name, torch.Size(s.shape), TORCH_DTYPES[s.dtype], torch.device("meta"), sink=sink))
        for s in table
    ]
    with _stamped(model, sink):
        model.load_weights(fakes)
    return _layout(model, table, rank, sink)


def record_live(engine: Any, table: TensorTable) -> WorkerLayout:
    """``record`` inside a running worker: the layerwise reload puts the parameters on meta, then back."""
    model = engine.updater.model  # the engine's own adapter, as an update uses it
    model.begin_load(table)  # refuses a table that does not fit the model, having changed nothing
    try:
        return record(engine.model, table, engine.updater.ctx.rank)
    finally:
        model.abandon_load()  # nothing was loaded: every layer gets its kernel tensors back


@contextmanager
def _stamped(model: Any, sink: Any) -> Iterator[None]:
    """Wrap every parameter's original loader so the sink knows which parameter a copy lands in."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    stamped: list[tuple[Any, Any]] = []
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            loader = getattr(param, "weight_loader", None)
            while getattr(loader, "__name__", "") == "online_process_loader":  # the layerwise reload's wrapper
                loader = loader.__wrapped__  # type: ignore[union-attr]
            stamped.append((param, getattr(param, "weight_loader", None)))
            param.weight_loader = _stamp(sink, module, name, loader or default_weight_loader)
    try:
        yield
    finally:
        for param, loader in stamped:
            if loader is None:
                del param.weight_loader
            else:
                param.weight_loader = loader


def _stamp(sink: Any, module: Any, name: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(inner)  # keeps the loader's signature: vLLM's loaders are called by keyword too
    def stamp(*args: Any, **kwargs: Any) -> Any:
        sink.current = (module, name)
        try:
            return inner(*args, **kwargs)
        finally:
            sink.current = None

    return stamp


def _source_box(key: tuple[str, Any], table: TensorTable) -> Box | None:
    """Replay the loader's op chain on a meta tensor of the full shape: the box it read, or None."""
    name, chain = key
    spec = table[name]
    base = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device="meta")
    view = base
    for op, args, kwargs in chain:
        view = getattr(view, op)(*args, **dict(kwargs))
    if view.dtype != base.dtype or (view is not base and view._base is not base):
        return None  # a cast or a copy, not a view of the tensor
    return box_of_view(int(view.storage_offset()), tuple(view.shape), tuple(view.stride()), spec.shape)


def _layout(model: Any, table: TensorTable, rank: int, sink: Any) -> WorkerLayout:
    modules = {id(m): prefix for prefix, m in model.named_modules()}
    index = {s.name: i for i, s in enumerate(table)}
    params: dict[str, ParamSpec] = {}
    numbers: dict[str, int] = {}
    fills: list[tuple[str, Fill]] = []  # (module, fill): the module decides whether its tensors go whole
    why: dict[str, str] = {}  # module (or tensor) -> why it goes whole; its fills' boxes are then placeholders
    recorded: set[str] = set()
    for module, copies in sink.copies_by_layer.items():
        prefix = modules[id(module)]
        for c in copies:
            name = c.src[0]
            recorded.add(name)
            param = getattr(module, c.param_name)
            full = f"{prefix}.{c.param_name}" if prefix else c.param_name
            if full not in params:
                params[full] = ParamSpec(full, DTYPE_NAMES.get(param.dtype, str(param.dtype)), tuple(param.shape))
                numbers[full] = len(numbers)
            source = _source_box(c.src, table)
            contiguous = tuple(param.stride()) == contiguous_strides(tuple(param.shape))
            dest = box_of_view(c.offset, c.shape, c.stride, tuple(param.shape)) if contiguous else None
            if source is None or dest is None or not aligned(source, dest):
                why.setdefault(prefix, f"{name} -> {full} is not a box copy")
            fills.append((prefix, Fill(index[name], source or Box.whole(()), numbers[full], dest or Box.whole(()))))
    for name in sink.copied_names - recorded:  # copied outside any parameter's loader
        why.setdefault(name, "copied outside any parameter's loader")
        fills.append((name, Fill(index[name], Box.whole(()), WHOLE, Box.whole(()))))
    return _settle(rank, table, list(params.values()), fills, why)


def _settle(
    rank: int, table: TensorTable, params: list[ParamSpec], fills: list[tuple[str, Fill]], why: dict[str, str]
) -> WorkerLayout:
    """Make whole every tensor of every module that cannot take boxes, until nothing more changes.

    A module with any copy that is not a box, or fed by a tensor some other module needs whole, or fed twice
    from one element (a worker receives each element once), takes all its tensors whole.
    """
    whole_modules = set(why)
    while True:
        whole_tensors = {f.tensor for m, f in fills if m in whole_modules}
        seen: dict[int, list[Box]] = {}
        for m, f in fills:
            if m in whole_modules:
                continue
            if f.tensor in whole_tensors:
                why.setdefault(m, f"{table.tensors[f.tensor].name} goes whole to another module")
            elif any(b.overlaps(f.source) for b in seen.get(f.tensor, [])):
                why.setdefault(m, f"{table.tensors[f.tensor].name} is read twice")
            seen.setdefault(f.tensor, []).append(f.source)
        if set(why) == whole_modules:
            break
        whole_modules = set(why)
    boxed = [f for m, f in fills if m not in whole_modules]
    wholes = sorted({f.tensor for m, f in fills if m in whole_modules})
    entire = [Fill(t, Box.whole(table.tensors[t].shape), WHOLE, Box.whole(table.tensors[t].shape)) for t in wholes]
    used = sorted({f.param for f in boxed})
    renumber = {old: new for new, old in enumerate(used)}
    return WorkerLayout(
        rank,
        tuple(params[i] for i in used),
        tuple(Fill(f.tensor, f.source, renumber[f.param], f.dest) for f in boxed) + tuple(entire),
        "; ".join(f"{m}: {w}" for m, w in sorted(why.items())),
    )
