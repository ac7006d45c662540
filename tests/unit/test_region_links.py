"""Which links are co-located (``sharding.links``), and the region walk taking each link from its own transport.

The CUDA IPC ends themselves (``channels.ipc_regions``) need a GPU: ``tests/gpu/test_ipc_regions_gpu.py``. Here the
walk (``regions.send`` / ``regions.receive`` with ``links``) runs on the CPU with stand-in co-located ends that
copy from the full tensors as the IPC ends copy from a rank's shard, beside a real gloo link in the same walk.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.integration.region_ranks import _slices, job
from weightsync.channels import digests, regions
from weightsync.errors import IntegrityError, PermanentError
from weightsync.sharding import links
from weightsync.sharding.boxes import Box
from weightsync.sharding.plans import Region

pytestmark = pytest.mark.unit
RANKS = 2


def _plan() -> list[Region]:
    b = Box((0,), (4,))
    return [Region(0, r, w, b, 0, b, 8) for r in (0, 1, 2) for w in (0, 1)]


def test_a_link_is_colocated_when_both_ends_report_one_gpu_uuid() -> None:
    ranks = {0: "GPU-a", 1: "GPU-b", 2: ""}
    workers = {0: "GPU-a", 1: "GPU-b"}
    assert links.colocated(_plan(), ranks, workers) == {(0, 0), (1, 1)}
    # an end without a UUID (a CPU end, or one that reported none) is co-located with nothing, not with another
    assert links.colocated(_plan(), {2: ""}, {0: "", 1: ""}) == frozenset()
    assert links.colocated(_plan(), {0: "MIG-x"}, {1: "MIG-x"}) == {(0, 1)}  # a MIG slice: its own UUID
    near, far = links.split(_plan(), frozenset({(0, 0), (1, 1)}))
    assert [(r.rank, r.worker) for r in near] == [(0, 0), (1, 1)]
    assert [(r.rank, r.worker) for r in far] == [(0, 1), (1, 0), (2, 0), (2, 1)]


class _Near:
    """A stand-in co-located end: copies from the full tensors (as IPC copies from the rank's shard) and hands
    the rank's words, ``flip`` corrupting the first byte of the ``flip``-th region it copies."""

    def __init__(self, full: list[torch.Tensor], rank: int, flip: int = -1) -> None:
        self.full, self.rank, self.flip, self.copied, self.released = full, rank, flip, 0, False

    def fill(self, regions: Sequence[Region], into: Sequence[torch.Tensor], words: torch.Tensor) -> None:
        cuts = [self.full[r.tensor][_slices(r.source)] for r in regions]
        words.copy_(digests.words(cuts))  # the rank's digest words, of its own bytes
        for view, cut in zip(into, cuts, strict=True):
            view.view(cut.dtype).view(cut.shape).copy_(cut)
            if self.copied == self.flip:
                view[0] ^= 0x10
            self.copied += 1

    def arrived(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def release(self) -> None:
        self.released = True


class _Shared:
    def __init__(self) -> None:
        self.regions: list[Region] = []

    def share(self, regions: Sequence[Region], cuts: Sequence[torch.Tensor]) -> list[int]:
        self.regions += regions
        return [int(w) for w in digests.words(list(cuts)).tolist()]


def _received(links_: dict[int, Any], worker: int = 0, pg: Any = None) -> tuple[list[str], regions.Tally]:
    trainer, result, _, full = job(24, RANKS)
    replica = result.replica("tp2")
    tally = regions.Tally()
    wrong = []
    for fill, data in regions.receive(
        pg, RANKS, worker, trainer.table, replica.regions, tally, bucket=4096, links=links_
    ):
        if not torch.equal(data, full[fill.tensor][_slices(fill.source)]):
            wrong.append(f"{fill.tensor} {fill.source}")
    return wrong, tally


def test_colocated_ends_fill_the_walks_buckets_and_every_region_is_checked() -> None:
    trainer, result, members, full = job(24, RANKS)
    replica = result.replica("tp2")
    ends = {r: _Near(full, r) for r in range(RANKS)}
    wrong, tally = _received(ends)  # type: ignore[arg-type]
    assert wrong == []
    assert tally.nbytes == members[0].layout.workers[0].bytes_needed(trainer.table)
    assert all(e.released for e in ends.values())
    # what the ranks' shared ends return combines, with the worker's, into the same digest as on the wire
    by_rank = {}
    for rank in range(RANKS):
        local = [None if (b := trainer.shard(t, rank)) is None else full[t][_slices(b)] for t in range(len(full))]
        mine = [r for r in replica.regions if r.rank == rank and r.worker == 0]
        shared = _Shared()
        by_rank[rank] = regions.send(None, trainer, rank, local, mine, links={0: shared}).digests
        assert shared.regions == mine
    mine = [r for r in replica.regions if r.worker == 0]
    assert regions.combine(mine, by_rank, regions.rank_of) == regions.combine(
        mine, {0: tally.digests}, regions.worker_of
    )


def test_a_region_changed_on_a_colocated_link_fails_naming_tensor_box_rank_and_worker_and_releases_every_link() -> None:
    trainer, result, _, full = job(24, RANKS)
    first = next(r for r in result.replica("tp2").regions if r.worker == 0 and r.rank == 1)
    ends = {0: _Near(full, 0), 1: _Near(full, 1, flip=0)}
    mine = [r for r in result.replica("tp2").regions if r.worker == 0]
    yielded, tally = [], regions.Tally()
    with pytest.raises(IntegrityError) as e:
        for piece in regions.receive(None, RANKS, 0, trainer.table, mine, tally, bucket=4096, links=ends):  # type: ignore[arg-type]
            yielded.append(piece)
    # every region was yielded (landed, in an engine) before the one check at the end failed the walk: the worker is
    # torn, as after any failure past its first landed byte; nothing was counted as received
    assert len(yielded) == len(mine) and tally.digests == [] and tally.nbytes == 0
    name = trainer.table.tensors[first.tensor].name
    assert f"worker 0: region {first.source} of tensor {name!r} from trainer rank 1 arrived with digest" in str(e.value)
    assert ends[0].released and ends[1].released  # the ranks may change their shards again


def test_a_rank_without_a_link_is_refused_naming_it() -> None:
    _, _, _, full = job(24, RANKS)
    with pytest.raises(PermanentError, match=r"no link given for trainer rank 1 \(links name \[0\]\)"):
        _received({0: _Near(full, 0)})  # type: ignore[dict-item]


def test_one_walk_takes_a_colocated_link_and_a_gloo_link_together() -> None:
    """Worker 0: rank 0 by the stand-in co-located end, rank 1 over a 2-rank gloo group (rank 1 is its rank 0),
    sent by a thread as a trainer rank sends: the bytes and the combined digests as if both came over the wire."""
    trainer, result, members, full = job(24, RANKS)
    replica = result.replica("tp2")
    store = dist.HashStore()

    def group(rank: int) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=30)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(store, rank, 2, opts)

    sent: dict[str, Any] = {}

    def rank1() -> None:
        pg = group(0)
        local = [None if (b := trainer.shard(t, 1)) is None else full[t][_slices(b)] for t in range(len(full))]
        mine = [r for r in replica.regions if r.rank == 1 and r.worker == 0]
        sent["tally"] = regions.send(None, trainer, 1, local, mine, bucket=4096, links={0: regions.Wire(pg, 1)})

    thread = threading.Thread(target=rank1)
    thread.start()
    pg = group(1)
    wrong, tally = _received({0: _Near(full, 0), 1: regions.Wire(pg, 0)})  # type: ignore[dict-item]
    thread.join(30)
    assert wrong == []
    assert tally.nbytes == members[0].layout.workers[0].bytes_needed(trainer.table)
    assert sent["tally"].nbytes == sum(r.nbytes for r in replica.regions if r.rank == 1 and r.worker == 0)
