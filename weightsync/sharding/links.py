"""Which links of a transfer plan a worker copies by CUDA IPC instead of receiving them over a group.

A link is a (trainer rank, worker) pair with at least one region between them. Where a trainer rank and a
replica's worker share a GPU (a colocated job: a 2-rank FSDP2 trainer and a TP=2 replica on the same two GPUs),
NCCL refuses to put both in one communicator, and copying on the device beats any wire anyway: such a link is
*co-located*, and its worker copies its regions straight out of the rank's shard (``channels.ipc_regions``).
Where the worker's process reaches the rank's GPU peer-to-peer (the replica reported it among its ``peers``: one
host, the GPU visible to every worker, NVLink or PCIe P2P between them), the worker copies that link too, by the
copy engines from the rank's GPU (``channels.peer_copies``): on GPUs that hold a trainer rank and a worker each,
an NCCL link between two of them waits for both processes' time slices on each GPU, a copy engine for neither.
Every other link goes over a torch.distributed group as before (``channels.regions``), in the same version.

Decided from what each end discovered, the GPU UUID it runs on (``channels.gpu.uuid``: ``GPU-...`` or, on a MIG
slice, ``MIG-...``), never from host names or device indices (``cuda:0`` in two containers can be two GPUs, and one
GPU can be ``cuda:1`` in one process and ``cuda:0`` in another). An end without a UUID (a CPU engine, an end that
reported none) is co-located with nothing. Both ends compute the same answer from the same plan and UUIDs, so no
link is copied by one end and posted by the other. Torch-free: the coordinator can plan with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from weightsync.sharding.plans import Region

Link = tuple[int, int]
"""(trainer rank, worker) of one replica."""


def copied(
    regions: Iterable[Region], ranks: Mapping[int, str], workers: Mapping[int, str], peers: Iterable[str] = ()
) -> frozenset[Link]:
    """The links of ``regions`` a worker copies: its rank on the worker's GPU (``ranks[r]`` and ``workers[w]`` the
    same UUID), or on a GPU in ``peers`` (the GPUs every worker of the replica reaches peer-to-peer).

    >>> from weightsync.sharding.boxes import Box
    >>> b = Box((0,), (4,))
    >>> plan = [Region(0, r, w, b, 0, b, 8) for r in (0, 1) for w in (0, 1)]
    >>> sorted(copied(plan, {0: "GPU-a", 1: "GPU-b"}, {0: "GPU-a", 1: "GPU-b"}))
    [(0, 0), (1, 1)]
    >>> sorted(copied(plan, {0: "GPU-a", 1: "GPU-b"}, {0: "GPU-a", 1: "GPU-b"}, peers=("GPU-a",)))
    [(0, 0), (0, 1), (1, 1)]
    """
    reach = set(peers)
    out = set()
    for r in regions:
        ours, theirs = ranks.get(r.rank, ""), workers.get(r.worker, "")
        if ours and (ours == theirs or ours in reach):
            out.add((r.rank, r.worker))
    return frozenset(out)


def split(regions: Iterable[Region], copied: frozenset[Link]) -> tuple[list[Region], list[Region]]:
    """``regions`` (in plan order) as (those on copied links, the rest), each still in plan order."""
    near: list[Region] = []
    far: list[Region] = []
    for r in regions:
        (near if (r.rank, r.worker) in copied else far).append(r)
    return near, far


__all__ = ["Link", "copied", "split"]
