"""A replica's engine on the GPU host, where vLLM cannot be installed: the plugin's own update code, vLLM's layout.

vLLM's GPU build needs torch 2.13 and about 1 GB of CUDA wheels that the GPU host cannot
take, so the GPU fleet tests run each replica's engine as this harness:

- ``weightsync_inference.updates.Updater``, the very class vLLM's weightsync engine runs in
  every worker (receivers started from the plan's rendezvous, in-place destinations through
  ``placement``, whole modules only, fail-stop state, receipts), over
- ``HarnessModel``, a parameter set laid out as vLLM's ``Qwen3ForCausalLM`` holds it at
  tensor-parallel size 1 (fused ``qkv_proj`` and ``gate_up_proj``; the layouts are in
  ``bench/data/<model>.plan.json``, written where vLLM runs).

What differs from vLLM: ``HarnessModel.load`` copies what cannot go in place into the
parameters (vLLM's weight loaders do; a bf16 Qwen3 table at tensor-parallel size 1 lands
wholly in place, so it is rarely used), and ``pause``/``resume`` hold no requests. The
vLLM wrapper around ``Updater`` (engine.py: the layerwise reload, tied layers, the worker
extension, HTTP) is covered by the CPU integration tests (tests/integration/test_sync_cpu.py, test_served_engine.py,
test_fleet_hosts.py).

``python -m tests.gpu.harness --replica-id r1 --device cuda:1 ...`` runs one replica: this
engine driven by the real ``weightsync_inference.agent.Agent`` against a real coordinator.
After each version it writes the digests of its *parameters* (not of what it received)
to ``<out>/<replica>.json``, which the test compares with the trainer's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from weightsync.channels import digests, gpu, placement
from weightsync.channels.base import Rendezvous, UpdateTicket, WorkerContext
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.tensors import TensorTable
from weightsync_inference import validation
from weightsync_inference.receipts import Identity, Receipt
from weightsync_inference.updates import Updater

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"


def plan_file(model: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / f"{model}.plan.json").read_text())
    return data


class HarnessModel:
    """vLLM-layout parameters on one GPU, behind ``updates.Model``."""

    def __init__(self, layout: Mapping[str, tuple[str, tuple[int, ...]]], device: torch.device, seed: int = 0) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        self.params = {
            name: torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32).to(TORCH_DTYPES[dtype])
            for name, (dtype, shape) in layout.items()
        }
        self.loaded_through_loader = 0

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.params.items()

    def fused_mapping(self) -> Mapping[str, tuple[str, str | int]]:
        return placement.FUSED_LLAMA_QWEN

    def writes_in_place(self) -> bool:
        return True

    def check(self, table: TensorTable) -> None:
        validation.check_table(table, placement.layout_of(self.params.items()), self.fused_mapping())

    def begin_load(self, table: TensorTable) -> None:
        """Nothing to prepare: the harness's loader copies into plain tensors."""

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """What vLLM's weight loaders do for a tensor that cannot be written in place: copy it into its rows."""
        plan = placement.direct_plan(
            [_spec(n, t) for n, t in weights], placement.layout_of(self.params.items()), self.fused_mapping()
        )
        for name, tensor in weights:
            target = placement.resolve({name: plan[name]}, self.params)[name] if name in plan else self.params[name]
            target.copy_(tensor)
            self.loaded_through_loader += 1

    def end_load(self, wrote_in_place: bool) -> None:
        _sync(self.device)

    def abandon_load(self) -> None:
        _sync(self.device)

    def digests(self, table: TensorTable) -> dict[str, str]:
        """Each trainer tensor's digest read from the parameters it landed in (fused rows included)."""
        layout = placement.layout_of(self.params.items())
        plan = placement.direct_plan(table, layout, self.fused_mapping())
        views = placement.resolve(plan, self.params)
        return {s.name: digests.digest(views[s.name]) for s in table if s.name in views}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _spec(name: str, tensor: torch.Tensor) -> Any:
    from weightsync.channels.wire import dtype_name
    from weightsync.tensors import TensorSpec

    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))


class HarnessEngine:
    """``lifecycle.EngineControl`` over ``Updater`` + ``HarnessModel``, in the agent's process."""

    def __init__(self, model: HarnessModel) -> None:
        self.model = model
        self.updater = Updater(model, WorkerContext(0, 1, str(model.device)))
        self.version = 0
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def is_paused(self) -> bool:
        return self.paused

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        self.updater.init(Rendezvous.from_dict(init_info))

    def start(self) -> None:
        self.updater.start()

    def update(self, update_info: dict[str, Any]) -> None:
        self.updater.receive(UpdateTicket.from_update_info(update_info))

    def finish(self, version: str) -> None:
        self.updater.finish()
        self.version = int(version)

    def reset_caches(self) -> None:
        """Nothing to drop: the harness computes nothing from tokens."""

    def receipt(self) -> Receipt:
        return self.updater.receipt

    def identity(self) -> list[Identity]:
        dev = self.model.device
        uuid = gpu.uuid(dev) if dev.type == "cuda" else ""
        return [Identity(0, 1, str(dev), uuid, importlib.util.find_spec("nixl") is not None)]

    def weight_version(self) -> str:
        return str(self.version) if self.version else "None"


def _record_digests(engine: HarnessEngine, out: Path, replica_id: str) -> None:
    """After each finish, write the digests of the parameters the version landed in (``out/<replica_id>.json``)."""
    model, original_finish = engine.model, engine.finish

    def finish_and_record(version: str) -> None:
        original_finish(version)
        receiver = engine.updater.receiver
        if receiver is not None and receiver.table is not None:
            record = {
                "version": int(version),
                "param_digests": model.digests(receiver.table),
                "in_place": len(receiver.in_place),
                "loader": model.loaded_through_loader,
            }
            tmp = out / f".{replica_id}.json"
            tmp.write_text(json.dumps(record))
            os.replace(tmp, out / f"{replica_id}.json")

    engine.finish = finish_and_record  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.vocabulary import Channel
    from weightsync_inference.agent import Agent, AgentConfig

    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--job", default="gpu-fleet")
    p.add_argument("--replica-id", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--model", default="qwen3-1.7b")
    p.add_argument("--channels", default="ipc,nccl,nixl,volume")
    p.add_argument("--nccl-domain", default="")
    p.add_argument("--volume", default="")
    p.add_argument("--node", default="gpu-host")
    p.add_argument(
        "--out",
        default="",
        help="write the parameters' digests after each version here (the test's check: a pass over the weights on "
        "the version's path, so the benchmark leaves it out)",
    )
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument(
        "--die-in-version", type=int, default=0, help="fault injection: exit hard as version N's transfer starts"
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)  # cpu: a dry run of the same processes with WEIGHTSYNC_NCCL_TRANSPORT=gloo
    if device.type == "cuda":
        device = gpu.cuda_device(device)
        torch.cuda.set_device(device)
    model = HarnessModel(
        {k: (v[0], tuple(v[1])) for k, v in plan_file(args.model)["layout"].items()},
        device,
        seed=abs(hash(args.replica_id)) % 1000,
    )
    engine = HarnessEngine(model)
    if args.out:
        _record_digests(engine, Path(args.out), args.replica_id)

    if args.die_in_version:
        place = engine.updater.place

        def place_then_die(table: TensorTable) -> Mapping[str, torch.Tensor]:
            views = place(table)
            if engine.updater._ticket is not None and engine.updater._ticket.version == args.die_in_version:
                os._exit(17)  # killed as the transfer starts: the sender has begun its broadcast
            return views

        engine.updater.place = place_then_die  # type: ignore[method-assign]
    config = AgentConfig(
        job=args.job,
        replica_id=args.replica_id,
        channels=tuple(Channel.parse(c) for c in args.channels.split(",") if c),
        host=args.node,
        volume=Path(args.volume) if args.volume else None,
        volume_id=args.job if args.volume else "",
        nccl_domain=args.nccl_domain,
        update_timeout_s=args.timeout,
    )
    client = CoordinatorClient(args.coordinator, insecure=True)
    agent = Agent(engine, client, config)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    channels = ",".join(c.value for c in agent.capabilities.channels)
    print(f"harness {args.replica_id} on {device}: receives {channels}", flush=True)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
