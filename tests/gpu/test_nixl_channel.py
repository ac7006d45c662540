"""The NIXL channel on real GPUs: one-sided reads bit-exact, registration once per buffer, dead peers time out.

The trainer (GPU 0) and the replica (GPU 1) are two real processes. The table, the
engine layout, the rendezvous hand-off (the trainer plans the replica with
``direct_rendezvous`` and passes it as JSON; its offer carries the NIXL agent's name and
metadata) and the replica's table-less tickets are the NCCL/IPC tests' own: fused q/k/v
rows read in place, a tensor the engine holds in fp32 (staged and yielded), fp32
trainer tensors cast to a bf16 wire, and an odd-sized last group. Skipped where NIXL is
not importable.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
import torch

from tests.gpu.test_gpu_channels import (
    _check,
    _cuda,
    _Engine,
    _groups,
    _need_gpus,
    _plan,
    _receive_all,
    _rendezvous,
    _replica_ticket,
    _run,
    _sender_ticket,
    _sources,
    _step,
)
from weightsync.channels.base import Receiver, SenderConfig, WorkerContext
from weightsync.errors import TransferTimeoutError
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.gpu
pytest.importorskip("nixl._api", reason="NIXL (PyPI nixl + nixl-cu13) is not importable here")

from weightsync.channels import nixl  # noqa: E402 - after the skip

TIMEOUT_S = 20.0


def _sender(device: torch.device, plans: Any, timeout_s: float = TIMEOUT_S) -> nixl.NixlSender:
    """The trainer's sender, with its one replica planned (the rendezvous handed over)."""
    sender = nixl.NixlSender.create(SenderConfig(device=str(device), timeout_s=timeout_s))
    _plan(sender, plans, timeout_s)
    return sender


def _receiver(plans: Any, device: torch.device) -> Receiver:
    return nixl.NixlReceiver.start(_rendezvous(plans), WorkerContext(0, 1, str(device)))


def _pair(rank: int, plans: Any, fp32: bool) -> dict[str, Any]:
    """Four versions: two in place (nothing registered again), then twice fresh memory (moved once)."""
    device = _cuda(rank)
    results: dict[str, Any] = {}
    if rank == 0:
        sender = _sender(device, plans)
        sources = _sources(device, fp32)
        for version in (1, 2, 3, 4):
            if version == 2:
                _step(sources)
            if version >= 3:  # a trainer handing new tensors (gathered shards): new memory each version
                sources = [t.clone() + 1 if t.is_floating_point() else t.bitwise_not() for t in sources]
            report = sender.send(_sender_ticket(version, Channel.NIXL), _groups(sources))
            results[f"sent{version}"], results[f"failed{version}"] = report.digests, report.failed
            results[f"epoch{version}"], results[f"regs{version}"] = sender.epoch, sender.registrations
            sender.release(version, TIMEOUT_S)
        sender.close()
        return results
    receiver = _receiver(plans, device)
    engine = _Engine(device)
    for version in (1, 2, 3, 4):
        results[f"got{version}"] = _receive_all(receiver, _replica_ticket(version, Channel.NIXL), engine, device)
    receiver.close()
    return results


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32-cast"])
def test_nixl_sync_is_bit_exact_and_registers_once_per_buffer(fp32: bool) -> None:
    _need_gpus(2)
    results = _run(_pair, 2, fp32)
    assert [r.get("error") for r in results] == [None, None], results
    sender, receiver = results
    for v in (1, 2, 3, 4):
        assert sender[f"failed{v}"] == {}
        _check(receiver[f"got{v}"], sender[f"sent{v}"])  # every tensor verified, in place or staged
    assert len({json.dumps(sender[f"sent{v}"], sort_keys=True) for v in (1, 2, 3, 4)}) == 4
    # in place: nothing registered again, the metadata epoch stands
    assert sender["epoch2"] == sender["epoch1"] and sender["regs2"] == sender["regs1"]
    # fresh memory: what was registered as is moves into the sender's own buffers once (one new epoch),
    # which are reused from then on (the uint8 tensor travels as is in both cases)
    assert sender["epoch3"] == sender["epoch1"] + 1
    assert sender["epoch4"] == sender["epoch3"] and sender["regs4"] == sender["regs3"]


def _trainer_dies(rank: int, plans: Any) -> dict[str, Any] | None:
    device = _cuda(rank)
    if rank == 0:
        sender = _sender(device, plans, 5.0)
        sender.send(_sender_ticket(1, Channel.NIXL, timeout_s=5.0), _groups(_sources(device, False)))
        sender.release(1, 5.0)
        os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies before publishing v2
    receiver = _receiver(plans, device)
    engine = _Engine(device)
    _receive_all(receiver, _replica_ticket(1, Channel.NIXL, timeout_s=5.0), engine, device)
    start = time.monotonic()
    try:
        _receive_all(receiver, _replica_ticket(2, Channel.NIXL, timeout_s=5.0), engine, device)
        return {"raised": None}
    except TransferTimeoutError as e:
        return {"raised": str(e), "elapsed": time.monotonic() - start}


def _replica_dies(rank: int, plans: Any) -> dict[str, Any] | None:
    device = _cuda(rank)
    if rank == 0:
        sender = _sender(device, plans, 5.0)
        sender.send(_sender_ticket(1, Channel.NIXL, timeout_s=5.0), _groups(_sources(device, False)))
        start = time.monotonic()
        try:
            sender.release(1, 5.0)
            return {"raised": None}
        except TransferTimeoutError as e:
            return {"raised": str(e), "elapsed": time.monotonic() - start}
    _receiver(plans, device)
    os.kill(os.getpid(), signal.SIGKILL)  # the replica dies before reading
    return None


def test_nixl_trainer_killed_fails_the_receiver_within_timeout() -> None:
    _need_gpus(2)
    results = _run(_trainer_dies, 2)
    assert len(results) == 1 and results[0].get("error") is None, results
    got = results[0]
    # at once (the store went with the trainer); the message names the whole wait: the join deadline and the timeout
    assert got["raised"] is not None and "v2 metadata did not arrive within" in got["raised"], got
    assert got["elapsed"] < 5.0 + 5.0, got


def test_nixl_replica_killed_fails_the_trainer_within_timeout() -> None:
    _need_gpus(2)
    results = _run(_replica_dies, 2)
    assert len(results) == 1 and results[0].get("error") is None, results
    got = results[0]
    # the replica's only worker is rank 1 of the membership (the trainer is rank 0)
    assert got["raised"] is not None and "receiver 1's ack of v1 did not arrive within 5.0s" in got["raised"], got
    assert got["elapsed"] < 5.0 + 5.0, got
