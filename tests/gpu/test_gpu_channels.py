"""The NCCL and IPC channels on real GPUs: bit-exact after a sync, and a dead peer fails the sender in time.

Each test runs the trainer and the replica as two real processes (spawned, one per
GPU for NCCL, both on GPU 0 for IPC). The trainer builds its sender from the
publisher's ``SenderConfig``, plans one replica on it without a coordinator
(``direct_rendezvous``) and hands the replica its ``Rendezvous`` as JSON, as vLLM's
``init_info`` carries it; the replica starts its receiver from that. The replica's
tickets carry no table: the channel carries it (a store key for NCCL, the version's
metadata for IPC), checked against the layout digest. Destinations come from a
``place`` callable that returns the same mapping for the same layout, as the engine's
does, so later versions run on what the receiver prepared for the first.

The table mixes what a sync meets: fused q/k/v rows written in place, a tensor the
engine holds in another dtype (staged and yielded), fp32 trainer tensors cast to a
bf16 wire, and a last group of an odd byte count. Expected values are rebuilt on the
receiver from the same seed, and compared tensor by tensor through the integer digests.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from weightsync.channels import digests, ipc, nccl, placement
from weightsync.channels.base import Rendezvous, Sender, SenderConfig, UpdateTicket, WorkerContext, direct_rendezvous
from weightsync.channels.wire import TORCH_DTYPES
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
LAYOUT: dict[str, tuple[str, tuple[int, ...]]] = {
    "model.embed_tokens.weight": ("bfloat16", (1000, H)),
    "model.layers.0.self_attn.qkv_proj.weight": ("bfloat16", (8 * 64, H)),
    "model.layers.0.input_layernorm.weight": ("bfloat16", (H,)),
    "model.layers.0.mlp.down_proj.weight": ("float32", (H, 3 * H)),
    "model.norm.weight": ("bfloat16", (H,)),
    "model.tail.bytes": ("uint8", (1001,)),
}
STAGED = ["model.layers.0.mlp.down_proj.weight"]
"""What the engine cannot take in place (its fp32 parameter): yielded to the loader."""
TIMEOUT_S = 20.0
REPLICA = "replica-0"


def _cuda(index: int) -> torch.device:
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


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


def _step(sources: list[torch.Tensor]) -> None:
    """A training step: new values, same memory."""
    for t in sources:
        if t.is_floating_point():
            t.add_(1)
        else:
            t.bitwise_not_()


def _groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    it = iter(tensors)
    return [[next(it) for _ in g] for g in TABLE.groups()]


def _expected_digests(device: torch.device, fp32: bool) -> dict[str, str]:
    sources = _sources(device, fp32)
    return {s.name: digests.digest(t.to(TORCH_DTYPES[s.dtype])) for s, t in zip(TABLE, sources, strict=True)}


def _sender_ticket(
    version: int, channel: Channel, table: TensorTable = TABLE, verify: bool = True, timeout_s: float = TIMEOUT_S
) -> UpdateTicket:
    """The trainer's ticket: the table, and the layout digest the coordinator would record."""
    return UpdateTicket(version, channel, table, table.layout_digest(), verify=verify, timeout_s=timeout_s)


def _replica_ticket(
    version: int, channel: Channel, table: TensorTable = TABLE, verify: bool = True, timeout_s: float = TIMEOUT_S
) -> UpdateTicket:
    """A replica's ticket: no table (the channel carries it), the layout digest to check it against."""
    return UpdateTicket(version, channel, layout_digest=table.layout_digest(), verify=verify, timeout_s=timeout_s)


def _plan(sender: Sender, plans: Any, timeout_s: float = TIMEOUT_S) -> Rendezvous:
    """Plan one replica of one worker on ``sender`` and hand the replica its rendezvous (JSON, as ``init_info``)."""
    rdv = direct_rendezvous(sender.offer(), join_timeout_s=timeout_s / 2).with_timeout(timeout_s)
    sender.take_plan({REPLICA: rdv})
    plans.put(json.dumps(rdv.to_dict()))
    return rdv


def _rendezvous(plans: Any, timeout_s: float = 120.0) -> Rendezvous:
    """The rendezvous the trainer planned for this replica."""
    return Rendezvous.from_dict(json.loads(plans.get(timeout=timeout_s)))


class _Engine:
    """Engine-layout parameters (each its own allocation) and the ``place`` the engine hands a receiver.

    As the engine's own: only whole modules in place, and the same mapping for the same layout.
    """

    def __init__(self, device: torch.device) -> None:
        self.params = {n: torch.zeros(shape, dtype=TORCH_DTYPES[d], device=device) for n, (d, shape) in LAYOUT.items()}
        self._views: dict[str, dict[str, torch.Tensor]] = {}

    def place(self, table: TensorTable) -> Mapping[str, torch.Tensor]:
        key = table.layout_digest()
        if key not in self._views:
            plan = placement.whole_modules(placement.direct_plan(table, LAYOUT), LAYOUT)
            self._views[key] = placement.resolve(plan, self.params)
        return self._views[key]


def _receive_all(receiver: Any, ticket: UpdateTicket, engine: _Engine, device: torch.device) -> dict[str, Any]:
    """Receive into the engine's parameters; digest what landed in place and what was yielded."""
    got: dict[str, str] = {}
    yielded = []
    for group in receiver.receive(ticket, engine.place):
        for spec, tensor in group:
            yielded.append(spec.name)
            got[spec.name] = digests.digest(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert receiver.table is not None, "receive ended without the version's table"
    for name, view in engine.place(receiver.table).items():
        got[name] = digests.digest(view)
    return {
        "digests": got,
        "yielded": sorted(yielded),
        "in_place": sorted(receiver.in_place),
        "verified": dict(receiver.verified),
    }


def _run(target: Any, nprocs: int, *args: Any) -> list[dict[str, Any]]:
    """Run ``target(rank, plans, *args)`` in ``nprocs`` spawned processes; ``plans`` carries rendezvous to replicas."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    plans = ctx.Queue()
    procs = [ctx.Process(target=_guarded, args=(target, rank, q, plans, *args)) for rank in range(nprocs)]
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


def _guarded(target: Any, rank: int, q: Any, plans: Any, *args: Any) -> None:
    try:
        res = target(rank, plans, *args)
    except BaseException:  # noqa: BLE001 - the parent asserts on the traceback
        res = {"error": traceback.format_exc()}
    if res is not None:
        res["rank"] = rank
        q.put(json.dumps(res))


def _nccl_pair(rank: int, plans: Any, fp32: bool) -> dict[str, Any]:
    """Two versions over one group: the second keeps the membership, the group and the replica's destinations."""
    device = _cuda(rank)
    results: dict[str, Any] = {}
    if rank == 0:
        sender = nccl.NcclSender.create(SenderConfig(device=str(device), timeout_s=TIMEOUT_S))
        rdv = _plan(sender, plans)
        sources = _sources(device, fp32)
        for version in (1, 2):
            if version == 2:
                _step(sources)
                sender.take_plan({REPLICA: rdv})  # the publisher plans every version: same membership, same group
            report = sender.send(_sender_ticket(version, Channel.NCCL), _groups(sources))
            results[f"sent{version}"], results[f"failed{version}"] = report.digests, report.failed
        sender.close()
        return results
    receiver = nccl.NcclReceiver.start(_rendezvous(plans), WorkerContext(0, 1, str(device)))
    engine = _Engine(device)
    for version in (1, 2):
        results[f"got{version}"] = _receive_all(receiver, _replica_ticket(version, Channel.NCCL), engine, device)
    receiver.close()
    results["expected1"] = _expected_digests(device, fp32)
    return results


IPC_VERSIONS = (1, 2, 3)


def _ipc_pair(rank: int, plans: Any, fp32: bool) -> dict[str, Any]:
    device = _cuda(0)
    results: dict[str, Any] = {}
    if rank == 0:
        sender = ipc.IpcSender.create(SenderConfig(device=str(device), timeout_s=TIMEOUT_S))
        rdv = _plan(sender, plans)
        sources = _sources(device, fp32)
        for version in IPC_VERSIONS:
            if version == 2:  # the second version reuses the exports of the first
                _step(sources)
                sender.take_plan({REPLICA: rdv})
                results["exports"] = sender._exports.exported
            if version == 3:  # a tensor moved to new memory (``param.data = ...``): exported, its location sent again
                sources[0] = sources[0] + 1
            report = sender.send(_sender_ticket(version, Channel.IPC), _groups(sources))
            results[f"sent{version}"], results[f"failed{version}"] = report.digests, report.failed
            sender.release(version, TIMEOUT_S)  # the replica copied it: the trainer may change its tensors
        results["exports_after"] = sender._exports.exported
        sender.close()
        return results
    receiver = ipc.IpcReceiver.start(_rendezvous(plans), WorkerContext(0, 1, str(device)))
    engine = _Engine(device)
    for version in IPC_VERSIONS:
        results[f"got{version}"] = _receive_all(receiver, _replica_ticket(version, Channel.IPC), engine, device)
    receiver.close()
    return results


def _dead_peer(rank: int, plans: Any) -> dict[str, Any] | None:
    device = _cuda(rank)
    # a first small version forms the group, so the clock times the broadcast, not the group's formation
    warm = TensorTable.build([[("warm.w", "bfloat16", (16, 16))]])
    # groups of 64 MiB: far more than NCCL's buffers, so the trainer cannot finish without the peer
    table = TensorTable.build([[(f"layer{i}.w", "bfloat16", (4096, 8192))] for i in range(6)])
    if rank == 0:
        # the group forms within TIMEOUT_S; the version's broadcasts are bounded by its ticket's 5 s
        sender = nccl.NcclSender.create(SenderConfig(device=str(device), timeout_s=TIMEOUT_S))
        _plan(sender, plans)
        sender.send(_sender_ticket(1, Channel.NCCL, warm, verify=False), [[torch.ones(16, 16, device=device)]])
        tensors = [[torch.ones(4096, 8192, dtype=torch.bfloat16, device=device)] for _ in range(6)]
        start = time.monotonic()
        try:
            sender.send(_sender_ticket(2, Channel.NCCL, table, verify=False, timeout_s=5.0), tensors)
            return {"raised": None}
        except TransferTimeoutError as e:
            return {"raised": str(e), "elapsed": time.monotonic() - start}
        finally:
            sender.close()
    receiver = nccl.NcclReceiver.start(_rendezvous(plans), WorkerContext(0, 1, str(device)))
    for _ in receiver.receive(_replica_ticket(1, Channel.NCCL, warm, verify=False)):
        pass
    for _ in receiver.receive(_replica_ticket(2, Channel.NCCL, table, verify=False, timeout_s=5.0)):
        torch.cuda.synchronize(device)
        os.kill(os.getpid(), signal.SIGKILL)  # die after the first group, with the next one in flight
    return None


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, found {torch.cuda.device_count()}")


def _check(got: dict[str, Any], expected: dict[str, str]) -> None:
    """Every tensor bit-exact; the fp32 engine parameter staged, everything else written in place, all verified."""
    assert got["yielded"] == STAGED
    assert got["in_place"] == sorted(s.name for s in TABLE if s.name not in STAGED)
    assert got["verified"] == expected
    for name, digest in expected.items():
        assert got["digests"][name] == digest, f"{name}: received {got['digests'][name]}, expected {digest}"


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32-cast"])
def test_nccl_sync_is_bit_exact(fp32: bool) -> None:
    _need_gpus(2)
    results = _run(_nccl_pair, 2, fp32)
    assert [r.get("error") for r in results] == [None, None], results
    sender, receiver = results
    assert sender["sent1"] == receiver["expected1"]
    assert sender["sent1"] != sender["sent2"]
    for v in (1, 2):
        assert sender[f"failed{v}"] == {}
        _check(receiver[f"got{v}"], sender[f"sent{v}"])


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16", "fp32-cast"])
def test_ipc_sync_is_bit_exact_and_exports_once(fp32: bool) -> None:
    _need_gpus(1)
    results = _run(_ipc_pair, 2, fp32)
    assert [r.get("error") for r in results] == [None, None], results
    sender, receiver = results
    for v in IPC_VERSIONS:
        assert sender[f"failed{v}"] == {}
        _check(receiver[f"got{v}"], sender[f"sent{v}"])
    assert sender["sent1"] != sender["sent2"] != sender["sent3"]
    assert sender["exports"] == len(TABLE)  # one export per buffer, none for the second version
    # the third: one more export when the trainer's tensor is a new allocation (a cast buffer is reused)
    assert sender["exports_after"] == len(TABLE) + (0 if fp32 else 1)


def test_nccl_peer_killed_mid_broadcast_fails_sender_within_timeout() -> None:
    _need_gpus(2)
    results = _run(_dead_peer, 2)
    assert len(results) == 1 and results[0].get("error") is None, results
    sender = results[0]
    assert sender["raised"] is not None and "did not complete within 5.0s" in sender["raised"], sender
    assert sender["elapsed"] < 5.0 + 5.0, sender
