"""The product's region groups over real NCCL (``weightsync.channels.region_groups``): what a trainer rank and a
worker form from the rendezvous the coordinator plans for a replica taking regions over NCCL.

A 1-rank trainer on GPU 0 and the TP=1 replica of the seeded job (``tests.integration.region_ranks.job``) on GPU 1:
the test serves the channel's store (as rank 0's ``NcclSender`` does), both join the group through
``region_groups.member`` (its own communicator on the member's GPU, under the rendezvous's secret prefix) and walk
the plan with the group's bounded waits, in buckets of 4 KiB (many rounds, each one grouped launch): the worker's
regions land bit-exact, it receives exactly its layout's bytes, and both sides' digests combine alike.

Both ends keep the group (``region_groups.Kept``) and walk a second version over it, formed once.

The faults: one end exits once the group formed, before the walk (no error, no goodbye). The other end's walk
must fail within the group's timeout, naming the other end (its NCCL calls never complete: NCCL's own wait returns
at once and the host sync after it would block until torch's watchdog; the bounded wait aborts the communicator),
and that end then refuses to form the same group again (a group is formed once per name). The store is served by
the test (as trainer rank 0's process serves it, which outlives a rank that dies and a worker that dies alike).

Run on the GPU host (2 GPUs):
``bash tools/gpu-host.sh python3 -m pytest -m gpu -v tests/gpu/test_region_groups_gpu.py``.
"""

from __future__ import annotations

import faulthandler
import os
import time
from typing import Any

import pytest
import torch

from tests.gpu.test_gpu_channels import _need_gpus, _run

pytestmark = pytest.mark.gpu
TIMEOUT_S = 5.0
BUCKET = 4096


def _rendezvous(port: int) -> Any:
    from weightsync.channels.base import Endpoint, Rendezvous
    from weightsync.vocabulary import Channel

    return Rendezvous(
        Channel.NCCL, Endpoint("127.0.0.1", port), group="nccl-regions-r-1-regions-v1", secret="5e" * 16,
        generation=1, rank=1, world_size=2, timeout_s=TIMEOUT_S, join_timeout_s=60.0,
    )  # fmt: skip


def _member(idx: int, plans: Any, port: int, die: int) -> dict[str, Any]:
    from tests.integration.region_ranks import _slices, job
    from weightsync.channels import region_groups, regions
    from weightsync.errors import TransferTimeoutError

    device = torch.device("cuda", idx)
    torch.cuda.set_device(device)
    trainer, result, members, full = job(24, 1)
    full = [t.to(device) for t in full]
    replica = result.replica("tp1")
    faulthandler.dump_traceback_later(60, exit=True)  # a hang shows where it is
    kept, out = region_groups.Kept(), {}
    for v in (1, 2) if die < 0 else (1,):  # the second version over the group the first formed
        t0 = time.monotonic()
        group = kept.get(_rendezvous(port), idx, device)
        out[f"got_s{v}"], out[f"group{v}"] = time.monotonic() - t0, id(group)
        assert isinstance(group, region_groups.NcclMember)
        bound = region_groups.bound(group)
        if idx == die:
            time.sleep(1.0)  # the other end has posted its first calls by now
            os._exit(0)
        t0 = time.monotonic()
        if idx == 0:
            local = [full[t][_slices(b)].clone() if (b := trainer.shard(t, 0)) else None for t in range(len(full))]
            try:
                tally = regions.send(group.pg, trainer, 0, local, list(replica.regions), bucket=BUCKET, bound=bound)
                out.update({f"digests{v}": tally.digests, f"nbytes{v}": tally.nbytes})
            except TransferTimeoutError as e:
                out.update(failed=str(e), after_s=time.monotonic() - t0)
                kept.close()  # as the product's ends do after a failed walk
                break
        else:
            layout = members[1].layout.workers[0]
            tally, wrong = regions.Tally(), []
            walk = regions.receive(
                group.pg, 1, 0, trainer.table, replica.regions, tally, device, bucket=BUCKET, bound=bound
            )
            try:
                for fill, data in walk:
                    if not torch.equal(data.reshape(-1), full[fill.tensor][_slices(fill.source)].reshape(-1)):
                        wrong.append(f"{trainer.table.tensors[fill.tensor].name} {fill.source}")
            except TransferTimeoutError as e:
                out.update(failed=str(e), after_s=time.monotonic() - t0)
                kept.close()
                break
            out.update({f"digests{v}": tally.digests, f"nbytes{v}": tally.nbytes, f"wrong{v}": wrong})
            out["needed"] = layout.bytes_needed(trainer.table)
    if die >= 0:  # a group that failed is formed once per name: the same name again fails at once
        try:
            kept.get(_rendezvous(port), idx, device)
        except TransferTimeoutError as e:
            out["again"] = str(e)
    kept.close()
    faulthandler.cancel_dump_traceback_later()
    return out


def _served(port: int, nprocs_die: int) -> list[dict[str, Any]]:
    """Both ends run, the store served here (trainer rank 0's process serves it in the product)."""
    from weightsync.channels import wire

    store = wire.serve_store("127.0.0.1", port, 60.0)
    try:
        return _run(_member, 2, port, nprocs_die)
    finally:
        del store


def test_a_region_group_over_nccl_lands_a_tp1_worker_bit_exact() -> None:
    _need_gpus(2)
    from tests.integration.region_ranks import job
    from weightsync.channels import regions

    rank, worker = _served(29641, -1)
    assert rank.get("error") is None and worker.get("error") is None, (rank, worker)
    replica = job(24, 1)[1].replica("tp1")
    for v in (1, 2):
        assert "failed" not in worker and worker[f"wrong{v}"] == [], worker
        assert worker[f"nbytes{v}"] == worker["needed"] == rank[f"nbytes{v}"] > 0, (rank, worker)
        assert regions.combine(replica.regions, {0: rank[f"digests{v}"]}, regions.rank_of) == regions.combine(
            replica.regions, {0: worker[f"digests{v}"]}, regions.worker_of
        )
    assert rank["group1"] == rank["group2"] and worker["group1"] == worker["group2"]  # kept, not formed again
    print(
        f"region group formed in {rank['got_s1']:.3f} s (rank), {worker['got_s1']:.3f} s (worker); "
        f"kept for the next version: {rank['got_s2'] * 1e3:.3f} ms, {worker['got_s2'] * 1e3:.3f} ms"
    )


@pytest.mark.parametrize(("die", "port"), [(0, 29642), (1, 29643)], ids=["rank-exits", "worker-exits"])
def test_an_end_that_exits_before_the_walk_fails_the_others_within_the_groups_timeout(die: int, port: int) -> None:
    _need_gpus(2)
    got = _served(port, die)
    (other,) = [g for g in got if g["rank"] != die]
    assert other.get("error") is None, other
    named = "from trainer rank 0" if die == 0 else "sends to worker 0"
    assert named in other.get("failed", ""), other
    assert other["after_s"] < TIMEOUT_S + 10, other
    assert "failed here in an earlier version" in other.get("again", ""), other
