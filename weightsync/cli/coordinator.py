"""Run the coordinator: the control plane that turns a trainer and many replicas into one fleet.

Trainers and replica agents register here with what they can send or receive; the
publisher opens each version and gets a channel plan per replica; replicas watch
for plans, report ready and ack; a version is READY when the ack policy is met.
With --volume the coordinator journals versions on the checkpoint volume and
recovers READY state from its manifests after a restart.

Secure by default: it needs --tls-cert/--tls-key and a bearer token (--token-file
or WEIGHTSYNC_TOKEN); --insecure serves plaintext for local runs. It listens on
127.0.0.1 unless --host says otherwise.

examples:
  weightsync coordinator --insecure --port 50051 --metrics-port 9400 --volume /tmp/ckpt
  weightsync coordinator --tls-cert tls.crt --tls-key tls.key --tls-client-ca ca.crt \\
      --token-file /var/run/secrets/weightsync/token --host 0.0.0.0 --volume my-job=/ckpt
  weightsync coordinator --status --insecure --job my-job --json   # ask a running coordinator
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

CHANNELS = "ipc, nccl, nixl, cpu, volume"


def add_arguments(p: argparse.ArgumentParser) -> None:
    net = p.add_argument_group("listening")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1 only)")
    net.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one; default: 50051)")
    net.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    net.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default: 127.0.0.1)")
    sec = p.add_argument_group("security (TLS and a bearer token are required unless --insecure)")
    sec.add_argument("--tls-cert", default=None, help="server certificate (PEM)")
    sec.add_argument("--tls-key", default=None, help="server private key (PEM)")
    sec.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA (mTLS)")
    sec.add_argument("--tls-ca", default=None, help="with --status: the CA that signed the server's certificate")
    sec.add_argument("--token-file", default=None, help="file holding the shared bearer token (or WEIGHTSYNC_TOKEN)")
    sec.add_argument("--insecure", action="store_true", help="plaintext, token optional: for local runs only")
    sec.add_argument("--max-message-bytes", type=int, default=4 << 20, help="largest request accepted (default 4 MiB)")
    job = p.add_argument_group("jobs and versions")
    job.add_argument(
        "--job-config",
        default=os.environ.get("WEIGHTSYNC_CONFIG", ""),
        help="the job's job.json (default $WEIGHTSYNC_CONFIG): its channels, ack policy, timeout and retention "
        "become the job's policy and its name the default --job (the flags below apply without one)",
    )
    job.add_argument("--job", default="", help="job a bare --volume PATH belongs to, and --status's job")
    job.add_argument(
        "--volume",
        default="",
        help="checkpoint volume root(s): PATH or JOB=PATH[,JOB=PATH...]; "
        "enables the version journal and recovery after a restart",
    )
    job.add_argument(
        "--kubernetes-namespace",
        default="",
        help="mirror versions into WeightVersion objects in this namespace (in-cluster credentials, else "
        "KUBECONFIG) and recover READY state from them after a restart",
    )
    job.add_argument("--lease-ttl", type=float, default=10.0, help="seconds a member may go without renewing")
    job.add_argument("--version-timeout", type=float, default=600.0, help="seconds a version may stay STAGING")
    job.add_argument("--ack-quorum", type=int, default=0, help="acks that make a version READY (0: all live replicas)")
    job.add_argument(
        "--ready-without-acks",
        action="store_true",
        help="a version planned for no replica is READY (default: FAILED, since no replica acked it)",
    )
    job.add_argument(
        "--all-or-nothing",
        action="store_true",
        help="replicas stage each version and switch it in only once the ack policy's replicas staged it; "
        "otherwise it fails and none switches",
    )
    job.add_argument("--channel-preference", default="", help=f"default channel order, comma-separated ({CHANNELS})")
    job.add_argument(
        "--max-workers",
        type=int,
        default=640,
        help="gRPC worker threads (each watching replica holds one; default 640)",
    )
    p.add_argument("--status", action="store_true", help="do not serve: print a running coordinator's job status")
    p.add_argument("--json", action="store_true", help="print status (or the startup record) as one JSON object")
    p.add_argument("-v", "--verbose", action="store_true", help="log every version transition")


def _volumes(spec: str, default_job: str) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        job, sep, path = item.partition("=")
        out[job if sep else default_job] = Path(path if sep else job)
    return out


def _fail(message: str) -> int:
    print(f"weightsync coordinator: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import logging

    from weightsync.errors import WeightsyncError

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _status(args) if args.status else _serve(args)
    except WeightsyncError as e:
        return _fail(str(e))


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (as ``MALLOC_ARENA_MAX=2`` would), unless the environment already sets it.

    gRPC serves each call on a pool thread, and glibc gives new threads their own arenas
    (up to 8 per core); with hundreds of replicas renewing leases, the coordinator's
    resident memory then crept up by about 1% a minute in the lease soak without any
    Python-level growth (tracemalloc flat). Two arenas stopped the creep there.
    """
    import contextlib
    import ctypes
    import ctypes.util
    import os

    if os.environ.get("MALLOC_ARENA_MAX") or not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("c")
    if name:
        # not glibc (musl has no arenas to cap): nothing to do
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(name).mallopt(-8, arenas)  # M_ARENA_MAX


def _policy(args: argparse.Namespace) -> Any:
    """The default job policy: from the job config when there is one, else from the flags."""
    from weightsync import jobconfig
    from weightsync.coordinator import models
    from weightsync.vocabulary import Channel

    config = jobconfig.load(args.job_config) if args.job_config else None
    if config is not None:
        args.job = args.job or config.job
        return models.JobPolicy.of(config)
    preference = models.DEFAULT_PREFERENCE
    if args.channel_preference:
        try:
            preference = tuple(Channel.parse(c.strip()) for c in args.channel_preference.split(",") if c.strip())
        except ValueError as e:
            raise ValueError(f"--channel-preference: {e}") from None
    return models.JobPolicy(
        preference,
        args.ack_quorum,
        args.version_timeout,
        ready_without_acks=args.ready_without_acks,
        all_or_nothing=args.all_or_nothing,
    )


def _serve(args: argparse.Namespace) -> int:
    from weightsync.coordinator import auth, server, tls

    _limit_malloc_arenas()
    try:
        policy = _policy(args)
    except ValueError as e:
        return _fail(str(e))
    args.job = args.job or "default"
    server_tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            return _fail("--tls-cert and --tls-key go together")
        server_tls = tls.ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)
    config = server.ServerConfig(
        host=args.host,
        port=args.port,
        tls=None if args.insecure else server_tls,
        token=auth.load_token(args.token_file),
        insecure=args.insecure,
        max_message_bytes=args.max_message_bytes,
        max_workers=args.max_workers,
        lease_ttl_s=args.lease_ttl,
        policy=policy,
        volumes=_volumes(args.volume, args.job),
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    store = None
    if args.kubernetes_namespace:  # the Kubernetes client and the CRD models load only for this store
        from weightsync.coordinator import kubestore

        store = kubestore.around(args.kubernetes_namespace, config.volumes, args.job)
    coordinator = server.CoordinatorServer(config, store=store).start()
    if store is not None:
        store.attach(coordinator.core)
    record: dict[str, Any] = {
        "target": coordinator.target,
        "tls": not args.insecure,
        "mtls": bool(args.tls_client_ca and not args.insecure),
        "token": bool(config.token),
        "metrics": coordinator.metrics_server.url if coordinator.metrics_server else None,
        "jobs": {j: {"newest_ready": coordinator.core.get_job(j).newest_ready} for j in coordinator.core.jobs()},
    }
    if args.json:
        print(json.dumps(record), flush=True)
    else:
        print(
            f"coordinator listening on {record['target']} ({'TLS' if record['tls'] else 'insecure'})"
            + (f", metrics on {record['metrics']}" if record["metrics"] else ""),
            flush=True,
        )
        for job, info in record["jobs"].items():
            print(f"  recovered job {job}: newest READY version {info['newest_ready']}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # every thread's stack to stderr, for a stuck server
    done.wait()
    coordinator.stop(grace_s=2.0)
    if store is not None:
        store.close()
    return 0


STATUS_NEWEST = 10
"""``--status`` shows this many newest versions, and every older one still on the volume."""


def _status(args: argparse.Namespace) -> int:
    import dataclasses

    from weightsync.coordinator import auth, client, tls
    from weightsync.vocabulary import ReplicaState

    args.job = args.job or "default"
    target = f"{args.host}:{args.port}"
    cfg = None if args.insecure else tls.TlsConfig(ca_file=args.tls_ca)
    with client.CoordinatorClient(
        target, token=auth.load_token(args.token_file), tls=cfg, insecure=args.insecure, timeout_s=5.0
    ) as c:
        job = c.get_job(args.job)
        every = c.list_versions(args.job)
    # the newest ten, and every older one the volume still holds (retention keeps them for catch-up and recovery)
    versions = [v for i, v in enumerate(every) if i < STATUS_NEWEST or v.durable]
    if args.json:

        def plain(o: Any) -> Any:
            return o.hex() if isinstance(o, bytes) else str(o)

        print(
            json.dumps(
                {"job": dataclasses.asdict(job), "versions": [dataclasses.asdict(v) for v in versions]}, default=plain
            )
        )
        return 0
    print(f"job {job.job}: newest READY {job.newest_ready}, newest durable READY {job.newest_durable_ready}")
    for m in job.members:
        print(
            f"  {m.role.value:8} {m.member_id:24} version {m.current_version:<6} "
            f"lease {m.lease_expires_in_s:4.1f}s  channels {','.join(c.value for c in m.capabilities.channels)}"
        )
    for v in versions:
        loaded = sum(r.state is ReplicaState.LOADED for r in v.replicas)
        print(
            f"  v{v.version:<6} step {v.step:<6} {v.state.value:10} durable={'yes' if v.durable else 'no ':3} "
            f"loaded {loaded}/{len(v.replicas)}  {v.reason}"
        )
        for r in v.replicas:
            if r.state is ReplicaState.FAILED:
                print(f"      {r.replica_id}: {r.error[:300]}")
    return 0
