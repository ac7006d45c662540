"""The NIXL channel on real GPUs: one-sided reads bit-exact, registration once per buffer, dead peers time out.

The trainer (GPU 0) and the replica (GPU 1) are two real processes. The table and the
engine layout are the NCCL/IPC tests' own: fused q/k/v rows read in place, a tensor
the engine holds in fp32 (staged and yielded), fp32 trainer tensors cast to a bf16
wire, and an odd-sized last group. Skipped where NIXL is not importable.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from typing import Any

import pytest
import torch

from tests.gpu.test_gpu_channels import TABLE, _check, _groups, _need_gpus, _receive_all, _run, _sources
from weightsync.channels.base import UpdateTicket, WorkerContext
from weightsync.errors import TransferTimeoutError
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.gpu
pytest.importorskip("nixl._api", reason="NIXL (PyPI nixl + nixl-cu13) is not importable here")

from weightsync.channels import nixl  # noqa: E402 - after the skip

TIMEOUT_S = 20.0


def _ticket(version: int, timeout_s: float = TIMEOUT_S) -> UpdateTicket:
    return UpdateTicket(version=version, channel=Channel.NIXL, table=TABLE, verify=True, timeout_s=timeout_s)


def _receiver(port: int, device: str, timeout_s: float = TIMEOUT_S) -> nixl.NixlReceiver:
    """The test's rendezvous: the trainer leaves its init_info (plain JSON) on its own store."""
    store = torch.distributed.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    store.wait(["test/init"], datetime.timedelta(seconds=timeout_s))
    init = json.loads(store.get("test/init"))
    return nixl.NixlReceiver.from_init(init, WorkerContext(0, 1, device))


def _sender(port: int, device: torch.device, timeout_s: float = TIMEOUT_S) -> nixl.NixlSender:
    sender = nixl.NixlSender(device, port=port, timeout_s=timeout_s)
    sender._store.set("test/init", json.dumps(sender.init_info(0)))
    return sender


def _pair(rank: int, port: int, fp32: bool) -> dict[str, Any]:
    """Four versions: two in place (nothing registered again), then twice fresh memory (moved once)."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    results: dict[str, Any] = {}
    if rank == 0:
        sender = _sender(port, device)
        sources = _sources(device, fp32)
        for version in (1, 2, 3, 4):
            if version == 2:
                for t in sources:
                    t.add_(1) if t.is_floating_point() else t.bitwise_not_()
            if version >= 3:  # a trainer handing new tensors (gathered shards): new memory each version
                sources = [t.clone() + 1 if t.is_floating_point() else t.bitwise_not() for t in sources]
            results[f"sent{version}"] = sender.send(_ticket(version), _groups(sources))
            results[f"epoch{version}"], results[f"regs{version}"] = sender.epoch, sender.registrations
            sender.wait_consumed(version)
        sender.close()
        return results
    receiver = _receiver(port, str(device))
    for version in (1, 2, 3, 4):
        results[f"got{version}"] = _receive_all(receiver, _ticket(version), device)
        results[f"verified{version}"] = len(receiver.verified)
    receiver.close()
    return results


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32-cast"])
def test_nixl_sync_is_bit_exact_and_registers_once_per_buffer(fp32: bool) -> None:
    _need_gpus(2)
    results = _run(_pair, 2, 29740 + fp32, fp32)
    assert [r.get("error") for r in results] == [None, None], results
    sender, receiver = results
    for v in (1, 2, 3, 4):
        _check(receiver[f"got{v}"], sender[f"sent{v}"])
        assert receiver[f"verified{v}"] == len(TABLE)
    assert len({json.dumps(sender[f"sent{v}"], sort_keys=True) for v in (1, 2, 3, 4)}) == 4
    # in place: nothing registered again, the metadata epoch stands
    assert sender["epoch2"] == sender["epoch1"] and sender["regs2"] == sender["regs1"]
    # fresh memory: what was registered as is moves into the sender's own buffers once (one new epoch),
    # which are reused from then on (the uint8 tensor travels as is in both cases)
    assert sender["epoch3"] == sender["epoch1"] + 1
    assert sender["epoch4"] == sender["epoch3"] and sender["regs4"] == sender["regs3"]


def _trainer_dies(rank: int, port: int) -> dict[str, Any] | None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    if rank == 0:
        sender = _sender(port, device, 5.0)
        sender.send(_ticket(1, 5.0), _groups(_sources(device, False)))
        sender.wait_consumed(1)
        os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies before publishing v2
    receiver = _receiver(port, str(device), 5.0)
    _receive_all(receiver, _ticket(1, 5.0), device)
    start = time.monotonic()
    try:
        _receive_all(receiver, _ticket(2, 5.0), device)
        return {"raised": None}
    except TransferTimeoutError as e:
        return {"raised": str(e), "elapsed": time.monotonic() - start}


def _replica_dies(rank: int, port: int) -> dict[str, Any] | None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    if rank == 0:
        sender = _sender(port, device, 5.0)
        sender.send(_ticket(1, 5.0), _groups(_sources(device, False)))
        start = time.monotonic()
        try:
            sender.wait_consumed(1, timeout_s=5.0)
            return {"raised": None}
        except TransferTimeoutError as e:
            return {"raised": str(e), "elapsed": time.monotonic() - start}
    _receiver(port, str(device), 5.0)
    os.kill(os.getpid(), signal.SIGKILL)  # the replica dies before reading
    return None


def test_nixl_trainer_killed_fails_the_receiver_within_timeout() -> None:
    _need_gpus(2)
    results = _run(_trainer_dies, 2, 29750)
    assert len(results) == 1 and results[0].get("error") is None, results
    got = results[0]
    assert got["raised"] is not None and "v2 metadata did not arrive within 5.0s" in got["raised"], got
    assert got["elapsed"] < 5.0 + 5.0, got


def test_nixl_replica_killed_fails_the_trainer_within_timeout() -> None:
    _need_gpus(2)
    results = _run(_replica_dies, 2, 29760)
    assert len(results) == 1 and results[0].get("error") is None, results
    got = results[0]
    assert got["raised"] is not None and "receiver 0's ack of v1 did not arrive within 5.0s" in got["raised"], got
    assert got["elapsed"] < 5.0 + 5.0, got
