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
all of its weights as a decode step does) run back to back on GPU 1, steps per second with no
transfer and while versions stage back to back (never switched in). The trainer's sender runs
in a process of its own there, as a trainer does (``--sender-port``: that process's role, driven
over its stdin and stdout); ``--graph`` replays the stand-in as one CUDA graph, as vLLM's decode
runs, instead of launching it eagerly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import socket
import statistics
import subprocess
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
from weightsync.channels.base import Endpoint, Rendezvous, UpdateTicket, WorkerContext, direct_rendezvous  # noqa: E402
from weightsync.tensors import TensorTable  # noqa: E402
from weightsync.vocabulary import Channel  # noqa: E402
from weightsync_inference.receipts import Receipt  # noqa: E402
from weightsync_inference.staging import staging_bytes  # noqa: E402
from weightsync_inference.updates import Updater  # noqa: E402


def _rendezvous(port: int, secret: str, timeout_s: float) -> Rendezvous:
    """The one group of a trainer process and a replica process, as both build it from the same arguments."""
    endpoint = Endpoint("127.0.0.1", port)
    rdv = Rendezvous(Channel.NCCL, endpoint, "bench", secret, generation=1, rank=1, world_size=2)
    return rdv.with_timeout(timeout_s)


class _SenderProcess:
    """The trainer's sender in a process of its own (``--sender-port``): one line in per version, its digests out."""

    def __init__(self, model: str, device: str, timeout_s: float) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self.secret, self.timeout_s = secrets.token_hex(16), timeout_s
        args = ["--model", model, "--sender-port", str(self.port), "--sender-secret", self.secret]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": device.removeprefix("cuda:")}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def send(self, version: int, verify: bool) -> dict[str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{version} {int(verify)}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the sender process exited ({self.proc.wait(self.timeout_s)}) at version {version}")
        sent: dict[str, str] = json.loads(line)
        return sent

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(self.timeout_s)


def _send_version(
    sender: nccl.NcclSender, source: RandomSource, table: TensorTable, version: int, verify: bool
) -> dict[str, str]:
    """The trainer's part of one version: new random values, streamed; the digests of what it holds."""
    source.fill(seed=version)
    sender.send(UpdateTicket(version, Channel.NCCL, table, table.layout_digest(), verify=verify), source.groups())
    return {spec.name: digests.digest(t) for spec, t in zip(table, source.tensors, strict=True)}


def serve_sender(model: str, port: int, secret: str, timeout_s: float) -> int:
    """The sender process: stream a version of new random values per line on stdin; print their digests."""
    table = gpu_models.trainer_table(model)
    source = RandomSource(table, torch.device("cuda:0"))
    sender = nccl.NcclSender(device="cuda:0", port=port, timeout_s=timeout_s)
    sender.take_plan({"replica": _rendezvous(port, secret, timeout_s)})
    try:
        for line in sys.stdin:
            version, verify = (int(x) for x in line.split())
            print(json.dumps(_send_version(sender, source, table, version, bool(verify))), flush=True)
    finally:
        sender.close()
    return 0


class StagedPair:
    """A trainer's NCCL sender on one device and a harness replica's updater on another: in one process, or with
    ``remote`` the sender in a process of its own."""

    def __init__(
        self, model: str, sender: str, engine: str, timeout_s: float = 60.0, verify: bool = True, remote: bool = False
    ) -> None:
        self.table: TensorTable = gpu_models.trainer_table(model)
        self.verify, self.timeout_s = verify, timeout_s
        self.model = HarnessModel(gpu_models.engine_layout(model), torch.device(engine), seed=5)
        self.updater = Updater(self.model, WorkerContext(device=engine))
        self.remote = _SenderProcess(model, sender, timeout_s) if remote else None
        if self.remote is not None:
            rdv = _rendezvous(self.remote.port, self.remote.secret, timeout_s)
        else:
            self.source = RandomSource(self.table, torch.device(sender))
            self.sender = nccl.NcclSender(device=sender, timeout_s=timeout_s)
            rdv = direct_rendezvous(self.sender.offer(), join_timeout_s=60).with_timeout(timeout_s)
            self.sender.take_plan({"replica": rdv})
        joining = threading.Thread(target=self.updater.init, args=(rdv,))  # joins while the sender forms the group
        joining.start()
        joining.join(timeout_s)

    def ticket(self, version: int) -> UpdateTicket:
        layout = self.table.layout_digest()
        return UpdateTicket(version, Channel.NCCL, layout_digest=layout, verify=self.verify, timeout_s=self.timeout_s)

    def stage(self, version: int) -> dict[str, str]:
        """Stream ``version`` (new random values) into the replica's stage; the digests of what the trainer holds."""
        self.updater.stage(self.ticket(version), staging_bytes(self.table.total_bytes, len(self.table)))
        if self.remote is not None:
            digested = self.remote.send(version, self.verify)
        else:
            digested = _send_version(self.sender, self.source, self.table, version, self.verify)
        deadline = time.monotonic() + self.timeout_s
        while self.updater.stager.status.state == "receiving" and time.monotonic() < deadline:
            time.sleep(0.001)
        status = self.updater.stager.status
        if status.state != "staged":
            raise RuntimeError(f"version {version} was not staged: {status}")
        return digested

    def switch(self, version: int) -> Receipt:
        """What the replica does paused: the switch through the update lifecycle."""
        self.updater.start()
        self.updater.receive(dataclasses.replace(self.ticket(version), staged=True))
        self.updater.finish()
        return self.updater.receipt

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        else:
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

    def __init__(self, model: HarnessModel, batch: int = 8, graph: bool = False) -> None:
        self.device = model.device
        self.weights = [w for w in model.params.values() if w.dim() == 2]
        self.xs = [torch.randn(batch, w.shape[1], device=self.device, dtype=w.dtype) for w in self.weights]
        self.outs = [torch.empty(batch, w.shape[0], device=self.device, dtype=w.dtype) for w in self.weights]
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:  # captured before any stage runs, after a warm-up on a side stream (as vLLM captures)
            with torch.cuda.device(self.device):
                side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
                with torch.cuda.stream(side):
                    self._step()
                torch.cuda.current_stream(self.device).wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self._step()

    def _step(self) -> None:
        for x, w, o in zip(self.xs, self.weights, self.outs, strict=True):
            torch.matmul(x, w.t(), out=o)

    def steps_per_second(self, window_s: float) -> float:
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            t0, steps = time.perf_counter(), 0
            while time.perf_counter() - t0 < window_s:
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self._step()
                torch.cuda.synchronize(self.device)  # a decode step waits for its logits
                steps += 1
            return steps / (time.perf_counter() - t0)


def throughput(pair: StagedPair, window_s: float, graph: bool) -> dict[str, float]:
    """Decode stand-in steps/s on the replica's GPU: idle, then while versions stage back to back."""
    decode = DecodeStandIn(pair.model, graph=graph)
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
    p.add_argument("--graph", action="store_true", help="with --throughput: the stand-in replayed as a CUDA graph")
    p.add_argument("--json", default="", help="write the result here too")
    p.add_argument("--sender-port", type=int, default=0, help=argparse.SUPPRESS)  # the sender process's role
    p.add_argument("--sender-secret", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sender_port:
        return serve_sender(args.model, args.sender_port, args.sender_secret, timeout_s=60.0)
    engine = torch.device("cuda:1")
    pair = StagedPair(args.model, "cuda:0", "cuda:1", verify=args.verify, remote=bool(args.throughput))
    if args.throughput:
        try:
            kept = {
                "card": torch.cuda.get_device_name(engine),
                "model": args.model,
                "verify": args.verify,
                "graph": args.graph,
                "nccl_max_ctas": os.environ.get("NCCL_MAX_CTAS", "default"),
                **throughput(pair, args.throughput, args.graph),
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
