"""Regions point to point: every trainer rank sends its own shards, every worker receives only its slice.

The sharded path's data path (``docs/sharded.md``). A transfer plan
(``weightsync.sharding.plans``) lists, in plan order, which trainer rank sends which
box of which tensor to which worker of a replica. Over one torch.distributed group per
replica (gloo for CPU fleets; the calls are point-to-point, which NCCL has too), whose
ranks are the trainer's ranks first (group rank = trainer rank) and then the replica's
workers (group rank = trainer world size + worker):

- ``send``: a trainer rank sends its regions in plan order, each cut from its local
  shard (the region's box minus the shard's offsets: no gather), packed contiguous
  where the shard lives, then the region's digest word (``digests.word``, 8 bytes);
- ``receive``: a worker posts the receives of its regions in plan order (messages
  between two group ranks arrive in the order they were sent, so each rank's subset of
  the plan order pairs every message with its region), checks each region's word
  against its own digest of the bytes that arrived before yielding it, and yields the
  region as a ``(Fill, tensor)`` piece for ``weightsync_inference.landing``. A region
  whose bytes changed on the way fails naming tensor, box, sending rank and worker.

Both sides keep a few regions in flight (``window``) so packing and digests overlap the
wire, and return each region's digest in their order; ``combine`` puts a replica's
digests (all its workers', or all ranks') back in plan order into one digest, the
sender's and the engine's side alike. Every wait is bounded by the group's timeout
(gloo's point-to-point calls take the one the group was formed with): a rank that dies
mid-send makes its peers' receives fail at once or at that timeout.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.channels import digests
from weightsync.channels.wire import TORCH_DTYPES, as_bytes
from weightsync.errors import IntegrityError, ModelMismatchError, PermanentError, TransferTimeoutError
from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import Fill
from weightsync.sharding.plans import Region
from weightsync.sharding.shards import TrainerLayout
from weightsync.tensors import TensorTable

WINDOW = 8
"""Regions in flight per side: enough to keep the wire busy while the next one is packed or checked."""
_TAG = 24


@dataclass
class Tally:
    """What one side moved: each region's digest in its order, and bytes."""

    digests: list[str] = field(default_factory=list)
    nbytes: int = 0


def send(
    pg: Any,
    layout: TrainerLayout,
    rank: int,
    local: Sequence[torch.Tensor | None],
    regions: Sequence[Region],
    window: int = WINDOW,
) -> Tally:
    """Send trainer ``rank``'s ``regions`` (its ``sends``, in plan order, one replica's) from its local shards.

    ``local[i]`` is the rank's local shard of table tensor ``i`` (None where it holds none).
    """
    tally = Tally()
    in_flight: collections.deque[tuple[Region, list[Any], torch.Tensor, torch.Tensor]] = collections.deque()
    try:
        for r in regions:
            piece = _cut(layout, rank, local, r)
            word = digests.word(piece).reshape(1)
            dst = layout.world_size + r.worker
            works = [pg.send([as_bytes(piece)], dst, _TAG), pg.send([word], dst, _TAG)]
            in_flight.append((r, works, piece, word))  # the tensors live until their sends completed
            while len(in_flight) > window:
                _sent(in_flight.popleft(), tally)
        while in_flight:
            _sent(in_flight.popleft(), tally)
    except RuntimeError as e:
        raise TransferTimeoutError(
            f"trainer rank {rank}: sending its regions failed or exceeded the group's timeout ({e}); the version "
            "fails and the group must be rebuilt"
        ) from e
    return tally


def _cut(layout: TrainerLayout, rank: int, local: Sequence[torch.Tensor | None], r: Region) -> torch.Tensor:
    """The region from the rank's own shard, packed contiguous where the shard lives."""
    spec = layout.table.tensors[r.tensor]
    shard = layout.shard(r.tensor, rank)
    tensor = local[r.tensor] if r.tensor < len(local) else None
    if r.rank != rank or shard is None or shard.intersect(r.source) != r.source:
        raise PermanentError(
            f"trainer rank {rank} was given region {r.source} of tensor {spec.name!r} (planned for rank {r.rank}), "
            f"but holds {shard if shard is not None else 'none of it'}; the plan and the trainer's layout disagree"
        )
    if tensor is None or tuple(tensor.shape) != shard.lengths or tensor.dtype != TORCH_DTYPES[spec.dtype]:
        got = "nothing" if tensor is None else f"{list(tensor.shape)} of {tensor.dtype}"
        raise ModelMismatchError(
            f"trainer rank {rank}: its local shard of {spec.name!r} is {got}; its layout says box {shard} of "
            f"{spec.dtype}: the trainer's layout was read from other tensors than the ones it sends"
        )
    rel = Box(tuple(a - b for a, b in zip(r.source.offsets, shard.offsets, strict=True)), r.source.lengths)
    return tensor.detach()[_slices(rel)].contiguous()


def _sent(entry: tuple[Region, list[Any], torch.Tensor, torch.Tensor], tally: Tally) -> None:
    r, works, _, word = entry  # the piece only had to live until here
    for work in works:
        work.wait()
    tally.digests.append(_digest(r.nbytes, word))
    tally.nbytes += r.nbytes


def receive(
    pg: Any,
    trainers: int,
    worker: int,
    table: TensorTable,
    regions: Sequence[Region],
    tally: Tally,
    device: torch.device | str = "cpu",
    window: int = WINDOW,
) -> Iterator[tuple[Fill, torch.Tensor]]:
    """Receive ``worker``'s ``regions`` (its replica's, in plan order) from ``trainers`` trainer ranks; yield each
    as a ``(Fill, tensor)`` piece once its digest checked. ``tally`` gets each region's digest and bytes."""
    mine = [r for r in regions if r.worker == worker]
    posted: collections.deque[tuple[Region, list[Any], torch.Tensor, torch.Tensor]] = collections.deque()
    pending = iter(mine)

    def post() -> None:
        r = next(pending, None)
        if r is None:
            return
        buffer = torch.empty(r.nbytes, dtype=torch.uint8, device=device)
        word = torch.zeros(1, dtype=torch.int64, device=device)
        posted.append((r, [pg.recv([buffer], r.rank, _TAG), pg.recv([word], r.rank, _TAG)], buffer, word))

    for _ in range(window):
        post()
    while posted:
        r, works, buffer, word = posted.popleft()
        spec = table.tensors[r.tensor]
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            raise TransferTimeoutError(
                f"worker {worker}: region {r.source} of {spec.name!r} from trainer rank {r.rank} did not arrive "
                f"({e}); the version fails and the group must be rebuilt"
            ) from e
        post()
        sent, got = _digest(r.nbytes, word), digests.digest(buffer)
        if sent != got:
            raise IntegrityError(
                f"worker {worker}: region {r.source} of tensor {spec.name!r} from trainer rank {r.rank} arrived with "
                f"digest {got}, but the rank sent {sent}: its bytes changed on the way; the version fails"
            )
        tally.digests.append(got)
        tally.nbytes += r.nbytes
        data = buffer.view(TORCH_DTYPES[spec.dtype]).view(r.source.lengths)
        yield Fill(r.tensor, r.source, r.param, r.dest), data


def combine(regions: Sequence[Region], lists: Mapping[int, Sequence[str]], by: Callable[[Region], int]) -> str:
    """One digest over ``regions`` in plan order from per-side lists in each side's order: ``by`` is ``rank_of``
    for the senders' lists (by trainer rank), ``worker_of`` for the workers' (by worker)."""
    at: dict[int, int] = collections.Counter()
    h = hashlib.sha256()
    for r in regions:
        key = by(r)
        own = lists.get(key, ())
        if at[key] >= len(own):
            raise IntegrityError(f"side {key} reported {len(own)} region digests; the plan gives it more")
        h.update(f"{r.tensor}:{r.source}:{own[at[key]]}\n".encode())
        at[key] += 1
    extra = {k: len(v) - at[k] for k, v in lists.items() if len(v) > at[k]}
    if extra:
        raise IntegrityError(f"digests beyond the plan's regions (side: count): {extra}")
    return "sha256:" + h.hexdigest()


def rank_of(r: Region) -> int:
    return r.rank


def worker_of(r: Region) -> int:
    return r.worker


def _digest(nbytes: int, word: torch.Tensor) -> str:
    return f"{nbytes}:{int(word.item()) & ((1 << 64) - 1):016x}"


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


__all__ = ["Tally", "combine", "rank_of", "receive", "send", "worker_of"]
