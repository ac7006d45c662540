"""Run a replica's agent: attach to a vLLM server and follow the coordinator.

The agent is the only client of vLLM's development-mode routes (pause, the weight
transfer lifecycle), which vLLM serves on localhost only; see docs/serving.md. It
registers the replica with the coordinator, loads each version it is assigned
(catching up from the checkpoint volume first when it joins late), acks, and serves
its own /metrics (version, lag, sync durations).

Example (one pod's sidecar, or one process on a workstation):

  weightsync agent --vllm-url http://127.0.0.1:8001 --coordinator coordinator:50051 \\
      --job my-job --replica-id $POD_NAME --checkpoint-dir /checkpoints --token-file /var/run/secrets/token
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-url", default="http://127.0.0.1:8001", help="the vLLM server (loopback only)")
    p.add_argument("--coordinator", required=True, help="coordinator HOST:PORT")
    p.add_argument("--job", default="default", help="job name")
    p.add_argument("--replica-id", default=os.environ.get("POD_NAME") or socket.gethostname(), help="this replica's id")
    p.add_argument("--checkpoint-dir", default=None, help="the checkpoint volume's mount (catch-up and recovery)")
    p.add_argument("--channels", default="cpu,volume", help="channels this replica can receive (default cpu,volume)")
    p.add_argument("--host", default=socket.gethostname(), help="host name reported to the coordinator")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    p.add_argument("--update-timeout", type=float, default=300.0, help="seconds one update may take (default 300)")
    p.add_argument("--wait-vllm", type=float, default=600.0, help="seconds to wait for vLLM to become healthy")
    p.add_argument("--token-file", default=None, help="bearer token file (or WEIGHTSYNC_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="CA that signed the coordinator's certificate")
    p.add_argument("--insecure", action="store_true", help="plaintext to the coordinator: local runs only")


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from weightsync import metrics
    from weightsync.coordinator import auth, models, tls
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.vocabulary import Channel
    from weightsync_inference.agent import Agent, AgentConfig
    from weightsync_inference.http_engine import HttpEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = HttpEngine(args.vllm_url, transfer_timeout_s=args.update_timeout)
    deadline = time.monotonic() + args.wait_vllm
    while not engine.healthy():
        if time.monotonic() > deadline:
            print(f"vLLM at {args.vllm_url} is not healthy after {args.wait_vllm:.0f}s", file=sys.stderr)
            return 1
        time.sleep(1.0)
    channels = tuple(Channel.parse(c) for c in args.channels.split(",") if c)
    volume = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    caps = models.Capabilities(
        host=args.host,
        channels=channels,
        engine=models.EngineKind.CPU,
        volume_id="shared" if volume else "",
        volume_mount=str(volume or ""),
    )
    client = CoordinatorClient(
        args.coordinator,
        token=auth.load_token(args.token_file),
        tls=None if args.insecure else tls.TlsConfig(ca_file=args.tls_ca),
        insecure=args.insecure,
    )
    agent_metrics = metrics.AgentMetrics.create()
    if args.metrics_port is not None:
        server = metrics.serve(args.metrics_port, args.metrics_host)
        print(f"metrics: {server.url}", flush=True)
    agent = Agent(
        engine, client, AgentConfig(args.job, args.replica_id, caps, volume, args.update_timeout), agent_metrics
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    print(f"agent {args.replica_id}: following {args.coordinator} for job {args.job}", flush=True)
    agent.run()
    return 0
