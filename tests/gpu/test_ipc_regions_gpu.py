"""Regions over CUDA IPC where trainer ranks and workers share a GPU (``weightsync.channels.ipc_regions``).

The same seeded job as ``test_regions_gpu.py`` (``tests.integration.region_ranks.job``: 2 ranks holding
``Shard(0)`` shards, a TP=2 replica whose workers keep tensors column-, row-wise, fused, padded, as experts and
whole), with all four processes on GPU 0: every link is co-located (decided from the ends' GPU UUIDs,
``sharding.links.copied``), so each worker copies its regions out of the ranks' shards inside
``regions.receive``'s walk, straight into their boxes of its parameters (the walk's ``Places``, as the engine's
``Landing`` gives them; asserted per region) but for the whole tensors' and those the loader converts, which go
through buckets of 4 KiB. Two versions: the second written in place into the same shards after the first was
released, so its exports are reused, none made. The same with the workers on a second GPU (``workers-on-a-peer-gpu``):
each maps the ranks' shards into its own GPU and reads them by the copy engines (``peer_copies``).

Faults: a byte of a region changed in rank 1's shard after its digest was published (a real fault: the worker
reads the changed memory) fails the workers reading it, naming tensor and rank 1; rank 1 exiting after it
published its shards' placement but before its digest words fails both workers within their timeout, naming it
(CUDA refuses to map the handles of a process that exited: at once).

``test_nixl_links_read_the_ranks_gpu_shards_bit_exact``: the same job over NIXL (``nixl_regions``), the workers on
another GPU than the ranks where there are two, bit-exact over two versions; the changed region fails the same way.

``test_mixed_links_on_two_gpus`` is the issue's 2-GPU row: trainer ranks and workers on GPUs 0 and 1, the
co-located pairs by IPC and the crossing links over NCCL groups that hold no GPU twice, in the same version.
``test_the_products_ends_on_two_gpus`` runs the same layout through the product: the coordinator plans it from the
GPUs' real UUIDs (the co-located links copied, ``ReplicaPlan.copied``), each trainer rank sends with
``region_sends.send_to`` and each worker receives with ``sharded.walk`` (groups per rank and the IPC ends kept
across two versions, formed once); a trainer rank that exits before the second version fails both workers within
their timeouts, naming it, and each then refuses the same membership at once.

Run on the GPU host: ``bash tools/gpu-host.sh python3 -m pytest -m gpu -v tests/gpu/test_ipc_regions_gpu.py``.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import time
from typing import Any

import pytest
import torch

from tests.gpu.test_gpu_channels import _need_gpus, _run
from tests.gpu.test_regions_gpu import assert_landed

pytestmark = pytest.mark.gpu
RANKS, WORKERS = 2, 2
BUCKET = 4096
TIMEOUT_S = 5.0


def _store(idx: int, port: int) -> Any:
    from weightsync.channels import wire
    from weightsync.channels.base import Endpoint
    from weightsync.vocabulary import Channel

    if idx == 0:
        return wire.serve_store("127.0.0.1", port, 60.0)
    return wire.join_store(Endpoint("127.0.0.1", port), 30.0, 60.0, Channel.IPC)


def _placed(idx: int, gpu_index: int, port: int) -> tuple[Any, ...]:
    """Process ``idx`` (ranks, then workers) on GPU ``gpu_index``: its device, the job's store, the seeded job (its
    tensors on the device) and the links whose two ends share a GPU, from the UUIDs every process posted."""
    from tests.integration.region_ranks import job
    from weightsync.channels import gpu
    from weightsync.sharding import links

    device = torch.device("cuda", gpu_index)
    torch.cuda.set_device(device)
    store = _store(idx, port)
    trainer, result, members, full = job(24, RANKS)
    replica = result.replica("tp2")
    role = f"rank{idx}" if idx < RANKS else f"worker{idx - RANKS}"
    store.set(f"gpu/{role}", gpu.uuid(device))
    store.wait([f"gpu/rank{r}" for r in range(RANKS)] + [f"gpu/worker{w}" for w in range(WORKERS)])
    near = links.copied(
        replica.regions,
        {r: store.get(f"gpu/rank{r}").decode() for r in range(RANKS)},
        {w: store.get(f"gpu/worker{w}").decode() for w in range(WORKERS)},
    )
    return device, store, trainer, members, replica, [t.to(device) for t in full], near


class _Landed:
    """A worker's parameters (zeros) and whole tensors, and the ``regions.Places`` over them as the engine's
    ``Landing`` gives them: an IPC link copies each region straight into its box of its parameter; every other
    piece is written where the layout says (whole tensors apart, for the loader)."""

    def __init__(self, layout: Any, table: Any, device: torch.device) -> None:
        from weightsync.channels.wire import TORCH_DTYPES

        self.table, self.device = table, device
        self.params = [torch.zeros(s.shape, dtype=TORCH_DTYPES[s.dtype], device=device) for s in layout.params]
        self.wholes: dict[int, Any] = {}
        self.placed = 0

    def place(self, fill: Any) -> Any:
        from tests.integration.region_ranks import _slices
        from weightsync.channels.wire import TORCH_DTYPES
        from weightsync.sharding.fills import WHOLE

        if fill.param == WHOLE or self.params[fill.param].dtype != TORCH_DTYPES[self.table.tensors[fill.tensor].dtype]:
            return None  # the loader converts it: a piece
        return self.params[fill.param][_slices(fill.dest)].view(fill.source.lengths)

    def landed(self, fill: Any) -> None:
        self.placed += 1

    def land(self, pieces: Any) -> None:
        from tests.integration.region_ranks import _slices
        from weightsync.sharding.fills import WHOLE

        for fill, data in pieces:
            if fill.param == WHOLE:
                spec = self.table.tensors[fill.tensor]
                target = self.wholes.setdefault(
                    fill.tensor, torch.zeros(spec.shape, dtype=data.dtype, device=self.device)
                )
            else:
                target = self.params[fill.param]
            target[_slices(fill.dest)] = data.reshape(fill.dest.lengths)


def _land(
    layout: Any, table: Any, walk: Any, device: torch.device, out: dict[str, Any], v: int = 1
) -> tuple[list[Any], dict[int, Any]]:
    """Land ``walk(places=...)``'s pieces, the places being the worker's parameters; ``out[placed<v>]``: how many
    regions a link copied straight into them."""
    landed = _Landed(layout, table, device)
    landed.land(walk(places=landed))
    out[f"placed{v}"] = landed.placed
    return landed.params, landed.wholes


def _placeable(regions: Any, copied: Any) -> list[int]:
    """Per worker, the regions of its ``copied`` links that land in a parameter box of their own dtype (not whole,
    not converted by the loader): what a direct link copies straight into its place."""
    from tests.integration.region_ranks import job
    from weightsync.sharding.fills import WHOLE

    trainer, _, members, _ = job(24, RANKS)
    workers = next(m.layout for m in members if m.replica_id == "tp2").workers
    return [
        sum(
            r.param != WHOLE
            and (r.rank, w) in copied
            and workers[w].params[r.param].dtype == trainer.table.tensors[r.tensor].dtype
            for r in regions
            if r.worker == w
        )
        for w in range(WORKERS)
    ]


def _wrong(layout: Any, table: Any, full: list[Any], params: list[Any], wholes: dict[int, Any]) -> list[str]:
    """Parameters (and whole tensors) that differ from the full tensors where the layout says."""
    from tests.integration.region_ranks import _slices
    from weightsync.sharding.fills import WHOLE

    expected = [torch.zeros_like(p) for p in params]
    wrong = []
    for f in layout.fills:
        if f.param == WHOLE:
            if not torch.equal(wholes.get(f.tensor, torch.empty(0, device=params[0].device)), full[f.tensor]):
                wrong.append(table.tensors[f.tensor].name)
        else:
            expected[f.param][_slices(f.dest)] = full[f.tensor][_slices(f.source)].reshape(f.dest.lengths)
    return wrong + [
        s.name for s, got, want in zip(layout.params, params, expected, strict=True) if not torch.equal(got, want)
    ]


def _colocated(idx: int, plans: Any, port: int, fault: str, transport: str = "ipc") -> dict[str, Any]:
    """The ranks' regions to the workers over ``transport``: ``ipc`` all on GPU 0; ``peer`` (CUDA IPC too) and
    ``nixl`` the workers on the last GPU (the ranks on GPU 0), each reading its regions out of the ranks' shards
    (``peer``: mapped into its own GPU, read by the copy engines, ``peer_copies``)."""
    from tests.integration.region_ranks import _slices
    from weightsync.channels import ipc_regions, nixl_regions, regions

    module: Any = nixl_regions if transport == "nixl" else ipc_regions
    on = 0 if transport == "ipc" or idx < RANKS else torch.cuda.device_count() - 1
    device, store, trainer, members, replica, full, near = _placed(idx, on, port)
    table = trainer.table
    out: dict[str, Any] = {"near": sorted(near)}
    versions = (1, 2) if fault == "" else (1,)
    if idx < RANKS:
        rank = idx
        local = [
            None if (b := trainer.shard(t, rank)) is None else full[t][_slices(b)].clone() for t in range(len(full))
        ]
        mine = [r for r in replica.regions if r.rank == rank]
        exporter = module.Exporter(store, rank, timeout_s=30.0)
        for v in versions:
            if v == 2:  # in place, as an optimizer step writes: the same storages, so no new export
                for t in local:
                    if t is not None:
                        t.mul_(2)
            exporter.publish(v, trainer, local)
            if fault == "die" and rank == 1:
                os._exit(3)  # placed, the workers copy from it, but never its words: they wait for them
            tally = regions.send(None, trainer, rank, local, mine, links={w: exporter.link(w) for w in range(WORKERS)})
            if fault == "corrupt" and rank == 1:  # after the digests went out: the workers read changed bytes
                first = next(r for r in mine if r.worker == 0)
                cut = regions._cut(trainer, rank, local, first)
                cut[(0,) * cut.dim()] += 1
                torch.cuda.synchronize(device)
                out["corrupted"] = [table.tensors[first.tensor].name, str(first.source)]
                store.set("corrupted", "1")
            exporter.release()
            out[f"digests{v}"], out[f"nbytes{v}"] = tally.digests, tally.nbytes
            if transport != "nixl":
                out[f"exported{v}"] = exporter.exported
        store.set(f"end/rank{rank}", "1")
        if rank == 0:  # the store lives in this process: keep it until the others are done with it (a rank's
            # release deletes its keys there after the workers ended)
            ranks = range(1, RANKS) if fault != "die" else ()  # rank 1 exits in "die"
            ends = [f"end/worker{w}" for w in range(WORKERS)] + [f"end/rank{r}" for r in ranks]
            store.wait(ends, datetime.timedelta(seconds=60))
        return out
    worker = idx - RANKS
    layout = members[0].layout.workers[worker]
    importer = module.Importer(store, worker, device, timeout_s=TIMEOUT_S)
    if fault == "corrupt":
        store.wait(["corrupted"])
    try:
        for v in versions:
            want = full if v == 1 else [t * 2 for t in full]
            tally = regions.Tally()
            start = time.monotonic()

            pieces = functools.partial(
                regions.receive, None, RANKS, worker, table, replica.regions, tally, device=device, bucket=BUCKET,
                links={r: importer.link(v, r, table) for r in range(RANKS)},
            )  # fmt: skip
            try:
                params, wholes = _land(layout, table, pieces, device, out, v)
            except Exception as e:  # noqa: BLE001 - the parent asserts on the message
                out.update(error_type=type(e).__name__, raised=str(e), elapsed=time.monotonic() - start)
                break
            torch.cuda.synchronize(device)
            out[f"wrong{v}"] = _wrong(layout, table, want, params, wholes)
            out[f"digests{v}"], out[f"nbytes{v}"] = tally.digests, tally.nbytes
        out["needed"] = layout.bytes_needed(table)
    finally:
        store.set(f"end/worker{worker}", "1")
    return out


TRANSPORTS = pytest.mark.parametrize("transport", ["ipc", "peer"], ids=["one-gpu", "workers-on-a-peer-gpu"])
"""CUDA IPC with the ranks and the workers on one GPU (a kernel's copies), or the workers on another GPU that maps
the ranks' shards (the copy engines' reads across NVLink or PCIe)."""


@TRANSPORTS
def test_colocated_links_copy_regions_bit_exact_and_each_worker_gets_only_its_own(transport: str) -> None:
    _need_gpus(1 if transport == "ipc" else 2)
    from tests.integration.region_ranks import job

    got = _run(_colocated, RANKS + WORKERS, 29631, "", transport)
    assert [g.get("error") for g in got] == [None] * (RANKS + WORKERS), got
    assert all("raised" not in g for g in got), got
    _, result, _, _ = job(24, RANKS)
    replica = result.replica("tp2")
    every = sorted({(r.rank, r.worker) for r in replica.regions})
    if transport == "ipc":  # one GPU: every link co-located
        assert all(g["near"] == [list(link) for link in every] for g in got[RANKS:])
    for v in ("1", "2"):
        assert_landed(got, replica, v)
        # every region but the whole tensors' was copied straight into its parameter, none through a bucket
        assert [g[f"placed{v}"] for g in got[RANKS:]] == _placeable(replica.regions, every), got
    assert got[0]["digests1"] != got[0]["digests2"]
    for r in range(RANKS):  # one export per storage, none when the second version is written in place
        assert got[r]["exported1"] > 0 and got[r]["exported2"] == got[r]["exported1"], got[r]


@TRANSPORTS
def test_a_region_changed_in_the_ranks_memory_fails_naming_tensor_and_rank(transport: str) -> None:
    _need_gpus(1 if transport == "ipc" else 2)
    got = _run(_colocated, RANKS + WORKERS, 29632, "corrupt", transport)
    assert [g.get("error") for g in got] == [None] * (RANKS + WORKERS), got
    name, box = got[1]["corrupted"]
    failed = got[RANKS]  # worker 0 reads the changed region; worker 1 may or may not
    assert failed.get("error_type") == "IntegrityError", failed
    assert f"region {box} of tensor {name!r} from trainer rank 1" in failed["raised"], failed
    assert "worker 0" in failed["raised"], failed


@TRANSPORTS
def test_a_rank_that_exits_before_sharing_fails_the_workers_within_the_timeout(transport: str) -> None:
    _need_gpus(1 if transport == "ipc" else 2)
    got = _run(_colocated, RANKS + WORKERS, 29633, "die", transport)
    assert [g["rank"] for g in got] == [0, 2, 3], got  # rank 1 exited
    assert [g.get("error") for g in got] == [None] * 3, got
    for g in got[1:]:
        # mapping a dead rank's memory fails at once; a rank whose memory was mapped before it died leaves the wait
        # for its words to time out
        assert g.get("error_type") in ("RetryableError", "TransferTimeoutError"), g
        assert "trainer rank 1's" in g["raised"] and " v1" in g["raised"], g
        assert g["elapsed"] < TIMEOUT_S + 5.0, g


def test_a_bucket_can_be_a_block_a_queued_kernel_still_writes_so_nixl_reads_wait_for_it() -> None:
    """NIXL's READs land outside the stream's order. A bucket from the caching allocator can be a block freed while a
    kernel queued on the stream still writes it, which would then overwrite the bytes that landed (a region of the
    NIXL test below arrived as zeros about once in ten runs): the NIXL reader posts a READ only once the kernels
    queued before it ran (``nixl_regions.landing_ready``)."""
    _need_gpus(1)
    from weightsync.channels.nixl_regions import landing_ready

    device, n = torch.device("cuda", 0), 1 << 22
    torch.cuda.set_device(device)
    stream = torch.cuda.current_stream(device)
    # a free segment in the pool and the kernel loaded: a cudaMalloc or a kernel's first (lazy) load below would wait
    # for the device, ending the sleep
    torch.empty(2, n, dtype=torch.uint8, device=device).add_(1)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(2_000_000_000)  # the stream busy for about a second
    doomed = torch.empty(n, dtype=torch.uint8, device=device)
    doomed.add_(1)  # a kernel queued behind the sleep: it writes after the free below
    freed = doomed.data_ptr()
    del doomed
    bucket = torch.empty(n, dtype=torch.uint8, device=device)
    assert bucket.data_ptr() == freed  # the hazard: handed out again at once, under the queued kernel
    assert not stream.query(), "the sleep ended before the test did (its premise)"
    landing_ready(device)
    assert stream.query()  # a READ posted now lands after that kernel wrote


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not importable (carry .whl/nixl)")
@pytest.mark.parametrize("fault", ["", "corrupt"], ids=["two-versions", "corrupt"])
def test_nixl_links_read_the_ranks_gpu_shards_bit_exact(fault: str) -> None:
    """The same job over NIXL (``nixl_regions``): the ranks on GPU 0, the workers on the last GPU, every region
    read by the worker out of the rank's registered GPU memory (UCX picks NVLink or CUDA IPC); a region changed in
    rank 1's shard after its digest went out fails worker 0 naming tensor and rank."""
    _need_gpus(1)
    from tests.integration.region_ranks import job

    got = _run(_colocated, RANKS + WORKERS, 29637 if fault else 29638, fault, "nixl")
    assert [g.get("error") for g in got] == [None] * (RANKS + WORKERS), got
    if fault:
        name, box = got[1]["corrupted"]
        assert got[RANKS].get("error_type") == "IntegrityError", got[RANKS]
        assert f"region {box} of tensor {name!r} from trainer rank 1" in got[RANKS]["raised"], got[RANKS]
        return
    # what each process raised, and which versions it got through (a worker's digests<v> once v landed)
    assert all("raised" not in g for g in got), [(g.get("error_type"), g.get("raised"), sorted(g)) for g in got]
    replica = job(24, RANKS)[1].replica("tp2")
    for v in ("1", "2"):
        assert_landed(got, replica, v)
        assert [g[f"placed{v}"] for g in got[RANKS:]] == [0] * WORKERS  # NIXL reads into the walk's buckets only


def _mixed(idx: int, plans: Any, port: int) -> dict[str, Any]:
    """Trainer rank i and worker i on GPU i: (i, i) by IPC, the crossing links over a 2-rank NCCL group each
    (NCCL refuses two ranks of one communicator on one GPU, so no group holds a GPU twice)."""
    import torch.distributed as dist

    from tests.integration.region_ranks import _slices
    from weightsync.channels import ipc_regions, regions

    device, store, trainer, members, replica, full, near = _placed(idx, idx % RANKS, port)  # ranks 0, 1; workers 0, 1
    table = trainer.table
    far = sorted({(r.rank, r.worker) for r in replica.regions} - near)

    def pair(rank: int, worker: int) -> Any:  # group rank 0: the trainer rank, 1: the worker
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=60)
        me = 0 if idx == rank else 1
        return dist.ProcessGroupNCCL(dist.PrefixStore(f"pair{rank}-{worker}", store), me, 2, opts)

    out: dict[str, Any] = {"near": sorted(near), "far": far}
    if idx < RANKS:
        rank = idx
        local = [
            None if (b := trainer.shard(t, rank)) is None else full[t][_slices(b)].clone() for t in range(len(full))
        ]
        exporter = ipc_regions.Exporter(store, rank, timeout_s=30.0)
        exporter.publish(1, trainer, local)
        route: dict[int, Any] = {w: exporter.link(w) for r, w in near if r == rank}
        route |= {w: regions.Wire(pair(rank, w), 1) for r, w in far if r == rank}
        mine = [r for r in replica.regions if r.rank == rank]
        tally = regions.send(None, trainer, rank, local, mine, links=route)
        exporter.release()
        torch.cuda.synchronize(device)
        out.update(digests=tally.digests, nbytes=tally.nbytes)
        if rank == 0:
            store.wait([f"end/worker{w}" for w in range(WORKERS)], datetime.timedelta(seconds=60))
        return out
    worker = idx - RANKS
    layout = members[0].layout.workers[worker]
    importer = ipc_regions.Importer(store, worker, device, timeout_s=30.0)
    route = {r: importer.link(1, r, table) for r, w in near if w == worker}
    route |= {r: regions.Wire(pair(r, worker), 0) for r, w in far if w == worker}
    tally = regions.Tally()
    try:
        params, wholes = _land(
            layout, table,
            functools.partial(regions.receive, None, RANKS, worker, table, replica.regions, tally, device, links=route),
            device, out,
        )  # fmt: skip
        torch.cuda.synchronize(device)
        out.update(
            wrong=_wrong(layout, table, full, params, wholes), digests=tally.digests, nbytes=tally.nbytes,
            needed=layout.bytes_needed(table),
        )  # fmt: skip
    finally:
        store.set(f"end/worker{worker}", "1")
    return out


def test_mixed_links_on_two_gpus() -> None:
    _need_gpus(2)
    from tests.integration.region_ranks import job

    got = _run(_mixed, RANKS + WORKERS, 29634)
    assert [g.get("error") for g in got] == [None] * (RANKS + WORKERS), got
    _, result, _, _ = job(24, RANKS)
    replica = result.replica("tp2")
    assert got[0]["near"] == [[0, 0], [1, 1]] and got[0]["far"] == [[0, 1], [1, 0]], got[0]
    assert_landed(got, replica)
    assert [g["placed1"] for g in got[RANKS:]] == _placeable(replica.regions, [(0, 0), (1, 1)]), got


def _product_plan(
    port: int, uuids: tuple[str, str], nixl: bool = False, peers: tuple[str, ...] = ()
) -> tuple[Any, Any]:
    """What the coordinator plans for the tp2 replica on the trainer ranks' two GPUs, for versions 1 and 2: each
    version's ``Target`` (the ranks') and ``sharded.Order`` (the workers'). ``nixl``: the replica planned on NIXL
    instead (its rendezvous on that channel, nothing copied: every link read, ``versions._Planned.parts``);
    ``peers``: the GPUs the replica reports every worker reads (``Capabilities.peer_gpu_uuids``)."""
    import dataclasses

    from tests.integration.region_ranks import colocated_targets, job
    from weightsync.vocabulary import Channel
    from weightsync_inference import sharded

    trainer, _, members, _ = job(24, RANKS)
    engine = next(m.layout for m in members if m.replica_id == "tp2")
    targets, orders = [], []
    for v, t in enumerate(colocated_targets(port, trainer, engine, uuids, uuids, versions=2, peers=peers), 1):
        rdv = dataclasses.replace(t.rendezvous, timeout_s=TIMEOUT_S, join_timeout_s=10.0)
        if nixl:
            rdv = dataclasses.replace(rdv, channel=Channel.NIXL)
        t = dataclasses.replace(t, rendezvous=rdv, copied=frozenset() if nixl else t.copied)
        targets.append(t)
        orders.append(sharded.Order(v, rdv, t.regions, t.copied))
    return targets, orders


def _product(idx: int, plans: Any, port: int, targets: Any, orders: Any, die: int) -> dict[str, Any]:
    """Process ``idx`` (ranks 0, 1, then workers 0, 1; rank i and worker i on GPU i) through the product's ends."""
    import faulthandler

    from tests.integration.region_ranks import _slices, job
    from weightsync.channels import region_groups, regions, wire
    from weightsync.channels.base import Endpoint
    from weightsync.errors import WeightsyncError
    from weightsync.vocabulary import Channel
    from weightsync_inference import sharded
    from weightsync_trainer import region_sends

    device = torch.device("cuda", idx % RANKS)
    torch.cuda.set_device(device)
    served = wire.serve_store("127.0.0.1", port, 60.0) if idx == 0 else None  # as rank 0's NCCL sender serves it
    store = wire.join_store(Endpoint("127.0.0.1", port), 30.0, 60.0, Channel.NCCL)
    trainer, _, members, full = job(24, RANKS)
    table = trainer.table
    full = [t.to(device) for t in full]
    faulthandler.dump_traceback_later(100, exit=True)  # a hang shows where it is
    kept, out = region_groups.Kept(), {}

    def failed(e: Exception, t0: float) -> None:
        out.update(failed=str(e), after_s=time.monotonic() - t0)
        kept.close()  # as the product's ends do after a failed walk

    try:
        if idx < RANKS:
            rank = idx
            local = [
                None if (b := trainer.shard(t, rank)) is None else full[t][_slices(b)].clone() for t in range(len(full))
            ]
            for v, target in enumerate(targets, 1):
                if v == 2:
                    if rank == die:
                        os._exit(0)  # no goodbye: its group and its shards' exports go with it
                    for t in local:
                        if t is not None:
                            t.mul_(2)  # in place, as an optimizer step writes: the same exports
                t0 = time.monotonic()
                try:
                    tally = region_sends.send_to(kept, target, v, rank, trainer, local, device)
                except WeightsyncError as e:
                    failed(e, t0)
                    break
                torch.cuda.synchronize(device)
                out[f"digests{v}"], out[f"nbytes{v}"] = tally.digests, tally.nbytes
                out[f"formed{v}"] = [id(g) for g in kept.groups.values()]
                out[f"exported{v}"] = getattr(kept.reads, "exported", 0)  # CUDA IPC's count
            return out
        worker = idx - RANKS
        layout = next(m.layout for m in members if m.replica_id == "tp2").workers[worker]
        for v, order in enumerate(orders, 1):
            want = full if v == 1 else [t * 2 for t in full]
            tally = regions.Tally()
            t0 = time.monotonic()
            try:
                walk = functools.partial(sharded.walk, kept, order, worker, table, tally, device)
                params, wholes = _land(layout, table, walk, device, out, v)
            except WeightsyncError as e:
                failed(e, t0)
                t0 = time.monotonic()
                try:
                    sharded.walk(kept, order, worker, table, regions.Tally(), device)
                except WeightsyncError as again:
                    out.update(again=str(again), again_s=time.monotonic() - t0)
                break
            torch.cuda.synchronize(device)
            out[f"wrong{v}"] = _wrong(layout, table, want, params, wholes)
            out[f"digests{v}"], out[f"nbytes{v}"] = tally.digests, tally.nbytes
            out[f"formed{v}"] = [id(g) for g in kept.groups.values()]
        out["needed"] = layout.bytes_needed(table)
        return out
    finally:
        store.set(f"end/{idx}", "1")
        if served is not None:  # keep the store until every other process that lives is done with it
            alive = [i for i in range(RANKS + WORKERS) if i != die]
            store.wait([f"end/{i}" for i in alive], datetime.timedelta(seconds=90))


@pytest.mark.parametrize("peers", [False, True], ids=["crossing-over-nccl", "peers"])
@pytest.mark.parametrize("die", [-1, 1], ids=["two-versions", "rank-1-exits"])
def test_the_products_ends_on_two_gpus(die: int, peers: bool) -> None:
    """``peers``: the replica reports that every worker reads both GPUs (``gpu.peers``, as the agent reports it), so
    the crossing links are copied too (by the copy engines) and no group is formed; else they go over a group per
    trainer rank."""
    _need_gpus(2)
    from weightsync.channels import gpu

    uuids = (gpu.uuid(torch.device("cuda", 0)), gpu.uuid(torch.device("cuda", 1)))
    assert uuids[1] in gpu.peers(torch.device("cuda", 0)), "the two GPUs have no peer access (NVLink or PCIe P2P)"
    port = (29645 if peers else 29635) + max(die, 0)
    targets, orders = _product_plan(port, uuids, peers=uuids if peers else ())
    every = {(r.rank, r.worker) for r in targets[0].regions}
    assert targets[0].copied == (every if peers else {(0, 0), (1, 1)}), targets
    assert targets[0].rendezvous == targets[1].rendezvous, targets
    got = _run(_product, RANKS + WORKERS, port, targets, orders, die)
    assert [g.get("error") for g in got] == [None] * len(got), got
    if die < 0:
        for v in ("1", "2"):
            assert_landed(got, targets[0], v)
            assert [g[f"placed{v}"] for g in got[RANKS:]] == _placeable(targets[0].regions, targets[0].copied), got
        for g in got:  # one group per rank, one per worker (the rank across its GPU), kept: formed once; none
            assert len(g["formed1"]) == (0 if peers else 1) and g["formed1"] == g["formed2"], g  # every link copied
        for r in range(RANKS):  # the second version written in place: its exports reused, none made
            assert got[r]["exported1"] > 0 and got[r]["exported2"] == got[r]["exported1"], got[r]
        return
    assert [g["rank"] for g in got] == [0, 2, 3], got
    assert "digests2" in got[0], got[0]  # rank 0's links ended: its wire to worker 1 or its copies, and worker 0's
    # worker 0 from rank 1: over the wire (its timeout), or copied (the join deadline, then the timeout); worker 1
    # copies from rank 1
    for g, within in ((got[1], 10.0 + TIMEOUT_S if peers else TIMEOUT_S), (got[2], 10.0 + TIMEOUT_S)):
        assert "trainer rank 1" in g["failed"] and g["after_s"] < within + 5.0, g
        assert "failed here in an earlier version" in g["again"] and g["again_s"] < 1.0, g


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not importable (carry .whl/nixl)")
@pytest.mark.parametrize("die", [-1, 1], ids=["two-versions", "rank-1-exits"])
def test_the_products_nixl_ends_on_two_gpus(die: int) -> None:
    """The same replica planned on NIXL, through the product's ends (``region_sends.send_to``, ``sharded.walk``:
    ``nixl_regions`` formed from the plan's rendezvous): every link read by its worker, the co-located ones too; two
    versions bit-exact, no group formed; rank 1 exiting before the second fails both workers naming it, and the
    membership is not formed again under its name."""
    _need_gpus(2)
    from weightsync.channels import gpu

    uuids = (gpu.uuid(torch.device("cuda", 0)), gpu.uuid(torch.device("cuda", 1)))
    port = 29639 + max(die, 0)
    targets, orders = _product_plan(port, uuids, nixl=True)
    assert targets[0].copied == frozenset() and targets[0].rendezvous.channel.value == "nixl", targets
    got = _run(_product, RANKS + WORKERS, port, targets, orders, die)
    assert [g.get("error") for g in got] == [None] * len(got), got
    if die < 0:
        for v in ("1", "2"):
            assert_landed(got, targets[0], v)
        assert all(g["formed1"] == g["formed2"] == [] for g in got), got
        return
    assert [g["rank"] for g in got] == [0, 2, 3], got
    assert "digests2" in got[0], got[0]  # rank 0's links ended: both workers read theirs
    for g in got[1:]:  # each worker reads from rank 1 too: its placement never comes
        assert "trainer rank 1" in g["failed"] and g["after_s"] < 10.0 + TIMEOUT_S + 5.0, g
        assert "failed here in an earlier version" in g["again"] and g["again_s"] < 1.0, g
