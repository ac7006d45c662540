"""Staged mode's switch on the GPU host: how long a replica pauses to put a staged version in place.

A trainer on GPU 0 streams each version over NCCL into the stage of a replica on GPU 1
(``weightsync_inference.staging`` through ``updates.Updater``, the code vLLM's weightsync
engine runs) holding Qwen3's vLLM parameter layout (``tests/gpu/harness.HarnessModel``);
then the switch copies the stage into the parameters. The pause a replica's clients see
in staged mode is that switch (plus vLLM's pause/resume calls, not on this host); the
baseline, in the same run, is one flat device copy of the same bytes on GPU 1.

    bash tools/gpu-host.sh python3 bench/staged_switch.py --model qwen3-1.7b --json out.json

``--throughput`` measures instead what generation keeps while versions stage: a decode step's
stand-in (a batch of 8 activations multiplied by every weight matrix of the replica, reading
all of its weights as a decode step does, launched eagerly) run back to back on GPU 1,
steps per second with no transfer and while versions stage back to back (never switched in).
The trainer's sender shares this process (and its Python interpreter) with the replica here.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import gpu_models, report  # noqa: E402
from tests.gpu.fleet_trainer import RandomSource  # noqa: E402
from tests.gpu.harness import HarnessModel  # noqa: E402
from weightsync.channels import digests, nccl  # noqa: E402
from weightsync.channels.base import UpdateTicket, WorkerContext, direct_rendezvous  # noqa: E402
from weightsync.tensors import TensorTable  # noqa: E402
from weightsync.vocabulary import Channel  # noqa: E402
from weightsync_inference.receipts import Receipt  # noqa: E402
from weightsync_inference.staging import STAGED_PARAM, staging_bytes  # noqa: E402
from weightsync_inference.updates import Updater  # noqa: E402


class StagedPair:
    """A trainer's NCCL sender on one device and a harness replica's updater on another, in one process."""

    def __init__(self, model: str, sender: str, engine: str, timeout_s: float = 60.0, verify: bool = True) -> None:
        self.table: TensorTable = gpu_models.trainer_table(model)
        self.verify, self.timeout_s = verify, timeout_s
        self.source = RandomSource(self.table, torch.device(sender))
        self.model = HarnessModel(gpu_models.engine_layout(model), torch.device(engine), seed=5)
        self.updater = Updater(self.model, WorkerContext(device=engine))
        self.sender = nccl.NcclSender(device=sender, timeout_s=timeout_s)
        rdv = direct_rendezvous(self.sender.offer()).with_timeout(timeout_s)
        self.sender.take_plan({"replica": rdv})
        joining = threading.Thread(target=self.updater.init, args=(rdv,))  # joins while the sender forms the group
        joining.start()
        joining.join(timeout_s)

    def ticket(self, version: int) -> UpdateTicket:
        layout = self.table.layout_digest()
        return UpdateTicket(version, Channel.NCCL, layout_digest=layout, verify=self.verify, timeout_s=self.timeout_s)

    def stage(self, version: int) -> dict[str, str]:
        """Stream ``version`` (new random values) into the replica's stage; the digests of what the trainer holds."""
        self.source.fill(seed=version)
        self.updater.stage(self.ticket(version), staging_bytes(self.table.total_bytes, len(self.table)))
        sent = UpdateTicket(version, Channel.NCCL, self.table, self.table.layout_digest(), verify=self.verify)
        self.sender.send(sent, self.source.groups())
        deadline = time.monotonic() + self.timeout_s
        while self.updater.stager.status.state == "receiving" and time.monotonic() < deadline:
            time.sleep(0.001)
        status = self.updater.stager.status
        if status.state != "staged":
            raise RuntimeError(f"version {version} was not staged: {status}")
        return {spec.name: digests.digest(t) for spec, t in zip(self.table, self.source.tensors, strict=True)}

    def switch(self, version: int) -> Receipt:
        """What the replica does paused: the switch through the update lifecycle."""
        self.updater.start()
        self.updater.receive(dataclasses.replace(self.ticket(version), params={STAGED_PARAM: True}))
        self.updater.finish()
        return self.updater.receipt

    def close(self) -> None:
        self.sender.close()
        self.updater.close()


def _timed(fn: object, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


class DecodeStandIn:
    """``x @ W.T`` for every weight matrix of ``model`` with a batch of 8: a decode step's weight reads."""

    def __init__(self, model: HarnessModel, batch: int = 8) -> None:
        self.device = model.device
        self.weights = [w for w in model.params.values() if w.dim() == 2]
        self.xs = [torch.randn(batch, w.shape[1], device=self.device, dtype=w.dtype) for w in self.weights]
        self.outs = [torch.empty(batch, w.shape[0], device=self.device, dtype=w.dtype) for w in self.weights]

    def steps_per_second(self, window_s: float) -> float:
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            t0, steps = time.perf_counter(), 0
            while time.perf_counter() - t0 < window_s:
                for x, w, o in zip(self.xs, self.weights, self.outs, strict=True):
                    torch.matmul(x, w.t(), out=o)
                torch.cuda.synchronize(self.device)  # a decode step waits for its logits
                steps += 1
            return steps / (time.perf_counter() - t0)


def throughput(pair: StagedPair, window_s: float) -> dict[str, float]:
    """Decode stand-in steps/s on the replica's GPU: idle, then while versions stage back to back."""
    decode = DecodeStandIn(pair.model)
    idle = decode.steps_per_second(window_s)
    stop, staged = threading.Event(), [0]

    def stage_forever() -> None:
        version = 100
        while not stop.is_set():
            pair.stage(version)
            staged[0] += 1
            version += 1

    stager = threading.Thread(target=stage_forever, daemon=True)
    stager.start()
    time.sleep(0.5)  # the first stage under way
    busy = decode.steps_per_second(window_s)
    stop.set()
    stager.join(120)
    return {"idle_steps_per_s": idle, "staging_steps_per_s": busy, "ratio": busy / idle, "staged": staged[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(gpu_models.MODELS))
    p.add_argument("--versions", type=int, default=10, help="timed versions after one warm-up (default 10)")
    p.add_argument("--verify", action="store_true", help="full verification on (default off, as the fleet rows)")
    p.add_argument(
        "--throughput",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="measure generation's stand-in idle and while staging, for this many seconds each",
    )
    p.add_argument("--json", default="", help="write the result here too")
    args = p.parse_args()
    engine = torch.device("cuda:1")
    pair = StagedPair(args.model, "cuda:0", "cuda:1", verify=args.verify)
    if args.throughput:
        try:
            kept = {
                "card": torch.cuda.get_device_name(engine),
                "model": args.model,
                "verify": args.verify,
                **throughput(pair, args.throughput),
            }
        finally:
            pair.close()
        report.emit(kept, args.json)
        return 0
    switches: list[float] = []
    try:
        for version in range(1, args.versions + 2):
            pair.stage(version)
            seconds = _timed(lambda v=version: pair.switch(v), engine)
            if version > 1:
                switches.append(seconds)
        nbytes = pair.table.total_bytes
        src = torch.empty(nbytes, dtype=torch.uint8, device=engine)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=engine)
        raw = [_timed(lambda: flat.copy_(src), engine) for _ in range(args.versions + 1)][1:]
    finally:
        pair.close()
    result = {
        "card": torch.cuda.get_device_name(engine),
        "model": args.model,
        "bytes": pair.table.total_bytes,
        "verify": args.verify,
        "switch_s_median": statistics.median(switches),
        "raw_copy_s_median": statistics.median(raw),
    }
    result["ratio"] = result["switch_s_median"] / result["raw_copy_s_median"]
    report.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
