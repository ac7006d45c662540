"""Regions point to point over NCCL on real GPUs: each trainer rank sends from its own shard on its GPU, each worker
of a TP=2 replica receives only its regions on its GPU, bit-exact, digests checked on the device.

The same seeded job as the CPU test (``tests.integration.region_ranks.job``: 2 ranks holding ``Shard(0)``
shards, a replica whose workers keep tensors column-, row-wise, fused, padded, as experts and whole), over one
NCCL group of 4 ranks: trainer ranks on GPUs 0 and 1, the workers on GPUs 2 and 3 (NCCL refuses two ranks of
one communicator on one GPU, so the issue's 2-GPU row, trainer and replica on the same two GPUs, copies the
co-located pairs over CUDA IPC: ``test_ipc_regions_gpu.py``).

Run on the GPU host (4 GPUs): ``bash tools/gpu-host.sh python3 -m pytest -m gpu -v tests/gpu/test_regions_gpu.py``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch

from tests.gpu.test_gpu_channels import _need_gpus, _run

pytestmark = pytest.mark.gpu
RANKS, WORKERS = 2, 2


def _member(rank: int, plans: Any, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.integration.region_ranks import _slices, job
    from weightsync.channels import digests, regions
    from weightsync.sharding.fills import WHOLE

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "nccl", rank=rank, world_size=RANKS + WORKERS, timeout=datetime.timedelta(seconds=120), device_id=device
    )
    trainer, result, members, full = job(24, RANKS)
    full = [t.to(device) for t in full]
    replica = result.replica("tp2")
    pg = dist.group.WORLD
    out: dict[str, Any] = {}
    if rank < RANKS:
        local = [
            None if (b := trainer.shard(t, rank)) is None else full[t][_slices(b)].clone() for t in range(len(full))
        ]
        tally = regions.send(pg, trainer, rank, local, [r for r in replica.regions if r.rank == rank])
        torch.cuda.synchronize(device)
        out.update(digests=tally.digests, nbytes=tally.nbytes)
    else:
        worker = rank - RANKS
        layout = members[0].layout.workers[worker]
        tally = regions.Tally()
        wrong = []
        for fill, data in regions.receive(pg, RANKS, worker, trainer.table, replica.regions, tally, device=device):
            assert data.device == device
            if not torch.equal(data.reshape(-1), full[fill.tensor][_slices(fill.source)].reshape(-1)):
                wrong.append(f"{trainer.table.tensors[fill.tensor].name} {fill.source}")
        torch.cuda.synchronize(device)
        whole = sum(1 for f in layout.fills if f.param == WHOLE)
        out.update(
            digests=tally.digests,
            nbytes=tally.nbytes,
            needed=layout.bytes_needed(trainer.table),
            wrong=wrong,
            whole=whole,
            check=digests.digest(full[0]),  # the digest kernels ran on this GPU
        )
    dist.destroy_process_group()
    return out


def test_regions_over_nccl_land_bit_exact_and_each_worker_gets_only_its_own() -> None:
    _need_gpus(RANKS + WORKERS)
    from tests.integration.region_ranks import job

    got = _run(_member, RANKS + WORKERS, 29612)
    assert [g.get("error") for g in got] == [None] * (RANKS + WORKERS), got
    _, result, _, _ = job(24, RANKS)
    assert_landed(got, result.replica("tp2"))


def assert_landed(got: list[dict[str, Any]], replica: Any, version: str = "") -> None:
    """Each worker (after the ranks in ``got``) landed its regions of ``version`` bit-exact and received exactly the
    bytes its layout needs; the ranks' and the workers' digests combine alike, and their byte counts agree."""
    from weightsync.channels import regions

    for g in got[RANKS:]:
        assert g[f"wrong{version}"] == [] and g[f"nbytes{version}"] == g["needed"] > 0, g
    by_rank = {r: got[r][f"digests{version}"] for r in range(RANKS)}
    by_worker = {w: got[RANKS + w][f"digests{version}"] for w in range(WORKERS)}
    assert regions.combine(replica.regions, by_rank, regions.rank_of) == regions.combine(
        replica.regions, by_worker, regions.worker_of
    )
    assert sum(got[r][f"nbytes{version}"] for r in range(RANKS)) == sum(g[f"nbytes{version}"] for g in got[RANKS:])
