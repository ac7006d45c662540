"""The NCCL channel leaves a member out on real GPUs, and the rest finish the version.

The same rosters, heartbeats, attempts and resume as tests/integration/test_nccl_exclusion.py runs over gloo,
here over NCCL: the trainer on GPU 0, replicas of one worker each on GPUs 1 and 2, one group of three planned.
A replica that never joins touches no GPU, so the first two cases fit on 2 GPUs:

- a replica that never joins: the roster leaves it out at the join deadline, the other gets the version
  bit-exact (2 GPUs);
- the only replica that joined killed after the first group of a version whose groups outrun NCCL's buffers:
  the sender finds it silent (or its collective failed), tells ``on_lost`` and gives up within the join
  deadline and a re-formation, not the 60 s transfer timeout (2 GPUs);
- one of two replicas killed the same way: the sender forms attempt 2 with the other, which finishes the
  version bit-exact (3 GPUs: NCCL refuses two ranks of one communicator on one device).

Run on the GPU host: ``bash tools/gpu-host.sh python3 -m pytest -m gpu -v tests/gpu/test_nccl_exclusion_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any

import pytest
import torch

from tests.gpu.test_gpu_channels import _need_gpus, _run
from weightsync.channels import digests, nccl
from weightsync.channels.base import Rendezvous, SenderConfig, UpdateTicket, WorkerContext, direct_rendezvous
from weightsync.errors import TransferTimeoutError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.gpu
JOIN_S = 5.0
TIMEOUT_S = 60.0
WARM = TensorTable.build([[("warm.w", "bfloat16", (16, 16))]])
BIG = TensorTable.build([[(f"layer{i}.w", "bfloat16", (4096, 8192))] for i in range(6)])
"""Groups of 64 MiB: far more than NCCL's buffers, so the version cannot finish without every member."""


def _cuda(rank: int) -> torch.device:
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _tensors(table: TensorTable, device: torch.device, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [
        [torch.randn(s.shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16) for s in specs]
        for specs in table.groups()
    ]


def _ticket(version: int, table: TensorTable, sender: bool) -> UpdateTicket:
    return UpdateTicket(version, Channel.NCCL, table if sender else None, table.layout_digest(), timeout_s=TIMEOUT_S)


def _sender(plans: Any, joining: tuple[int, ...]) -> dict[str, Any]:
    device = _cuda(0)
    sender = nccl.NcclSender.create(SenderConfig(device=str(device), timeout_s=TIMEOUT_S))
    first = direct_rendezvous(sender.offer(), join_timeout_s=JOIN_S).with_timeout(TIMEOUT_S)
    plan = {f"r{r}": dataclasses.replace(first, rank=r, world_size=3) for r in (1, 2)}
    sender.take_plan(plan)
    for _ in joining:
        plans.put(json.dumps({rid: rdv.to_dict() for rid, rdv in plan.items()}))
    out: dict[str, Any] = {"left_out": sender.ready(JOIN_S + 5, set(plan))}
    sender.send(_ticket(1, WARM, True), [[torch.ones(16, 16, dtype=torch.bfloat16, device=device)]])
    lost: dict[str, float] = {}
    sender.on_lost = lambda rid, why: lost.setdefault(rid, time.monotonic())
    start = time.monotonic()
    try:
        report = sender.send(_ticket(2, BIG, True), _tensors(BIG, device, seed=7))
        out.update(failed=report.failed, sent=report.digests)
    except TransferTimeoutError as e:  # every receiver lost: the version cannot go on in this group
        out["gave_up"] = str(e)
    out["elapsed"] = time.monotonic() - start
    out["told_after"] = {rid: t - start for rid, t in lost.items()}
    sender.close()
    return out


def _receiver(rank: int, plans: Any, die: bool) -> dict[str, Any] | None:
    device = _cuda(rank)
    rdv = Rendezvous.from_dict(json.loads(plans.get(timeout=120))[f"r{rank}"])
    receiver = nccl.NcclReceiver.start(rdv, WorkerContext(0, 1, str(device)))
    for _ in receiver.receive(_ticket(1, WARM, False)):
        pass
    got: dict[str, str] = {}
    for group in receiver.receive(_ticket(2, BIG, False)):
        if die:
            torch.cuda.synchronize(device)
            os.kill(os.getpid(), signal.SIGKILL)  # after the first group, with the next ones in flight
        for spec, tensor in group:
            got[spec.name] = digests.digest(tensor)
    receiver.close()
    return {"got": got, "verified": dict(receiver.verified)}


def _fleet(rank: int, plans: Any, joining: tuple[int, ...], dies: int) -> dict[str, Any] | None:
    if rank == 0:
        return _sender(plans, joining)
    if rank not in joining:
        return None  # never joins
    return _receiver(rank, plans, die=rank == dies)


def test_a_replica_that_never_joins_is_left_out() -> None:
    _need_gpus(2)
    results = _run(_fleet, 3, (1,), 0)
    assert [r.get("error") for r in results] == [None, None], results
    sender, receiver = results
    assert set(sender["left_out"]) == {"r2"}, sender
    # the one left out is failed on this channel (the publisher reports it lost: it falls back alone)
    assert set(sender["failed"]) == {"r2"} and "join deadline" in sender["failed"]["r2"], sender
    assert receiver["got"] == sender["sent"] == receiver["verified"]


def test_the_only_replica_killed_mid_version_is_told_at_once_and_the_sender_does_not_hang() -> None:
    _need_gpus(2)
    results = _run(_fleet, 3, (1,), 1)
    assert [r.get("error") for r in results] == [None], results  # the killed one reports nothing
    (sender,) = results
    assert set(sender["left_out"]) == {"r2"}, sender
    assert "every receiver of group" in sender.get("gave_up", ""), sender
    assert sender["elapsed"] < JOIN_S + 20, sender  # the join deadline, not the 60 s timeout
    assert sender["told_after"]["r1"] < JOIN_S + 10, sender


def test_a_replica_killed_mid_version_is_left_out_and_the_other_finishes_it() -> None:
    if torch.cuda.device_count() < 3:
        pytest.skip(
            f"needs 3 CUDA devices (the trainer and two replicas, each on its own: NCCL refuses two ranks of one "
            f"communicator on one device), found {torch.cuda.device_count()}; tests/integration/"
            "test_nccl_exclusion.py runs this case over gloo"
        )
    results = _run(_fleet, 3, (1, 2), 2)
    assert [r.get("error") for r in results] == [None, None], results  # the killed one reports nothing
    sender, survivor = results
    assert sender["left_out"] == {} and set(sender["failed"]) == {"r2"}, sender
    assert sender["elapsed"] < JOIN_S + 20, sender  # the join deadline and a re-formation, not the 60 s timeout
    assert sender["told_after"]["r2"] < JOIN_S + 10, sender
    assert survivor["got"] == sender["sent"] == survivor["verified"]
