"""Run a replica's agent: attach to a vLLM server and follow the coordinator.

The agent is the only client of vLLM's development-mode routes (pause, the weight
transfer lifecycle, ``/collective_rpc``), which vLLM serves on localhost only; see
docs/serving.md. It asks vLLM's workers what they are (CPU or GPU engine, GPU UUIDs,
tensor-parallel size, NIXL) and what version they serve, registers the replica with
the job's channels it can receive, loads each version it is assigned (catching up
from the checkpoint volume first when it joins late), acks what the engine computed
while loading, and serves its own /metrics (version, lag, sync durations) and, on loopback,
what the replica serves (GET /served: the versions its engine may be generating with and
whether it is paused or torn), which the proxy reads for every completion instead of asking
vLLM, whose engine loop an update holds.

The job's channels and NCCL domain come from the job config ($WEIGHTSYNC_CONFIG, the
job.json the operator mounts) unless flags say otherwise; the node from $NODE_NAME.
SIGUSR1 writes every thread's stack to stderr (where a stuck agent is).

Example (one pod's sidecar, or one process on a workstation):

  weightsync agent --vllm-url http://127.0.0.1:8001 --coordinator coordinator:50051 \\
      --job my-job --replica-id $POD_NAME --checkpoint-dir /checkpoints --token-file /var/run/secrets/token
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

DEFAULT_SERVED_PORT = 8002
"""Where the agent serves what its replica serves (``--served-listen``; the proxy's ``--agent``): vLLM has 8001."""

if TYPE_CHECKING:
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.metrics import AgentMetrics
    from weightsync_inference.agent import Agent, AgentConfig
    from weightsync_inference.http_engine import HttpEngine
    from weightsync_inference.served import Board


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-url", default="http://127.0.0.1:8001", help="the vLLM server (loopback only)")
    p.add_argument(
        "--coordinator",
        default=os.environ.get("WEIGHTSYNC_COORDINATOR"),
        help="coordinator HOST:PORT (default $WEIGHTSYNC_COORDINATOR)",
    )
    p.add_argument("--job-config", default=os.environ.get("WEIGHTSYNC_CONFIG"), help="job.json ($WEIGHTSYNC_CONFIG)")
    p.add_argument("--job", default=None, help="job name (default: the job config's)")
    p.add_argument("--replica-id", default=os.environ.get("POD_NAME") or socket.gethostname(), help="this replica's id")
    p.add_argument("--checkpoint-dir", default=None, help="the checkpoint volume's mount (catch-up and recovery)")
    p.add_argument(
        "--channels",
        default=None,
        help="the job's channels, in preference order (default: the job config's, else "
        "cpu,volume); the replica declares those its engine can receive",
    )
    p.add_argument("--nccl-domain", default=None, help="NCCL domain (default: the job config's)")
    p.add_argument("--volume-id", default=None, help="name of the shared checkpoint volume (default: the job name)")
    p.add_argument(
        "--host",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="the node this replica runs on (default $NODE_NAME)",
    )
    p.add_argument(
        "--served-listen",
        default=f"127.0.0.1:{DEFAULT_SERVED_PORT}",
        help=f"HOST:PORT for GET /served, what the replica serves (the proxy's --agent; default "
        f"127.0.0.1:{DEFAULT_SERVED_PORT})",
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    p.add_argument(
        "--update-timeout",
        type=float,
        default=None,
        help="seconds one update may take, and a stalled transfer "
        "(default: the job config's transferTimeoutSeconds, else 300)",
    )
    p.add_argument(
        "--pause-mode",
        choices=["keep", "wait", "abort"],
        default=None,
        help="what an update's pause does with requests in flight: keep (continue on the new weights), wait "
        "(finish on the old ones first), abort (default: the job config's, else keep)",
    )
    p.add_argument(
        "--sync-mode",
        choices=["in-place", "staged"],
        default=None,
        help="in-place: pause for the whole transfer and load; staged: receive beside generation into a second "
        "copy of the weights, pause only to switch it in (default: the job config's, else in-place)",
    )
    p.add_argument(
        "--wait-vllm",
        type=float,
        default=600.0,
        help="seconds to wait for vLLM to become healthy and its workers to answer (default 600)",
    )
    p.add_argument("--token-file", default=None, help="bearer token file (or WEIGHTSYNC_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="CA that signed the coordinator's certificate")
    p.add_argument("--insecure", action="store_true", help="plaintext to the coordinator: local runs only")


def run(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from weightsync import jobconfig, metrics
    from weightsync.cli.proxy import parse_listen
    from weightsync.coordinator import auth, tls
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.errors import WeightsyncError
    from weightsync.vocabulary import Channel, PauseMode, SyncMode
    from weightsync_inference import served
    from weightsync_inference.agent import AgentConfig
    from weightsync_inference.http_engine import HttpEngine

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # every thread's stack to stderr, waiting included
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call to vLLM is noise, errors are not
    if not args.coordinator:
        print("weightsync agent: no --coordinator and no $WEIGHTSYNC_COORDINATOR", file=sys.stderr)
        return 2
    try:
        job = jobconfig.load(args.job_config) if args.job_config else None
        channels = (
            tuple(Channel.parse(c) for c in args.channels.split(",") if c)
            if args.channels
            else (job.channels if job else (Channel.CPU, Channel.VOLUME))
        )
    except (WeightsyncError, ValueError) as e:
        print(f"weightsync agent: {e}", file=sys.stderr)
        return 2
    job_name = args.job or (job.job if job else "default")
    update_timeout = args.update_timeout or (job.transfer_timeout_s if job else 300.0)
    pause_mode = PauseMode(args.pause_mode) if args.pause_mode else (job.pause_mode if job else PauseMode.KEEP)
    sync_mode = SyncMode(args.sync_mode) if args.sync_mode else (job.sync_mode if job else SyncMode.IN_PLACE)
    engine = HttpEngine(args.vllm_url, transfer_timeout_s=update_timeout, pause_mode=pause_mode)
    volume = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    config = AgentConfig(
        job=job_name,
        replica_id=args.replica_id,
        channels=channels,
        host=args.host,
        volume=volume,
        volume_id=args.volume_id or job_name,
        nccl_domain=args.nccl_domain if args.nccl_domain is not None else (job.nccl_domain if job else ""),
        update_timeout_s=update_timeout,
        sync_mode=sync_mode,
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
    board = served.Board()  # served at once: until the agent has taken the engine over it says "starting"
    print(f"served: {served.serve(board, *parse_listen(args.served_listen, '--served-listen')).url}", flush=True)
    try:
        agent = _attach(engine, client, config, agent_metrics, args.wait_vllm, board)
    except WeightsyncError as e:  # a vLLM it cannot drive (no worker extension, no weightsync engine): say why
        print(f"weightsync agent: {e}", file=sys.stderr)
        return 2
    if agent is None:
        print(f"vLLM at {args.vllm_url} is not ready after {args.wait_vllm:.0f}s", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    caps = agent.capabilities
    print(
        f"agent {args.replica_id}: following {args.coordinator} for job {job_name}; {caps.engine.value} engine, "
        f"{caps.devices} worker(s), receives {','.join(c.value for c in caps.channels)}",
        flush=True,
    )
    return 0 if agent.run() else 1


def _attach(
    engine: HttpEngine,
    client: CoordinatorClient,
    config: AgentConfig,
    agent_metrics: AgentMetrics,
    wait_s: float,
    board: Board,
) -> Agent | None:
    """The agent once vLLM is healthy and its workers answer (what they serve, who they are), or None after
    ``wait_s``. vLLM answers ``/health`` before a loaded machine lets its workers answer every call in time: a
    call that times out at startup is waited out here, not fatal."""
    import logging

    from weightsync.errors import RetryableError
    from weightsync_inference.agent import Agent

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if engine.healthy():
            try:
                return Agent(engine, client, config, agent_metrics, board)
            except RetryableError as e:
                logging.getLogger(__name__).warning(
                    "replica %s: vLLM is up but its workers do not answer yet: %s", config.replica_id, e
                )
        time.sleep(1.0)
    return None
