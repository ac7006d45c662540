"""A region group kept across versions (``region_groups.Kept``), over real gloo groups on a real store.

Two ends (a trainer rank and a worker, threads of this process, each its own ``Kept``) on a channel store served
here, as trainer rank 0 serves it: the group the plan names is formed once and handed back for the next version
(one message each way over it, both times); a name an end let go (its walk failed) is refused there at once,
naming the group, while the other end still holds it; the next name (the coordinator's after a failure) forms a new
group on both ends. The same logic over NCCL runs on 2 GPUs in ``tests/gpu/test_region_groups_gpu.py``.

A membership with copied links (``region_groups.rank_groups``): its groups per trainer rank and its IPC end are kept
under it together, each formed once, the IPC end on its own prefix of the same store; a new membership lets every
one of them go. (The IPC end's own logic, CUDA IPC, runs on GPUs: ``tests/gpu/test_ipc_regions_gpu.py``.)
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from weightsync.channels import region_groups, wire
from weightsync.channels.base import Endpoint, Rendezvous
from weightsync.errors import TransferTimeoutError
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.integration


def _exchange(
    kept: region_groups.Kept, rdv: Rendezvous, rank: int, value: int, membership: Rendezvous | None = None
) -> tuple[Any, int]:
    """Get the group ``rdv`` names (of ``membership``) and swap one number with the other end over it."""
    group = kept.get(rdv, rank, "cpu", membership)
    mine, theirs = torch.tensor([value]), torch.tensor([0])
    send, recv = group.pg.send([mine], 1 - rank, 0), group.pg.recv([theirs], 1 - rank, 0)
    send.wait()
    recv.wait()
    return group, int(theirs.item())


def test_a_kept_region_group_is_formed_once_per_name_and_refused_after_it_failed() -> None:
    store = wire.serve_store("127.0.0.1", 0, 30.0)
    rdv = Rendezvous(
        Channel.CPU, Endpoint("127.0.0.1", store.port), group="cpu-regions-r-1025", secret="ab" * 16, generation=1025,
        rank=1, world_size=2, timeout_s=10.0, join_timeout_s=20.0,
    )  # fmt: skip
    rank, worker = region_groups.Kept(), region_groups.Kept()
    with ThreadPoolExecutor(2) as pool:

        def both(named: Rendezvous, version: int) -> tuple[tuple[Any, int], tuple[Any, int]]:
            a = pool.submit(_exchange, rank, named, 0, 100 + version)
            b = pool.submit(_exchange, worker, named, 1, 200 + version)
            return a.result(timeout=60), b.result(timeout=60)

        (g1, got1), (w1, got_w1) = both(rdv, 1)
        (g2, got2), (w2, got_w2) = both(rdv, 2)
        assert (got1, got_w1, got2, got_w2) == (201, 101, 202, 102)
        assert g1 is g2 and w1 is w2  # kept: formed once, used by both versions

        worker.close()  # the worker's walk failed: it lets the group go, the rank still holds it
        with pytest.raises(TransferTimeoutError, match="region group 'cpu-regions-r-1025' failed here"):
            worker.get(rdv, 1, "cpu")
        assert rank.groups == {rdv.prefix: g1}

        renamed = dataclasses.replace(rdv, group="cpu-regions-r-1027", secret="cd" * 16, generation=1027)
        (g3, got3), (w3, got_w3) = both(renamed, 3)  # the coordinator's next name: a new group on both ends
        assert (got3, got_w3) == (203, 103) and g3 is not g1 and w3 is not w1
    rank.close()
    worker.close()


class _End:
    """Stands in for an IPC end (CUDA IPC needs GPUs): it writes through the store it is given and says when closed."""

    def __init__(self, store: Any) -> None:
        self.store, self.closed = store, False
        store.set("seen", "1")

    def close(self) -> None:
        self.closed = True


def test_a_memberships_groups_per_rank_and_its_reads_end_are_kept_together_and_let_go_together() -> None:
    from weightsync.sharding.boxes import Box
    from weightsync.sharding.plans import Region

    store = wire.serve_store("127.0.0.1", 0, 30.0)
    membership = Rendezvous(
        Channel.CPU, Endpoint("127.0.0.1", store.port), group="cpu-regions-r-2049", secret="ef" * 16,
        generation=2049, rank=2, world_size=4, timeout_s=10.0, join_timeout_s=20.0,
    )  # fmt: skip
    box = Box((0,), (4,))
    plan = [Region(0, r, w, box, 0, box, 8) for r in (0, 1) for w in (0, 1)]
    groups = region_groups.rank_groups(membership, plan, frozenset({(0, 0), (1, 1)}))
    assert {r: (g.group, g.rank, g.world_size, ws) for r, (g, ws) in groups.items()} == {
        0: ("cpu-regions-r-2049-r0", 1, 2, (1,)),
        1: ("cpu-regions-r-2049-r1", 1, 2, (0,)),
    }
    rank0, worker1 = region_groups.Kept(), region_groups.Kept()  # rank 0's group holds worker 1
    with ThreadPoolExecutor(2) as pool:

        def both(version: int) -> tuple[tuple[Any, int], tuple[Any, int]]:
            rdv, _ = groups[0]
            a = pool.submit(lambda: _exchange(rank0, rdv, 0, 100 + version, membership))
            b = pool.submit(lambda: _exchange(worker1, rdv, 1, 200 + version, membership))
            return a.result(timeout=60), b.result(timeout=60)

        (g1, got1), (w1, _) = both(1)
        end = rank0.reads_end(membership, Channel.IPC, _End)
        assert rank0.reads_end(membership, Channel.IPC, _End) is end and end.store.get("seen") == b"1"
        (g2, got2), (w2, _) = both(2)
        assert (got1, got2) == (201, 202) and g1 is g2 and w1 is w2  # kept under the membership, with its IPC end
        assert rank0.reads_end(membership, Channel.IPC, _End) is end

        renamed = dataclasses.replace(membership, group="cpu-regions-r-2051", secret="01" * 16, generation=2051)
        # a new one lets all go
        assert rank0.reads_end(renamed, Channel.IPC, _End) is not end and end.closed and not rank0.groups
        rank0.close()
        with pytest.raises(TransferTimeoutError, match="the ipc links of 'cpu-regions-r-2051' failed here"):
            rank0.reads_end(renamed, Channel.IPC, _End)  # formed once per name, as the groups
    worker1.close()
