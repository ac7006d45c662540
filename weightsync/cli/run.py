"""Run a trainer command against a fleet on this machine, with the environment an RLJob's trainer pod gets.

Starts the coordinator and ``--replicas`` vLLM CPU replicas (each with its agent and its
OpenAI-only proxy, as ``weightsync demo`` does), one OpenAI endpoint in front of them, then
runs the command after ``--`` with what the operator injects into a trainer pod:
``WEIGHTSYNC_COORDINATOR``, ``WEIGHTSYNC_CONFIG``, ``WEIGHTSYNC_CHECKPOINT_DIR``,
``WEIGHTSYNC_OPENAI_URL``, ``POD_NAME``, ``POD_IP``, ``NODE_NAME``, ``RANK`` (and
``WEIGHTSYNC_INSECURE=1``: no TLS on loopback), plus ``WEIGHTSYNC_MODEL``, the model folder the
replicas serve. So ``Publisher.from_env`` and the framework integrations
(``weightsync_trainer.integrations``) work unchanged, e.g.::

    weightsync run -- python examples/integrations/trl_grpo.py

Exits with the command's exit code; the fleet is stopped either way (its logs stay in
``--workdir``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXIT_USAGE = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="vLLM CPU replicas (default 2)")
    p.add_argument(
        "--preset", default="tiny-qwen2", help="generated model preset the replicas serve (default tiny-qwen2)"
    )
    p.add_argument("--model", default=None, help="a model folder to serve instead of a generated preset")
    p.add_argument("--workdir", default=None, help="where the volume and the logs go (default: a temporary folder)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the trainer command, after --")


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print(
            "weightsync run: give the trainer command after --, e.g. `weightsync run -- python train.py`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    from weightsync import served
    from weightsync.cli._endpoint import Endpoint
    from weightsync.cli._localfleet import LocalFleet, free_port
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync_trainer import tiny_models

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="weightsync-run-"))
    model = Path(args.model) if args.model else tiny_models.generate(args.preset)
    fleet = LocalFleet(workdir, model)
    endpoint: Endpoint | None = None
    print(f"weightsync run: work dir {workdir}; model {model}", file=sys.stderr, flush=True)
    try:
        fleet.start_coordinator()
        replicas = [fleet.start_replica(f"replica-{i}") for i in range(args.replicas)]
        t0 = time.perf_counter()
        fleet.wait_healthy(replicas, timeout_s=900)
        with CoordinatorClient(fleet.coordinator_address, insecure=True, timeout_s=60.0) as client:
            fleet.wait_registered(client, timeout_s=120)
        endpoint = Endpoint(f"127.0.0.1:{free_port()}", [f"127.0.0.1:{r.proxy_port}" for r in replicas])
        endpoint.start()
        print(
            f"weightsync run: coordinator and {len(replicas)} replicas up in {time.perf_counter() - t0:.0f}s; "
            f"OpenAI endpoint http://{endpoint.listen}",
            file=sys.stderr,
            flush=True,
        )
        env = {
            **os.environ,
            **fleet.env,
            "WEIGHTSYNC_COORDINATOR": fleet.coordinator_address,
            "WEIGHTSYNC_INSECURE": "1",
            "WEIGHTSYNC_CHECKPOINT_DIR": str(fleet.volume),
            served.OPENAI_URL_ENV: f"http://{endpoint.listen}",
            "WEIGHTSYNC_MODEL": str(model),
            "POD_NAME": "trainer-0",
            "POD_IP": "127.0.0.1",
            "NODE_NAME": "localhost",
            "RANK": "0",
        }
        return subprocess.run(command, env=env, check=False).returncode
    finally:
        if endpoint is not None:
            endpoint.stop()
        fleet.stop()
