"""Where a sharded version's regions land in one worker: its parameters, inside vLLM's layerwise reload.

On the sharded path a worker receives only the regions its engine layout needs
(``weightsync.sharding``): each a box of a checkpoint tensor and where it lands, a
``Fill`` (``Fill(r.tensor, r.source, r.param, r.dest)`` of a plan's ``Region``), with
its bytes. ``Landing`` writes them, piece by piece, whoever received them (a stream
channel, a volume's region reads):

- a box fill (``param >= 0``) is copied into box ``dest`` of the parameter, which the
  layerwise reload holds in checkpoint form: on a module's first piece the module is
  materialised (vLLM's ``materialize_layer``, as its ``sharded_rdt`` engine does);
  once every element the layout gives the module has landed, vLLM's own
  ``_layerwise_process`` finishes it (the backend's repacking, the copy into the
  kernel tensors CUDA graphs captured), so no module waits for the end of the update
  and at most the modules in flight are held twice;
- a whole fill (``param == WHOLE``) is a tensor vLLM's loader takes whole: its pieces
  (the plan cuts it at the trainer's shards like any need) are assembled, and the
  whole tensor goes to ``model.load_weights``, which finishes its module itself once
  the module's last tensor arrived.

A parameter the layout does not fill everywhere (a vocabulary vLLM pads) is zeroed
before its first piece, as vLLM's loader zeroes the padding. ``finish`` fails naming
every parameter short of elements: a worker never serves a version that did not fully
land. A piece that does not fit (a parameter the layout does not list, a box outside
it, a dtype or size other than its fill's, more elements than the layout gives a
parameter) fails before it writes, naming tensor and parameter. Once a piece landed
the update is torn until it finishes (the updater's fail-stop state covers that).

A link that copies regions itself (CUDA IPC from a trainer rank on the worker's GPU)
writes them straight into their boxes instead: ``place`` gives a fill's box as a view
(checked, its module materialised, as for a piece), ``landed`` says it was written
(``weightsync.channels.regions.Places``).

Use between the model's ``begin_load`` (``initialize_layerwise_reload``) and its
``end_load`` (``finalize_layerwise_reload``, which leaves untouched modules as they
were)::

    landing = Landing(model, layout, table)
    for pieces in received:           # any grouping, any order
        landing.land(pieces)
    landing.finish()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import IntegrityError, ModelMismatchError, PermanentError
from weightsync.sharding.boxes import Box, aligned, check_inside
from weightsync.sharding.fills import WHOLE, Fill, WorkerLayout
from weightsync.tensors import TensorTable


class Landing:
    """One update's landing in one worker; ``land`` pieces, then ``finish``."""

    def __init__(self, model: Any, layout: WorkerLayout, table: TensorTable) -> None:
        self.model, self.layout, self.table = model, layout, table
        self.nbytes = 0
        """Bytes landed so far (what this worker received of the version)."""
        self._needed = [0] * len(layout.params)  # elements the layout gives each parameter
        for f in layout.fills:
            if f.param != WHOLE:
                self._needed[f.param] += f.dest.numel
        self._landed = [0] * len(layout.params)
        self._claimed = [0] * len(layout.params)  # elements placed or written (landed, or about to be)
        self._module_of = [p.name.rpartition(".")[0] for p in layout.params]
        self._open: dict[str, list[int]] = {}  # materialised module -> its parameters
        self._whole_needed = {f.tensor: f.source.numel for f in layout.fills if f.param == WHOLE}
        self._whole_landed: dict[int, int] = {}
        self._wholes: dict[int, torch.Tensor] = {}  # whole tensors being assembled from their pieces

    def land(self, pieces: Iterable[tuple[Fill, torch.Tensor]]) -> None:
        """Write each piece where its fill says; a module whose elements all landed is finished at once."""
        with torch.no_grad():
            for fill, data in pieces:
                spec = self.table.tensors[self._tensor_index(fill)]
                self._check_data(fill, data, spec.name, spec.dtype)
                if fill.param == WHOLE:
                    self._gather_whole(fill, data, spec.name)
                else:
                    self._write(fill, data, spec.name)
                self.nbytes += data.numel() * data.element_size()

    def finish(self) -> None:
        """Raise naming every parameter (and whole tensor) that did not get all the elements its layout gives it."""
        short = [
            f"{p.name} ({self._landed[i]} of {self._needed[i]} elements)"
            for i, p in enumerate(self.layout.params)
            if self._landed[i] < self._needed[i]
        ]
        short += [
            f"{self.table.tensors[t].name} (whole: {self._whole_landed.get(t, 0)} of {n} elements)"
            for t, n in self._whole_needed.items()
            if self._whole_landed.get(t, 0) < n
        ]
        if short:
            raise IntegrityError(
                f"worker {self.layout.rank}: the version did not fully land; short: {', '.join(short[:5])}"
                f"{f' and {len(short) - 5} more' if len(short) > 5 else ''}; every region of its plan part must arrive"
            )

    def _gather_whole(self, fill: Fill, data: torch.Tensor, name: str) -> None:
        """A piece of a tensor the loader takes whole (the plan cuts it at the trainer's shards like any need):
        assembled, then handed to vLLM's loader once every element arrived."""
        if fill.tensor not in self._whole_needed:
            raise ModelMismatchError(
                f"a piece of tensor {name!r} is for vLLM's loader, but worker {self.layout.rank}'s layout does not "
                "hand that tensor whole to it"
            )
        if fill.source != fill.dest:
            raise ModelMismatchError(
                f"a piece of whole tensor {name!r} lands at {fill.dest}, not where it comes from ({fill.source})"
            )
        shape = self.table.tensors[fill.tensor].shape
        landed = self._whole_landed.get(fill.tensor, 0) + fill.source.numel
        if landed > self._whole_needed[fill.tensor]:
            raise IntegrityError(f"whole tensor {name!r} would get {landed} elements (with box {fill.source})")
        buffer = self._wholes.get(fill.tensor)
        if buffer is None:
            buffer = self._wholes[fill.tensor] = torch.empty(shape, dtype=data.dtype, device=data.device)
        buffer[_slices(fill.source)].copy_(data.reshape(fill.source.lengths))
        self._whole_landed[fill.tensor] = landed
        if landed == self._whole_needed[fill.tensor]:
            self.model.load_weights([(name, self._wholes.pop(fill.tensor))])

    def _tensor_index(self, fill: Fill) -> int:
        if not 0 <= fill.tensor < len(self.table):
            raise ModelMismatchError(f"a piece names tensor #{fill.tensor} of a table of {len(self.table)}")
        return fill.tensor

    def _check_data(self, fill: Fill, data: torch.Tensor, name: str, dtype: str) -> None:
        check_inside(fill.source, self.table.tensors[fill.tensor].shape, f"tensor {name!r}")
        if data.numel() != fill.source.numel or data.dtype != TORCH_DTYPES[dtype]:
            raise ModelMismatchError(
                f"a piece of tensor {name!r} (box {fill.source}) came as {data.numel()} elements of {data.dtype}; "
                f"expected {fill.source.numel} of {TORCH_DTYPES[dtype]}"
            )

    def place(self, fill: Fill) -> torch.Tensor | None:
        """``regions.Places``: box ``dest`` of the fill's parameter as a view of the fill's source shape, to be
        written by whoever received it (then ``landed``); checked as a piece is, its module materialised on its
        first place. None where the bytes must come as a piece: a tensor the loader takes whole, a parameter of
        another dtype than the tensor (a piece's ``copy_`` converts, a raw copy would not), a box no view of the
        source's shape can be."""
        spec = self.table.tensors[self._tensor_index(fill)]
        check_inside(fill.source, spec.shape, f"tensor {spec.name!r}")
        if fill.param == WHOLE:
            return None
        box = self._box(fill, spec.name)
        if box.dtype != TORCH_DTYPES[spec.dtype]:
            return None
        try:
            view = box.view(fill.source.lengths)
        except RuntimeError:
            return None
        self._claimed[fill.param] += fill.dest.numel
        return view

    def landed(self, fill: Fill) -> None:
        """``regions.Places``: the bytes of a placed fill were written (queued on the stream); its module is
        finished once it was the last."""
        self.nbytes += fill.source.numel * TORCH_DTYPES[self.table.tensors[fill.tensor].dtype].itemsize
        self._done(fill)

    def _write(self, fill: Fill, data: torch.Tensor, name: str) -> None:
        # through .data, like vLLM's default loader: a parameter that keeps requires_grad refuses in-place copies
        self._box(fill, name).copy_(data.reshape(fill.dest.lengths))
        self._claimed[fill.param] += fill.dest.numel
        self._done(fill)

    def _box(self, fill: Fill, name: str) -> torch.Tensor:
        """Box ``dest`` of the fill's parameter (its ``.data``), checked to take the fill (nothing written yet)."""
        if not 0 <= fill.param < len(self.layout.params):
            raise ModelMismatchError(
                f"a piece of tensor {name!r} names parameter #{fill.param}; worker {self.layout.rank}'s layout "
                f"lists {len(self.layout.params)}"
            )
        spec = self.layout.params[fill.param]
        check_inside(fill.dest, spec.shape, f"parameter {spec.name!r}")
        if not aligned(fill.source, fill.dest):
            raise ModelMismatchError(f"box {fill.source} of tensor {name!r} does not fill {fill.dest} of {spec.name!r}")
        if self._claimed[fill.param] + fill.dest.numel > self._needed[fill.param]:
            raise IntegrityError(
                f"parameter {spec.name!r} would get {self._claimed[fill.param] + fill.dest.numel} elements "
                f"(with box {fill.dest} of tensor {name!r}); its layout gives it {self._needed[fill.param]}"
            )
        layer = self._materialised(fill.param)
        param: torch.Tensor = getattr(layer, spec.name.rpartition(".")[2]).data
        return param[_slices(fill.dest)]

    def _done(self, fill: Fill) -> None:
        self._landed[fill.param] += fill.dest.numel
        if self._landed[fill.param] == self._needed[fill.param]:
            self._settle(fill.param)

    def _materialised(self, param: int) -> torch.nn.Module:
        """The parameter's module, materialised on its first piece (parameters short of full coverage zeroed)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        prefix = self._module_of[param]
        layer: torch.nn.Module = self.model.get_submodule(prefix)
        if prefix in self._open:
            return layer
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            raise PermanentError(
                f"module {prefix!r} is not being reloaded (or was finished already): land pieces between the "
                "model's begin_load (vLLM's initialize_layerwise_reload) and its end_load, each element once"
            )
        materialize_layer(layer, info)
        members = [i for i, m in enumerate(self._module_of) if m == prefix]
        for i in members:
            spec = self.layout.params[i]
            if self._needed[i] < _numel(spec.shape):
                getattr(layer, spec.name.rpartition(".")[2]).data.zero_()
        self._open[prefix] = members
        return layer

    def _settle(self, param: int) -> None:
        """Finish the module when this was its last parameter short of elements: vLLM's own processing and copy
        into the kernel tensors (``_layerwise_process``, which materialises nothing more and replays no loader
        call: none were buffered for a module the layout fills by boxes)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _layerwise_process

        prefix = self._module_of[param]
        if any(self._landed[i] < self._needed[i] for i in self._open[prefix]):
            return
        layer = self.model.get_submodule(prefix)
        _layerwise_process(layer, LAYERWISE_INFO[layer])


def _numel(shape: tuple[int, ...]) -> int:
    return Box.whole(shape).numel


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


__all__ = ["Landing"]
