"""Publishing the ``(name, tensor)`` streams frameworks hand over at each sync.

TRL's ``send_weights(iterator)``, verl's ``send_weights(weights)`` and vLLM's trainer-side
``WeightSource`` all give the weights as one pass of ``(name, tensor)`` pairs, gathered by the
framework (FSDP's ``full_tensor()``, a PEFT adapter merged in) at the moment it syncs. A
``Publisher`` needs the tensor table before the first byte moves (the coordinator plans and
verifies against it), so ``StreamSource`` learns it:

- when the framework declares its tensors up front (vLLM's ``WeightSource.metadata()``), from
  that declaration (``StreamSource.declared``);
- otherwise from the first sync: its tensors are kept (cast to the wire dtype, in host memory:
  one copy of the model there, once) while the table is built from them, then sent.

Every later sync streams straight from the framework's iterator, group by group, each tensor
checked against the table as it comes: a name, shape or count that differs fails the sync with
an error naming the tensor (the model changed under the trainer; replicas must never get a
table other than the one they planned for). Groups are the stream's own consecutive runs of
one decoder layer, so the table's order is the framework's order.

The framework's iterator is always drained, also after an error: on sharded trainers each
tensor is a collective, and the other ranks are waiting in it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from weightsync.channels.wire import dtype_name
from weightsync.errors import ModelMismatchError, PermanentError
from weightsync.tensors import TensorSpec, TensorTable
from weightsync.vocabulary import VersionState
from weightsync_trainer import naming

if TYPE_CHECKING:
    from weightsync_trainer.publisher import Publisher, PublishReport

log = logging.getLogger(__name__)
Pairs = Iterable[tuple[str, torch.Tensor]]


def _layer(name: str) -> tuple[str, int] | None:
    """The outermost indexed path segment (``model.layers.3.mlp...`` -> ``("model.layers", 3)``), as
    ``naming.layer_groups`` keys a layer."""
    parts = name.split(".")
    return next(((".".join(parts[:i]), int(p)) for i, p in enumerate(parts) if p.isdigit()), None)


def stream_groups(names: list[str]) -> list[list[str]]:
    """Consecutive runs of one decoder layer (or of un-indexed names), in the stream's own order."""
    groups: list[list[str]] = []
    for i, name in enumerate(names):
        if i == 0 or _layer(name) != _layer(names[i - 1]):
            groups.append([])
        groups[-1].append(name)
    return groups


class StreamSource:
    """A ``WeightSource`` over the pairs of one sync at a time (``feed``), checked against one table."""

    def __init__(self, wire_dtype: torch.dtype | None = torch.bfloat16) -> None:
        self.wire_dtype = wire_dtype
        self._table: TensorTable | None = None
        self._pairs: Iterator[tuple[str, torch.Tensor]] | None = None
        self._device: torch.device | None = None
        self.error = ""
        """Why the last pass did not match the table (empty when it did)."""

    @classmethod
    def declared(
        cls,
        metadata: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        wire_dtype: torch.dtype | None = torch.bfloat16,
    ) -> StreamSource:
        """A source whose table comes from the framework's declaration of ``(name, dtype, shape)`` in stream order."""
        source = cls(wire_dtype)
        specs = [(naming.to_checkpoint_name(n), d, tuple(s)) for n, d, s in metadata]
        specs = [s for s in specs if not naming.is_skipped(s[0])]
        source._table = source._build(specs)
        return source

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype if self.wire_dtype is not None and dtype.is_floating_point else dtype

    def _build(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> TensorTable:
        by_name = {n: (d, s) for n, d, s in specs}
        if len(by_name) != len(specs):
            raise ModelMismatchError("the framework's weights name a tensor twice; each name must appear once")
        groups = stream_groups([n for n, _, _ in specs])
        return TensorTable.build(
            [[(n, dtype_name(self._wire(by_name[n][0])), by_name[n][1]) for n in g] for g in groups]
        )

    @property
    def learned(self) -> bool:
        return self._table is not None

    def feed(self, pairs: Pairs) -> None:
        """Take the pairs of the next sync; the first sync of a source without a declared table learns it."""
        if self._table is not None:
            self._pairs = iter(pairs)
            return
        kept: list[tuple[str, torch.Tensor]] = []
        for name, tensor in pairs:
            wire = naming.to_checkpoint_name(name)
            if naming.is_skipped(wire):
                continue
            self._device = self._device or tensor.device
            kept.append((wire, tensor.detach().to("cpu", self._wire(tensor.dtype), copy=True)))
        self._table = self._build([(n, t.dtype, tuple(t.shape)) for n, t in kept])
        self._pairs = iter(kept)

    def table(self) -> TensorTable:
        if self._table is None:
            raise PermanentError("the stream's tensor table is learned from the first sync: feed() it first")
        return self._table

    def groups(self) -> Iterator[list[torch.Tensor]]:
        """The fed pass, one table group at a time; a pass that differs from the table stops at the first mismatch
        (recorded in ``error``) after draining the framework's iterator."""
        pairs, self._pairs = self._pairs, None
        if pairs is None:
            raise PermanentError("a stream pass is consumed once: feed() the pairs of each sync before publishing")
        self.error = ""
        table = self.table()
        specs = iter(table.tensors)
        try:
            for start, end in zip(table.group_starts, (*table.group_starts[1:], len(table)), strict=True):
                group: list[torch.Tensor] = []
                for _ in range(start, end):
                    group.append(self._next(pairs, next(specs)))
                yield group
            extra = self._take(pairs)
            if extra is not None:
                self.error = (
                    f"the framework sent tensor {extra[0]!r} after the table's last one ({table.tensors[-1].name!r}): "
                    "the model's parameters changed since the first sync; weightsync's table is fixed for a run, "
                    "restart the trainer to publish another model"
                )
        except ModelMismatchError as e:
            self.error = str(e)
            raise
        finally:
            for _ in pairs:  # the other ranks may be in the gather of each remaining tensor
                pass

    def _take(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
        for name, tensor in pairs:
            wire = naming.to_checkpoint_name(name)
            if not naming.is_skipped(wire):
                return wire, tensor
        return None

    def _next(self, pairs: Iterator[tuple[str, torch.Tensor]], spec: TensorSpec) -> torch.Tensor:
        pair = self._take(pairs)
        if pair is None:
            raise ModelMismatchError(
                f"the framework's weights ended before tensor {spec.name!r} of the table learned at the first sync: "
                "the model's parameters changed; restart the trainer to publish another model"
            )
        name, tensor = pair
        if name != spec.name or tuple(tensor.shape) != spec.shape:
            raise ModelMismatchError(
                f"the framework sent tensor {name!r} {tuple(tensor.shape)} where the table has {spec.name!r} "
                f"{spec.shape}: every sync must send the same tensors in the same order as the first"
            )
        device = self._device or tensor.device
        return tensor.detach().to(device, self._wire(tensor.dtype))


def drain(pairs: Pairs) -> None:
    """Walk a framework's pairs without sending them: a rank that does not send still takes part in the gathers
    (FSDP's ``full_tensor()``) that produce them."""
    for _ in pairs:
        pass


class StreamPublisher:
    """One version per sync from a framework's pairs, through ``Publisher.from_env`` (the environment a trainer pod
    gets from the operator, or ``weightsync run`` locally).

    Only the sending rank (``rank`` 0) publishes; other ranks drain their pairs (their part of the gathers). The
    publisher is built at the first sync, once the table is known. A version that fails (a replica did not load it,
    the coordinator was unreachable) is logged and returned, not raised: training goes on, and the next sync sends a
    whole version. A stream that differs from the table raises ``ModelMismatchError``.
    """

    def __init__(
        self,
        source: StreamSource | None = None,
        *,
        rank: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source or StreamSource()
        self.rank = rank
        self.env = dict(os.environ if env is None else env)
        self.publisher: Publisher | None = None
        self.last: PublishReport | None = None

    def publish(self, pairs: Pairs, step: int) -> PublishReport | None:
        if self.rank != 0:
            drain(pairs)
            return None
        self.source.feed(pairs)
        if self.publisher is None:
            from weightsync_trainer.publisher import Publisher

            self.publisher = Publisher.from_env(self.source, {**self.env, "RANK": "0"})
        report = self.publisher.publish(step)
        if self.source.error:
            raise ModelMismatchError(self.source.error)
        assert report is not None
        self.last = report
        if report.state is VersionState.READY:
            log.info("step %d published as version %d in %.3fs", step, report.version, report.seconds["total"])
        else:
            log.warning("step %d: version %d is %s: %s", step, report.version, report.state.value, report.reason)
        return report

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
