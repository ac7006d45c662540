"""Serve a replica's OpenAI routes to clients, and nothing else of vLLM's dev-mode server.

vLLM runs with VLLM_SERVER_DEV_MODE=1 on 127.0.0.1 so the weightsync agent can drive
its weight-update routes; those routes (and vLLM's other dev routes) let anyone who
reaches the port pause the server or replace its weights. This proxy is the only way
clients reach vLLM: it forwards /v1/completions, /v1/chat/completions, /v1/embeddings,
/v1/models, /tokenize and /detokenize (streaming included), answers /health itself
(200 when vLLM's /health does and the replica's agent says it serves), and answers 404
for every other route. What the replica serves comes from the agent beside it (--agent):
completions wait while an update is under way (at most --update-wait), carry the weight
versions that made them, and get 503 with Retry-After when the replica cannot answer.
See docs/serving.md.

It listens on 127.0.0.1 unless --listen says otherwise; a pod exposes it with
--listen 0.0.0.0:PORT.

examples:
  weightsync proxy --listen 127.0.0.1:8000 --upstream http://127.0.0.1:8001 --agent http://127.0.0.1:8002
  weightsync proxy --listen 0.0.0.0:8000 --upstream http://127.0.0.1:8001 --max-body-bytes 67108864
"""

from __future__ import annotations

import argparse
import sys

from weightsync.cli.agent import DEFAULT_SERVED_PORT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT to serve clients on (default 127.0.0.1:8000)")
    p.add_argument(
        "--upstream", default="http://127.0.0.1:8001", help="vLLM's base URL (default http://127.0.0.1:8001)"
    )
    p.add_argument(
        "--agent",
        default=f"http://127.0.0.1:{DEFAULT_SERVED_PORT}",
        help=f"the replica's agent (its --served-listen): what the replica serves (default "
        f"http://127.0.0.1:{DEFAULT_SERVED_PORT})",
    )
    p.add_argument(
        "--update-wait",
        type=float,
        default=600.0,
        help="seconds a completion waits while the replica updates before it gets 503 (default 600: a job's "
        "sync.timeoutSeconds, past which no version stays STAGING)",
    )
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body (default 32 MiB)")
    p.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds vLLM may stay silent within one response (default 600)",
    )
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to vLLM (default 5)")
    p.add_argument(
        "--max-connections", type=int, default=512, help="concurrent client connections; more get 503 (default 512)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def parse_listen(value: str, flag: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6) as (host, port), or SystemExit naming the problem."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SystemExit(f"{flag} {value!r}: expected HOST:PORT, e.g. 127.0.0.1:8000 or 0.0.0.0:8000")
    return host, int(port)


def run(args: argparse.Namespace) -> int:
    from weightsync_inference import proxy

    host, port = parse_listen(args.listen)
    for flag, url in (("--upstream", args.upstream), ("--agent", args.agent)):
        if not url.startswith(("http://", "https://")):
            print(f"{flag} {url!r}: expected an http(s) URL, e.g. http://127.0.0.1:8001", file=sys.stderr)
            return 2
    config = proxy.ProxyConfig(
        upstream=args.upstream,
        agent=args.agent,
        update_wait_s=args.update_wait,
        max_body_bytes=args.max_body_bytes,
        read_timeout_s=args.read_timeout,
        connect_timeout_s=args.connect_timeout,
        max_connections=args.max_connections,
    )
    proxy.serve(host, port, config, log_level=args.log_level)
    return 0
