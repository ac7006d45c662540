"""Which links are co-located (``sharding.links``), and the region walk taking each link from its own transport.

The CUDA IPC ends themselves (``channels.ipc_regions``) need a GPU: ``tests/gpu/test_ipc_regions_gpu.py``. Here the
walk (``regions.send`` / ``regions.receive`` with ``links``) runs on the CPU with stand-in co-located ends that
copy from the full tensors as the IPC ends copy from a rank's shard, beside a real gloo link in the same walk.
"""

from __future__ import annotations

import datetime
import gc
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.integration.region_ranks import _slices, job
from weightsync.channels import digests, regions
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import IntegrityError, PermanentError
from weightsync.sharding import links
from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import WHOLE, Fill
from weightsync.sharding.plans import Region

pytestmark = pytest.mark.unit
RANKS = 2


def _plan() -> list[Region]:
    b = Box((0,), (4,))
    return [Region(0, r, w, b, 0, b, 8) for r in (0, 1, 2) for w in (0, 1)]


def test_a_link_is_copied_when_both_ends_report_one_gpu_uuid_or_the_workers_reach_the_ranks_gpu() -> None:
    ranks = {0: "GPU-a", 1: "GPU-b", 2: ""}
    workers = {0: "GPU-a", 1: "GPU-b"}
    assert links.copied(_plan(), ranks, workers) == {(0, 0), (1, 1)}
    # an end without a UUID (a CPU end, or one that reported none) is co-located with nothing, not with another
    assert links.copied(_plan(), {2: ""}, {0: "", 1: ""}) == frozenset()
    assert links.copied(_plan(), {0: "MIG-x"}, {1: "MIG-x"}) == {(0, 1)}  # a MIG slice: its own UUID
    # the GPUs every worker reads directly: a rank on one is a link every worker copies; one without a UUID is not
    assert links.copied(_plan(), ranks, workers, ("GPU-a", "GPU-b")) == {(r, w) for r in (0, 1) for w in (0, 1)}
    assert links.copied(_plan(), {0: "GPU-c", 2: ""}, workers, ("GPU-c", "")) == {(0, 0), (0, 1)}
    near, far = links.split(_plan(), frozenset({(0, 0), (1, 1)}))
    assert [(r.rank, r.worker) for r in near] == [(0, 0), (1, 1)]
    assert [(r.rank, r.worker) for r in far] == [(0, 1), (1, 0), (2, 0), (2, 1)]


class _Near:
    """A stand-in co-located end: copies from the full tensors (as IPC copies from the rank's shard) and hands
    the rank's words, ``flip`` corrupting the first byte of the ``flip``-th region it copies."""

    def __init__(self, full: list[torch.Tensor], rank: int, flip: int = -1, direct: bool = False) -> None:
        self.full, self.rank, self.flip, self.copied, self.released = full, rank, flip, 0, False
        self.direct = direct  # copies into any memory (IPC does): the walk may hand it the regions' places

    def fill(self, regions: Sequence[Region], into: Sequence[torch.Tensor], words: torch.Tensor) -> None:
        cuts = [self.full[r.tensor][_slices(r.source)] for r in regions]
        words.copy_(digests.words(cuts))  # the rank's digest words, of its own bytes
        for view, cut in zip(into, cuts, strict=True):
            view.view(cut.dtype).view(cut.shape).copy_(cut)
            if self.copied == self.flip:
                view.view(torch.uint8).view(-1)[0] ^= 0x10
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


class _Places:
    """``regions.Places`` over a worker's parameters (zeros), as the engine's ``Landing`` gives them; whole tensors
    come as pieces."""

    def __init__(self, layout: Any, table: Any) -> None:
        self.table = table
        self.params = [torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in layout.params]
        self.placed: list[Fill] = []
        self.landed_: list[Fill] = []

    def place(self, fill: Fill) -> torch.Tensor | None:
        if fill.param == WHOLE or self.params[fill.param].dtype != TORCH_DTYPES[self.table.tensors[fill.tensor].dtype]:
            return None  # the loader converts it: a piece
        self.placed.append(fill)
        return self.params[fill.param][_slices(fill.dest)].view(fill.source.lengths)

    def landed(self, fill: Fill) -> None:
        self.landed_.append(fill)


def test_a_direct_link_copies_regions_into_their_places_and_digests_them_there() -> None:
    """Rank 0's link copies straight into worker 0's parameters (not yielded), rank 1's goes through buckets: the
    parameters equal the layout's boxes of the full tensors, and the digests combine as on the wire."""
    trainer, result, members, full = job(24, RANKS)
    replica = result.replica("tp2")
    layout = members[0].layout.workers[0]
    places = _Places(layout, trainer.table)
    ends = {0: _Near(full, 0, direct=True), 1: _Near(full, 1)}
    tally = regions.Tally()
    pieces = list(
        regions.receive(None, RANKS, 0, trainer.table, replica.regions, tally, bucket=4096, links=ends, places=places)  # type: ignore[arg-type]
    )
    mine = [r for r in replica.regions if r.worker == 0]
    own = [
        r for r in mine if r.param != WHOLE and layout.params[r.param].dtype == trainer.table.tensors[r.tensor].dtype
    ]
    boxed = [r for r in own if r.rank == 0]  # rank 0's that land as they came (others the loader converts)
    assert boxed and places.placed == places.landed_ == [Fill(r.tensor, r.source, r.param, r.dest) for r in boxed]
    assert len(pieces) == len(mine) - len(boxed)  # rank 1's regions, and rank 0's whole tensors' pieces
    for fill, data in pieces:
        if fill.param != WHOLE:
            places.params[fill.param][_slices(fill.dest)] = data.reshape(fill.dest.lengths)
    for f in layout.fills:
        if f.param != WHOLE:
            want = full[f.tensor][_slices(f.source)].reshape(f.dest.lengths).to(places.params[f.param].dtype)
            assert torch.equal(places.params[f.param][_slices(f.dest)], want), f
    by_rank = {}
    for rank in range(RANKS):
        local = [None if (b := trainer.shard(t, rank)) is None else full[t][_slices(b)] for t in range(len(full))]
        sends = [r for r in replica.regions if r.rank == rank and r.worker == 0]
        by_rank[rank] = regions.send(None, trainer, rank, local, sends, links={0: _Shared()}).digests
    assert regions.combine(mine, by_rank, regions.rank_of) == regions.combine(
        mine, {0: tally.digests}, regions.worker_of
    )
    assert tally.nbytes == layout.bytes_needed(trainer.table)


def test_a_region_changed_on_its_way_into_its_place_fails_naming_it() -> None:
    trainer, result, members, full = job(24, RANKS)
    mine = [r for r in result.replica("tp2").regions if r.worker == 0]
    places = _Places(members[0].layout.workers[0], trainer.table)
    rank0 = [r for r in mine if r.rank == 0]
    k = next(i for i, r in enumerate(rank0) if places.place(Fill(r.tensor, r.source, r.param, r.dest)) is not None)
    first, places.placed = rank0[k], []  # the first region that goes into its place: its copy is changed
    ends = {0: _Near(full, 0, flip=k, direct=True), 1: _Near(full, 1)}
    with pytest.raises(IntegrityError) as e:
        for _ in regions.receive(
            None, RANKS, 0, trainer.table, mine, regions.Tally(), bucket=4096, links=ends, places=places
        ):  # type: ignore[arg-type]
            pass
    name = trainer.table.tensors[first.tensor].name
    assert places.placed[0] == Fill(first.tensor, first.source, first.param, first.dest)
    assert f"worker 0: region {first.source} of tensor {name!r} from trainer rank 0 arrived with digest" in str(e.value)


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


def test_a_replica_reports_the_gpus_every_worker_reads_directly_its_own_or_a_peer() -> None:
    """``agent.capabilities``: a worker reads its own GPU and the peers it reported (``gpu.peers``); the replica
    reports the GPUs all of them read (a rank on one is a link each worker copies), none for a CPU engine."""
    from weightsync.vocabulary import Channel
    from weightsync_inference.agent import AgentConfig, capabilities
    from weightsync_inference.receipts import Identity

    config = AgentConfig("job", "r", (Channel.IPC, Channel.NCCL), "n", nccl_domain="d")
    pair = [
        Identity(0, 2, "cuda:0", "GPU-a", peers=("GPU-b", "GPU-c")),
        Identity(1, 2, "cuda:1", "GPU-b", peers=("GPU-a",)),
    ]
    assert capabilities(config, pair).peer_gpu_uuids == ("GPU-a", "GPU-b")  # GPU-c: not worker 1's peer
    assert capabilities(config, [Identity(0, 1, "cuda:0", "GPU-a")]).peer_gpu_uuids == ("GPU-a",)
    assert capabilities(config, [Identity(0, 1, "cpu")]).peer_gpu_uuids == ()
    assert Identity.from_dict(pair[0].to_dict()) == pair[0]


def test_the_walk_and_the_sends_run_with_the_collector_off_and_turn_it_back_on() -> None:
    trainer, result, members, full = job(24, RANKS)
    replica = result.replica("tp2")
    seen: list[bool] = []

    class Watched(_Places):
        def place(self, fill: Fill) -> torch.Tensor | None:
            seen.append(gc.isenabled())
            return super().place(fill)

    class Sharing(_Shared):
        def share(self, regions: Sequence[Region], cuts: Sequence[torch.Tensor]) -> list[int]:
            seen.append(gc.isenabled())
            return super().share(regions, cuts)

    places = Watched(members[0].layout.workers[0], trainer.table)
    ends = {0: _Near(full, 0, direct=True), 1: _Near(full, 1)}
    was = gc.isenabled()
    gc.enable()
    try:
        walk = regions.receive(
            None, RANKS, 0, trainer.table, replica.regions, regions.Tally(), bucket=4096, links=ends, places=places
        )  # type: ignore[arg-type]
        next(walk)
        assert gc.isenabled()  # the consumer's code between pieces runs as the application's
        assert len(list(walk)) > 0 and gc.isenabled()
        local = [None if (b := trainer.shard(t, 0)) is None else full[t][_slices(b)] for t in range(len(full))]
        sends = [r for r in replica.regions if r.rank == 0 and r.worker == 0]
        regions.send(None, trainer, 0, local, sends, links={0: Sharing()})
        assert seen and not any(seen) and gc.isenabled()
        left = {0: _Near(full, 0, direct=True), 1: _Near(full, 1)}
        dropped = regions.receive(
            None, RANKS, 0, trainer.table, replica.regions, regions.Tally(), bucket=4096, links=left, places=places
        )  # type: ignore[arg-type]
        next(dropped)
        assert gc.isenabled()  # a walk left unfinished does not keep it off
        dropped.close()
        assert left[0].released and left[1].released  # closing it still releases its links
    finally:
        (gc.enable if was else gc.disable)()


def test_a_ranks_cuts_are_kept_while_its_shards_stay_in_the_same_memory_and_read_what_they_hold_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer, result, _, full = job(24, RANKS)
    replica = result.replica("tp2")
    made: list[Region] = []
    cut = regions._cut

    def counted(layout: Any, rank: int, local: Any, r: Region) -> torch.Tensor:
        made.append(r)
        return cut(layout, rank, local, r)

    monkeypatch.setattr(regions, "_cut", counted)
    rank, cuts = 0, regions.Cuts()
    local = [None if (b := trainer.shard(t, rank)) is None else full[t][_slices(b)].clone() for t in range(len(full))]
    mine = [r for r in replica.regions if r.rank == rank and r.worker == 0]

    def sent(shards: list[torch.Tensor | None]) -> list[str]:
        return regions.send(None, trainer, rank, shards, mine, links={0: _Shared()}, cuts=cuts).digests

    first = sent(local)
    assert len(made) == len(mine)
    made.clear()
    assert sent(local) == first and made == []  # the same shards: no region cut again
    # a training step writes the shards in place: the kept views read the new values
    with torch.no_grad():
        for t in local:
            if t is not None:
                t.add_(1)
    stepped = sent(local)
    assert made == [] and stepped != first
    assert stepped == regions.send(None, trainer, rank, local, mine, links={0: _Shared()}).digests  # as cut anew
    # shards in new memory (a reallocation): cut again from them
    moved = [None if t is None else t.clone() for t in local]
    made.clear()
    assert sent(moved) == stepped and len(made) == len(mine)
