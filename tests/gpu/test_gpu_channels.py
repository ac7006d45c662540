"""The NCCL and IPC channels on real GPUs: bit-exact after a sync, and a dead peer fails the sender in time.

Each test runs the trainer and the replica as two real processes (spawned, one per
GPU for NCCL, both on GPU 0 for IPC). The table mixes what a sync meets: fused q/k/v
rows written in place, a tensor the engine holds in another dtype (staged and
yielded), fp32 trainer tensors cast to a bf16 wire, and a last group of an odd byte
count. Expected values are rebuilt on the receiver from the same seed, and compared
tensor by tensor through the integer digests.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from weightsync.channels import digests, ipc, nccl, placement
from weightsync.channels.base import TORCH_DTYPES, UpdateTicket, WorkerContext
from weightsync.errors import TransferTimeoutError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.gpu

H = 256
TABLE = TensorTable.build(
    [
        [("model.embed_tokens.weight", "bfloat16", (1000, H))],
        [
            ("model.layers.0.self_attn.q_proj.weight", "bfloat16", (4 * 64, H)),
            ("model.layers.0.self_attn.k_proj.weight", "bfloat16", (2 * 64, H)),
            ("model.layers.0.self_attn.v_proj.weight", "bfloat16", (2 * 64, H)),
            ("model.layers.0.input_layernorm.weight", "bfloat16", (H,)),
            ("model.layers.0.mlp.down_proj.weight", "bfloat16", (H, 3 * H)),  # engine holds it in fp32: staged
        ],
        [("model.norm.weight", "bfloat16", (H,)), ("model.tail.bytes", "uint8", (1001,))],  # odd-sized last group
    ]
)
LAYOUT = {
    "model.embed_tokens.weight": ("bfloat16", (1000, H)),
    "model.layers.0.self_attn.qkv_proj.weight": ("bfloat16", (8 * 64, H)),
    "model.layers.0.input_layernorm.weight": ("bfloat16", (H,)),
    "model.layers.0.mlp.down_proj.weight": ("float32", (H, 3 * H)),
    "model.norm.weight": ("bfloat16", (H,)),
    "model.tail.bytes": ("uint8", (1001,)),
}
TIMEOUT_S = 20.0


def _sources(device: torch.device, fp32: bool) -> list[torch.Tensor]:
    g = torch.Generator(device=device)
    g.manual_seed(7)
    out = []
    for s in TABLE:
        if s.dtype == "uint8":
            out.append(torch.randint(0, 256, s.shape, generator=g, device=device, dtype=torch.uint8))
        else:
            dtype = torch.float32 if fp32 else torch.bfloat16
            out.append(torch.randn(s.shape, generator=g, device=device, dtype=dtype))
    return out


def _groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    it = iter(tensors)
    return [[next(it) for _ in g] for g in TABLE.groups()]


def _expected_digests(device: torch.device, fp32: bool) -> dict[str, str]:
    sources = _sources(device, fp32)
    return {s.name: digests.digest(t.to(TORCH_DTYPES[s.dtype])) for s, t in zip(TABLE, sources, strict=True)}


def _receive_all(receiver: Any, ticket: UpdateTicket, device: torch.device) -> dict[str, str]:
    """Receive into engine-layout parameters; digest what landed in place and what was yielded."""
    params = {n: torch.zeros(shape, dtype=TORCH_DTYPES[d], device=device) for n, (d, shape) in LAYOUT.items()}
    views = placement.resolve(placement.direct_plan(TABLE, LAYOUT), params)
    got: dict[str, str] = {}
    yielded = []
    for group in receiver.receive(ticket, views):
        for spec, tensor in group:
            yielded.append(spec.name)
            got[spec.name] = digests.digest(tensor)
    torch.cuda.synchronize(device)
    for name, view in views.items():
        got[name] = digests.digest(view)
    got["__yielded__"] = ",".join(sorted(yielded))
    return got


def _run(target: Any, nprocs: int, *args: Any) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_guarded, args=(target, rank, q, *args)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    results = []
    while not q.empty():
        results.append(json.loads(q.get()))
    for p in procs:
        if p.is_alive():
            p.kill()
    return sorted(results, key=lambda r: r["rank"])


def _guarded(target: Any, rank: int, q: Any, *args: Any) -> None:
    try:
        res = target(rank, *args)
    except BaseException:  # noqa: BLE001 - the parent asserts on the traceback
        res = {"error": traceback.format_exc()}
    if res is not None:
        res["rank"] = rank
        q.put(json.dumps(res))


def _nccl_pair(rank: int, port: int, fp32: bool) -> dict[str, Any]:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    ticket = UpdateTicket(version=1, channel=Channel.NCCL, table=TABLE, verify=True, timeout_s=TIMEOUT_S)
    if rank == 0:
        sender = nccl.NcclSender(["replica-0"], device, port=port, timeout_s=TIMEOUT_S)
        sender.connect()
        sent = sender.send(ticket, _groups(_sources(device, fp32)))
        sender.close()
        return {"sent": sent}
    info = {"address": f"127.0.0.1:{port}", "world_size": 2, "rank_offset": 1, "generation": 1, "timeout_s": TIMEOUT_S}
    receiver = nccl.NcclReceiver.from_init(info, WorkerContext(0, 1, str(device)))
    got = _receive_all(receiver, ticket, device)
    receiver.close()
    return {"got": got, "expected": _expected_digests(device, fp32)}


def _ipc_pair(rank: int, port: int, fp32: bool) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    results: dict[str, Any] = {}
    if rank == 0:
        sender = ipc.IpcSender(device, port=port, timeout_s=TIMEOUT_S)
        sources = _sources(device, fp32)
        for version in (1, 2):  # the second version reuses the exports of the first
            if version == 2:
                for t in sources:
                    t.add_(1) if t.is_floating_point() else t.bitwise_not_()
            ticket = UpdateTicket(version=version, channel=Channel.IPC, table=TABLE, verify=True, timeout_s=TIMEOUT_S)
            results[f"sent{version}"] = sender.send(ticket, _groups(sources))
            sender.wait_consumed(version)
        results["exports"] = sender._next_id
        sender.close()
        return results
    init = {"address": f"127.0.0.1:{port}", "timeout_s": TIMEOUT_S}
    receiver = ipc.IpcReceiver.from_init(init, WorkerContext(0, 1, "cuda:0"))
    for version in (1, 2):
        ticket = UpdateTicket(version=version, channel=Channel.IPC, table=TABLE, verify=True, timeout_s=TIMEOUT_S)
        results[f"got{version}"] = _receive_all(receiver, ticket, device)
    receiver.close()
    return results


def _dead_peer(rank: int, port: int) -> dict[str, Any] | None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    # groups of 64 MiB: far more than NCCL's buffers, so the trainer cannot finish without the peer
    table = TensorTable.build([[(f"layer{i}.w", "bfloat16", (4096, 8192))] for i in range(6)])
    ticket = UpdateTicket(version=1, channel=Channel.NCCL, table=table, verify=False, timeout_s=5.0)
    if rank == 0:
        sender = nccl.NcclSender(["replica-0"], device, port=port, timeout_s=5.0)
        sender.connect()
        tensors = [[torch.ones(4096, 8192, dtype=torch.bfloat16, device=device)] for _ in range(6)]
        start = time.monotonic()
        try:
            sender.send(ticket, tensors)
            return {"raised": None}
        except TransferTimeoutError as e:
            return {"raised": str(e), "elapsed": time.monotonic() - start}
        finally:
            sender.close()
    info = {"address": f"127.0.0.1:{port}", "world_size": 2, "rank_offset": 1, "generation": 1, "timeout_s": 5.0}
    receiver = nccl.NcclReceiver.from_init(info, WorkerContext(0, 1, str(device)))
    for _ in receiver.receive(ticket):
        torch.cuda.synchronize(device)
        os.kill(os.getpid(), signal.SIGKILL)  # die after the first group, with the next one in flight
    return None


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, found {torch.cuda.device_count()}")


def _check(got: dict[str, str], expected: dict[str, str]) -> None:
    assert got["__yielded__"] == "model.layers.0.mlp.down_proj.weight"  # the fp32 engine param is staged
    for name, digest in expected.items():
        assert got[name] == digest, f"{name}: received {got[name]}, expected {digest}"


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32-cast"])
def test_nccl_sync_is_bit_exact(fp32: bool) -> None:
    _need_gpus(2)
    results = _run(_nccl_pair, 2, 29710 + fp32, fp32)
    assert [r.get("error") for r in results] == [None, None], results
    sender, receiver = results
    _check(receiver["got"], receiver["expected"])
    assert sender["sent"] == receiver["expected"]


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32-cast"])
def test_ipc_sync_is_bit_exact_and_exports_once(fp32: bool) -> None:
    _need_gpus(1)
    results = _run(_ipc_pair, 2, 29720 + fp32, fp32)
    assert [r.get("error") for r in results] == [None, None], results
    sender, receiver = results
    _check(receiver["got1"], sender["sent1"])
    _check(receiver["got2"], sender["sent2"])
    assert sender["sent1"] != sender["sent2"]
    assert sender["exports"] == len(TABLE)  # one export per buffer, none for the second version


def test_nccl_peer_killed_mid_broadcast_fails_sender_within_timeout() -> None:
    _need_gpus(2)
    results = _run(_dead_peer, 2, 29730)
    assert len(results) == 1 and results[0].get("error") is None, results
    sender = results[0]
    assert sender["raised"] is not None and "did not complete within 5.0s" in sender["raised"], sender
    assert sender["elapsed"] < 5.0 + 5.0, sender
