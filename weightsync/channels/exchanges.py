"""Small messages among a trainer's ranks over a gloo group of their own: bytes in uint8 tensors, never pickle.

What the ranks of one trainer tell each other outside the data path: rank 0's decisions (the sharded
volume's version and nonce, a publish's round of region sends) and each rank's report back (the files it
wrote, the digests of the regions it sent). ``torch.distributed``'s object collectives would pickle; these
carry bytes the caller encodes (JSON), and every call is bounded by the group's timeout.
"""

from __future__ import annotations

from typing import Any

import torch


def broadcast_ints(group: Any, values: list[int]) -> list[int]:
    """Rank 0's ``values`` on every rank (the others pass as many placeholders)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(t, src=0, group=group)
    return [int(x) for x in t.tolist()]


def broadcast_bytes(group: Any, rank: int, data: bytes) -> bytes:
    """Rank 0's ``data`` on every rank (the others pass ``b""``)."""
    import torch.distributed as dist

    (n,) = broadcast_ints(group, [len(data)])
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0 and n else torch.empty(n, dtype=torch.uint8)
    if n:
        dist.broadcast(buf, src=0, group=group)
    return bytes(buf.numpy().tobytes())


def all_gather_bytes(group: Any, world: int, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank."""
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    if not longest:  # every rank's is empty
        return [b""] * world
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [bytes(o[: int(s.item())].numpy().tobytes()) for o, s in zip(out, sizes, strict=True)]


__all__ = ["all_gather_bytes", "broadcast_bytes", "broadcast_ints"]
