"""Generation throughput of a served vLLM CPU replica while versions are staged beside it.

One vLLM OpenAI server (the local fleet's, the volume engine) serves a steady load of greedy
completions from ``--clients`` concurrent clients. Three windows of ``--window`` seconds, in
one run: no update (the baseline); versions staged back to back (received into the stage
beside generation, never switched in: what a replica's clients get while a transfer runs);
versions loaded in place back to back (each pauses the server for the transfer and load).
Tokens per second in each, and the ratios to the baseline.

    .venv/bin/python bench/staged_throughput.py --json out.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from tests import support  # noqa: E402
from weightsync.channels import manifests  # noqa: E402
from weightsync.channels.base import Rendezvous, UpdateTicket  # noqa: E402
from weightsync.channels.volume import VolumeSender  # noqa: E402
from weightsync.cli._localfleet import VLLM_ENV, free_port, spawn, vllm_cmd  # noqa: E402
from weightsync.coordinator.models import summarize  # noqa: E402
from weightsync.tensors import manifest_checksum  # noqa: E402
from weightsync.vocabulary import Channel  # noqa: E402
from weightsync_inference.http_engine import HttpEngine  # noqa: E402
from weightsync_inference.lifecycle import Replica  # noqa: E402
from weightsync_inference.staging import staging_bytes  # noqa: E402
from weightsync_trainer.publisher import send  # noqa: E402
from weightsync_trainer.sources import ModuleSource  # noqa: E402


def _versions(root: Path, folder: Path, count: int) -> tuple[list[UpdateTicket], int]:
    """``count`` versions written to the volume; their tickets and the stage size they need."""
    tickets, nbytes = [], 0
    for version in range(1, count + 1):
        source = ModuleSource(support.hf_trainer(folder, seed=version))
        table = source.table()
        send(source, VolumeSender(root), UpdateTicket(version, Channel.VOLUME, table, step=version))
        checksum = manifest_checksum(manifests.manifest_path(root, version).read_bytes())
        tickets.append(
            UpdateTicket(version, Channel.VOLUME, layout_digest=table.layout_digest(), manifest_checksum=checksum)
        )
        summary = summarize(table)
        nbytes = staging_bytes(summary.total_bytes, summary.tensor_count)
    return tickets, nbytes


def _tokens_per_second(
    url: str, clients: int, window_s: float, updates: Callable[[threading.Event], int]
) -> tuple[float, int]:
    """Completion tokens per second over ``window_s`` under ``clients`` steady clients, while ``updates`` runs."""
    body = {"prompt": support.PROMPTS[0], "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    stop, counts = threading.Event(), [0] * clients

    def client(i: int) -> None:
        with httpx.Client(base_url=url, trust_env=False, timeout=120) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json=body)
                r.raise_for_status()
                if not stop.is_set():
                    counts[i] += int(r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # warm: every client has a request in flight
    counts[:] = [0] * clients
    done = [0]
    worker = threading.Thread(target=lambda: done.__setitem__(0, updates(stop)), daemon=True)
    t0 = time.monotonic()
    worker.start()
    time.sleep(window_s)
    stop.set()
    elapsed = time.monotonic() - t0
    worker.join(120)
    for t in threads:
        t.join(120)
    return sum(counts) / elapsed, done[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--window", type=float, default=20.0, help="seconds per window (default 20)")
    p.add_argument("--json", default="", help="write the result here too")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="weightsync-staged-bench-"))
    folder, root, port = support.tiny_model(), work / "volume", free_port()
    tickets, nbytes = _versions(root, folder, 4)
    url = f"http://127.0.0.1:{port}"
    proc = spawn("vllm", vllm_cmd(folder, port, Channel.VOLUME), work, VLLM_ENV)
    try:
        engine = HttpEngine(url)
        deadline = time.monotonic() + 300
        while not engine.healthy():
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start: see {work / 'vllm.log'}")
            time.sleep(1)
        replica = Replica(engine)
        replica.init_transfer(Rendezvous(Channel.VOLUME, root=str(root)).to_dict())
        replica.apply(tickets[0])  # warm the load path once

        def staging(stop: threading.Event) -> int:
            n = 0
            while not stop.is_set():
                ticket = tickets[1 + n % (len(tickets) - 1)]
                replica.stage(ticket, nbytes)
                while engine.stage_status().state == "receiving":
                    time.sleep(0.01)
                n += 1
            return n

        def in_place(stop: threading.Event) -> int:
            n = 0
            while not stop.is_set():
                replica.apply(tickets[n % len(tickets)])
                n += 1
            return n

        idle, _ = _tokens_per_second(url, args.clients, args.window, lambda stop: 0)
        staged, stages = _tokens_per_second(url, args.clients, args.window, staging)
        loaded, loads = _tokens_per_second(url, args.clients, args.window, in_place)
    finally:
        proc.stop()
    result = {
        "machine": "dev VM (CPU)",
        "clients": args.clients,
        "window_s": args.window,
        "tokens_per_s": {"idle": idle, "staging": staged, "in_place": loaded},
        "versions": {"staged": stages, "loaded_in_place": loads},
        "ratio_to_idle": {"staging": staged / idle, "in_place": loaded / idle},
    }
    report.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
