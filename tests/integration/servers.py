"""A served replica for the integration tests: vLLM's OpenAI server in dev mode on 127.0.0.1, the proxy in front
of it, and a board (what the replica serves, as the agent would serve it) that the test's ``Replica`` keeps.

The test drives the replica itself (``Replica(HttpEngine(url), board=...)``) rather than through an agent, so it
can take the engine through each lifecycle path in turn; the proxy reads the same board the agent would serve.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from tests import support
from weightsync.channels import manifests
from weightsync.channels.base import UpdateTicket
from weightsync.channels.volume import VolumeSender
from weightsync.tensors import TensorTable, manifest_checksum
from weightsync.vocabulary import Channel
from weightsync_inference import served
from weightsync_trainer.publisher import send
from weightsync_trainer.sources import ModuleSource

START_TIMEOUT_S = 240.0
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], log: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # own session: teardown ends the server and every process it spawned, and only those
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, path: str = "/health") -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}{path}", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy within {START_TIMEOUT_S:.0f}s:\n{log.read_text()[-4000:]}")


@dataclass
class Server:
    url: str
    """vLLM itself (loopback, dev routes)."""
    proxy_url: str
    """What clients use."""
    board: served.Board
    log: Path


@contextlib.contextmanager
def running(
    work: Path, model: Path, *, extension: str, extra: tuple[str, ...] = (), update_wait_s: float = 600.0
) -> Iterator[Server]:
    """vLLM (started for ``weightsync-volume``, with the worker ``extension``), a board and the proxy, until exit."""
    port, proxy_port = free_port(), free_port()
    url, proxy_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{proxy_port}"
    board = served.Board()
    agent = served.serve(board, "127.0.0.1", 0)
    # the repository on the path: the workers load the test's extension (the product's plus test faults)
    env = {**support.env_without_proxies(), "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(ROOT)}
    vllm_cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port), "--model", str(model),
        "--dtype", "bfloat16", "--enforce-eager", "--gpu-memory-utilization", "0.1", "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": Channel.VOLUME.engine_name}),
        "--worker-extension-cls", extension, *extra,
    ]  # fmt: skip
    # the proxy command module alone (its add_arguments/run, as `weightsync proxy` calls them), so a
    # half-added command elsewhere in the shared CLI cannot break the fixture
    run_proxy = (
        "import argparse, sys; from weightsync.cli import proxy; p = argparse.ArgumentParser(); "
        "proxy.add_arguments(p); sys.exit(proxy.run(p.parse_args()))"
    )
    proxy_cmd = [
        sys.executable, "-c", run_proxy, "--listen", f"127.0.0.1:{proxy_port}", "--upstream", url,
        "--agent", agent.url, "--update-wait", str(update_wait_s),
    ]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start(vllm_cmd, work / "vllm.log", work, env))
        procs.append(start(proxy_cmd, work / "proxy.log", work, support.env_without_proxies()))
        wait_healthy(url, procs[0], work / "vllm.log")
        yield Server(url, proxy_url, board, work / "vllm.log")
    finally:
        for proc in reversed(procs):
            stop(proc)
        agent.close()


def publish(root: Path, folder: Path, version: int, seed: int) -> tuple[UpdateTicket, torch.nn.Module, TensorTable]:
    """A trained model written to the volume as ``version``: the ticket a replica gets for it (layout digest, manifest
    checksum), the trainer's model, and its table."""
    trainer = support.hf_trainer(folder, seed=seed)
    source = ModuleSource(trainer)
    table = source.table()
    send(source, VolumeSender(root), UpdateTicket(version, Channel.VOLUME, table, step=version))
    checksum = manifest_checksum(manifests.manifest_path(root, version).read_bytes())
    ticket = UpdateTicket(version, Channel.VOLUME, layout_digest=table.layout_digest(), manifest_checksum=checksum)
    return ticket, trainer, table


def metric(url: str, name: str) -> float:
    """One of vLLM's own counters or gauges from its ``/metrics`` (summed over its label sets)."""
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " "))]
    if not values:
        raise AssertionError(f"vLLM's /metrics has no {name}")
    return sum(values)
