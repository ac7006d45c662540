"""The proxy's allow-list and its edges, without vLLM; and the HTTP engine's loopback guard.

Two kinds of tests: the ASGI app driven directly with crafted scopes (paths exactly as
a client could send them, no client-side normalisation in the way), and the proxy
served by uvicorn in front of a small real upstream app on loopback, to check what
actually crosses the wire (path, headers, streaming, disconnects, holds), with the
agent's real board server beside it (``served``). Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from weightsync.cli import proxy as proxy_cli
from weightsync.errors import PermanentError
from weightsync.vocabulary import EngineState
from weightsync_inference import http_engine, proxy, served

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

DEV_ROUTES = ["/pause", "/resume", "/update_weights", "/weight_checker", "/init_weight_transfer_engine",
              "/collective_rpc", "/sleep", "/inference/v1/generate", "/metrics", "/docs", "/"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CLOSED = f"http://127.0.0.1:{_free_port()}"  # nothing listens there: a real refused connection


# -- the decision table -----------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), [(m, p) for p, ms in proxy.ROUTES.items() for m in ms])
def test_allowed_routes_are_forwarded(method: str, path: str) -> None:
    assert proxy.route_decision(method, path) == 200


@pytest.mark.parametrize(
    "path",
    [*DEV_ROUTES, "/v1/completions/", "/v1/completions/../../pause", "//pause", "/V1/completions",
     "/v1/completions/render", "/v1/chat/completions/batch", "/v1/responses", "/v1/models/x", "/tokenize/"],
)  # fmt: skip
def test_everything_else_is_not_exposed(path: str) -> None:
    assert proxy.route_decision("POST", path) == 404 and proxy.route_decision("GET", path) == 404


def test_wrong_method_on_an_allowed_route() -> None:
    assert proxy.route_decision("GET", "/v1/completions") == 405
    assert proxy.route_decision("POST", "/v1/models") == 405
    assert proxy.route_decision("POST", "/health") == 405
    assert proxy.route_decision("HEAD", "/health") == 200


# -- the app, driven directly ------------------------------------------------------------------


def _drive(
    app: proxy.ProxyApp,
    method: str,
    path: str,
    body: list[bytes] | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[int, dict[bytes, bytes], bytes]:
    chunks = list(body or [b""])
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(dict(message))

    scope = {"type": "http", "method": method, "path": path, "headers": headers or [], "query_string": b"",
             "client": ("127.0.0.1", 5000)}  # fmt: skip

    async def main() -> None:
        await asyncio.wait_for(app(scope, receive, send), 20)
        await app.aclose()

    asyncio.run(main())
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("path", ["/pause", "/update_weights", "/v1/completions/../../pause"])
def test_not_exposed_answers_404_naming_the_route(path: str) -> None:
    status, _, body = _drive(proxy.ProxyApp(proxy.ProxyConfig(upstream=CLOSED, agent=CLOSED)), "POST", path)
    assert status == 404
    assert f"route POST {path} is not exposed by the weightsync proxy; it forwards only: /v1/completions" in str(body)


def test_wrong_method_answers_405_with_allow() -> None:
    status, headers, body = _drive(
        proxy.ProxyApp(proxy.ProxyConfig(upstream=CLOSED, agent=CLOSED)), "GET", "/v1/completions"
    )
    assert status == 405 and headers[b"allow"] == b"POST" and b"accepts POST, not GET" in body


def test_oversized_bodies_are_refused() -> None:
    app = proxy.ProxyApp(proxy.ProxyConfig(upstream=CLOSED, agent=CLOSED, max_body_bytes=10))
    declared = [(b"content-length", b"11")]
    assert _drive(app, "POST", "/v1/completions", [b"x" * 11], declared)[0] == 413
    status, _, body = _drive(app, "POST", "/v1/completions", [b"x" * 6, b"x" * 6])  # chunked, no length
    assert status == 413 and b"exceeds 10 bytes (the proxy's --max-body-bytes)" in body


def test_slow_bodies_time_out() -> None:
    """A body whose first chunk says more is coming, then nothing: 408 after the body timeout."""
    app = proxy.ProxyApp(proxy.ProxyConfig(upstream=CLOSED, agent=CLOSED, body_timeout_s=0.2))
    chunks = [b"{"]

    async def run() -> int:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if chunks:
                return {"type": "http.request", "body": chunks.pop(), "more_body": True}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            sent.append(dict(message))

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return int(sent[0]["status"])

    assert asyncio.run(run()) == 408


def test_unreachable_upstream_is_502_and_unhealthy() -> None:
    board = served.Board()
    board.set(served.Served.one(3))
    agent = served.serve(board, "127.0.0.1", 0)
    try:
        app = proxy.ProxyApp(proxy.ProxyConfig(upstream=CLOSED, agent=agent.url))
        status, _, body = _drive(app, "POST", "/v1/completions", [b"{}"])
        assert status == 502 and b"is unreachable (ConnectError); it may still be starting" in body
        status, _, body = _drive(app, "GET", "/health")
        assert status == 503 and b'"status": "unavailable"' in body
    finally:
        agent.close()


def test_without_its_agent_a_replica_serves_nothing_it_cannot_attribute() -> None:
    """No agent to say which weights the engine serves (not started, or gone): 503 with Retry-After, not a guess."""
    app = proxy.ProxyApp(proxy.ProxyConfig(upstream=CLOSED, agent=CLOSED))
    status, headers, body = _drive(app, "POST", "/v1/completions", [b"{}"])
    assert status == 503 and headers[b"retry-after"] == b"1", body
    assert b"the replica's agent at http://127.0.0.1:" in body and b"does not answer (ConnectError)" in body
    board = served.Board()  # an agent that has not taken the engine over yet
    agent = served.serve(board, "127.0.0.1", 0)
    try:
        app = proxy.ProxyApp(proxy.ProxyConfig(upstream=CLOSED, agent=agent.url))
        status, _, body = _drive(app, "POST", "/v1/completions", [b"{}"])
        assert status == 503 and b"answered 503: the agent has not taken the engine over yet" in body, body
    finally:
        agent.close()


def test_the_board_is_parsed_once_and_checked() -> None:
    assert served.Served.from_json({"versions": "12,13", "state": "paused"}) == served.Served(
        12, 13, EngineState.PAUSED
    )
    assert served.Served.one(4).to_json() == {"versions": "4", "state": "serving"}
    for bad in [{"versions": "13,12", "state": "serving"}, {"versions": "x", "state": "serving"}, {"state": "torn"}]:
        with pytest.raises(PermanentError, match=r"the agent's /served answered .*expected"):
            served.Served.from_json(bad)


# -- over the wire, with a real upstream and a real board -------------------------------------


class Upstream:
    """A small ASGI app standing in for vLLM's OpenAI routes; it records what reached it. Its board stands in for the
    agent's: a body ``json-update`` finishes an update while the completion runs (the lifecycle shows both versions,
    then the new one), ``json-gone`` takes the agent away as the completion ends."""

    def __init__(self, board: served.Board, agent: served.BoardServer) -> None:
        self.seen: list[dict[str, Any]] = []
        self.disconnected = threading.Event()
        self.board, self.agent = board, agent
        board.set(served.Served.one(7))

    @property
    def version(self) -> int:
        board = self.board.get()
        assert board is not None
        return board.high

    def update(self) -> None:
        """An update of the kind the lifecycle does: both versions while it runs, then the new one."""
        version = self.version
        self.board.set(served.Served(version, version + 1, EngineState.PAUSED))
        self.board.set(served.Served.one(version + 1))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append({"path": scope["path"], "query": scope["query_string"], "headers": headers, "body": body})
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if body.startswith(b"json"):  # a non-streamed completion
            if body == b"json-update":
                self.update()
            if body == b"json-gone":
                self.agent.close()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": b'{"choices": []}'})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"x-upstream", b"1")]})  # fmt: skip

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()

        watcher = asyncio.create_task(watch())
        n = 3 if b"short" in body else 200
        for i in range(n):
            await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            await asyncio.sleep(0.05)
            if self.disconnected.is_set():
                return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        watcher.cancel()


def _serve(config: uvicorn.Config) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start within 10s"
        time.sleep(0.02)
    return server, thread


@dataclass
class Wire:
    upstream: Upstream
    url: str
    upstream_url: str
    board: served.Board


def _proxy(config: proxy.ProxyConfig) -> tuple[str, tuple[uvicorn.Server, threading.Thread]]:
    port = _free_port()
    server = _serve(proxy.uvicorn_config(proxy.ProxyApp(config), "127.0.0.1", port, log_level="warning"))
    return f"http://127.0.0.1:{port}", server


@pytest.fixture
def wire() -> Iterator[Wire]:
    board = served.Board()
    agent = served.serve(board, "127.0.0.1", 0)
    upstream = Upstream(board, agent)
    up_port = _free_port()
    servers = [_serve(uvicorn.Config(upstream, host="127.0.0.1", port=up_port, log_level="warning"))]
    upstream_url = f"http://127.0.0.1:{up_port}"
    try:
        url, server = _proxy(proxy.ProxyConfig(upstream=upstream_url, agent=agent.url))
        servers.append(server)
        yield Wire(upstream, url, upstream_url, board)
    finally:
        agent.close()
        for server, thread in servers:
            server.should_exit = True
            thread.join(10)


def test_forwards_the_checked_path_and_sanitised_headers(wire: Wire) -> None:
    upstream, url = wire.upstream, wire.url
    headers = {"x-forwarded-for": "6.6.6.6", "authorization": "Bearer k", "proxy-authorization": "x"}
    r = httpx.post(f"{url}/v1/completions?a=1", content=b"short", headers=headers, timeout=10, trust_env=False)
    assert r.status_code == 200 and r.headers["x-upstream"] == "1"
    version = upstream.version
    assert r.text == f"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n: weightsync-versions {version}\n\n"
    assert r.headers[proxy.START_HEADER] == str(version)
    seen = upstream.seen[-1]
    assert seen["path"] == "/v1/completions" and seen["query"] == b"a=1" and seen["body"] == b"short"
    assert seen["headers"]["x-forwarded-for"] == "127.0.0.1"  # the client's own claim is dropped
    assert seen["headers"]["authorization"] == "Bearer k" and "proxy-authorization" not in seen["headers"]
    assert {s["path"] for s in upstream.seen} == {"/v1/completions"}  # nothing asked of the engine but the answer


def test_every_completion_says_which_weight_versions_made_it(wire: Wire) -> None:
    upstream, url = wire.upstream, wire.url
    r = httpx.post(f"{url}/v1/completions", content=b"json", timeout=10, trust_env=False)
    assert r.status_code == 200 and r.json() == {"choices": []}
    assert r.headers[proxy.VERSIONS_HEADER] == str(upstream.version)
    # an update finished while the request was in flight: both versions, for JSON and for streams
    before = upstream.version
    r = httpx.post(f"{url}/v1/chat/completions", content=b"json-update", timeout=10, trust_env=False)
    assert r.headers[proxy.VERSIONS_HEADER] == f"{before},{before + 1}"
    with httpx.stream("POST", f"{url}/v1/completions", content=b"short", timeout=10, trust_env=False) as s:
        lines = s.iter_lines()
        assert next(lines) == "data: 0" and s.headers[proxy.START_HEADER] == str(before + 1)
        upstream.update()
        rest = list(lines)
    assert rest[-2:] == [f"{proxy.SSE_VERSIONS}{before + 1},{before + 2}", ""], rest
    embedded = httpx.post(f"{url}/v1/embeddings", content=b"json", timeout=10, trust_env=False)
    assert embedded.headers[proxy.VERSIONS_HEADER] == str(before + 2)  # the weights compute embeddings too
    # routes that compute nothing with the weights carry no versions
    tokenized = httpx.post(f"{url}/tokenize", content=b"json", timeout=10, trust_env=False)
    assert proxy.VERSIONS_HEADER not in tokenized.headers


def test_a_completion_whose_versions_cannot_be_read_after_it_is_refused_not_returned_unattributed(
    wire: Wire,
) -> None:
    r = httpx.post(f"{wire.url}/v1/completions", content=b"json-gone", timeout=10, trust_env=False)
    assert r.status_code == 502 and proxy.VERSIONS_HEADER not in r.headers, r.headers
    message = r.json()["error"]["message"]
    assert "could not be read after the answer (the replica's agent at" in message, message
    r = httpx.post(f"{wire.url}/v1/completions", content=b"json", timeout=10, trust_env=False)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "does not answer" in r.text
    assert wire.upstream.seen[-1]["body"] == b"json-gone", "forwarded though unattributable"


def test_health_is_answered_by_the_proxy_from_the_agents_board(wire: Wire) -> None:
    r = httpx.get(f"{wire.url}/health", timeout=10, trust_env=False)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    for state, reason in [(EngineState.PAUSED, "a weight update is in progress"), (EngineState.TORN, "torn")]:
        wire.board.set(served.Served(7, 8, state))
        r = httpx.get(f"{wire.url}/health", timeout=10, trust_env=False)
        assert r.status_code == 503 and reason in r.json()["reason"].replace("failed after bytes", "torn"), r.text
    wire.board.set(served.Served.one(8))
    assert httpx.get(f"{wire.url}/health", timeout=10, trust_env=False).status_code == 200
    assert {s["path"] for s in wire.upstream.seen} == {"/health"}  # vLLM's /is_paused, an engine call, never asked


def test_completions_wait_out_an_update_and_carry_only_the_new_version(wire: Wire) -> None:
    """While the replica is paused for an update (or switches a staged version in) a completion is held, not
    failed; once the new version serves it goes on and is attributed to that version alone."""
    wire.board.set(served.Served(7, 8, EngineState.PAUSED))
    answer: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: answer.append(
            httpx.post(f"{wire.url}/v1/completions", content=b"json", timeout=30, trust_env=False)
        )
    )
    t0 = time.monotonic()
    client.start()
    time.sleep(0.5)
    assert not answer and not wire.upstream.seen, "forwarded while the replica was paused for an update"
    wire.board.set(served.Served.one(8))
    client.join(10)
    assert answer[0].status_code == 200 and answer[0].headers[proxy.VERSIONS_HEADER] == "8"
    assert time.monotonic() - t0 < 2  # the poll's backoff is capped at 250 ms


def test_an_update_longer_than_the_wait_or_a_torn_replica_is_503_with_retry_after(wire: Wire) -> None:
    url, server = _proxy(
        proxy.ProxyConfig(upstream=wire.upstream_url, agent=wire.upstream.agent.url, update_wait_s=0.3)
    )
    try:
        wire.board.set(served.Served(7, 8, EngineState.PAUSED))
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", content=b"json", timeout=10, trust_env=False)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "for more than the 0.3s a request waits (the proxy's --update-wait)" in r.json()["error"]["message"]
        assert 0.3 <= time.monotonic() - t0 < 2
        wire.board.set(served.Served(7, 8, EngineState.TORN))
        r = httpx.post(f"{url}/v1/completions", content=b"json", timeout=10, trust_env=False)
        assert r.status_code == 503 and r.headers["retry-after"] == str(proxy.RETRY_TORN_S), r.text
        assert not wire.upstream.seen
    finally:
        server[0].should_exit = True
        server[1].join(10)


def test_streams_arrive_as_sent_and_a_leaving_client_stops_the_upstream(wire: Wire) -> None:
    upstream, url = wire.upstream, wire.url
    upstream.disconnected.clear()
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", content=b"long", timeout=10, trust_env=False) as r:
        first = next(r.iter_raw())
    assert first.startswith(b"data: 0") and time.monotonic() - t0 < 5  # not buffered to the end (10 s)
    assert upstream.disconnected.wait(5), "the upstream request was not closed after the client left"


def test_non_loopback_vllm_urls_are_refused() -> None:
    for ok in ["http://127.0.0.1:8001", "http://localhost:8001/", "http://[::1]:8001", "http://127.0.0.2:1"]:
        assert http_engine.require_loopback(ok) == ok.rstrip("/")
    for bad in ["http://10.0.0.5:8001", "http://vllm.default.svc:8001", "ftp://127.0.0.1", "127.0.0.1:8001"]:
        with pytest.raises(PermanentError, match=r"(not on this host|not an http\(s\) URL).*127\.0\.0\.1"):
            http_engine.HttpEngine(bad)
    with http_engine.HttpEngine(CLOSED) as engine:
        assert not engine.healthy()


def test_listen_flag() -> None:
    assert proxy_cli.parse_listen("0.0.0.0:8000") == ("0.0.0.0", 8000)
    assert proxy_cli.parse_listen("[::1]:8000") == ("::1", 8000)
    for bad in ["8000", "host:", "host:99999"]:
        with pytest.raises(SystemExit, match="expected HOST:PORT"):
            proxy_cli.parse_listen(bad)


LIGHT = """
import sys
from weightsync.cli import main
parser = main.build_parser()
args = parser.parse_args(["proxy", "--upstream", "http://127.0.0.1:9", "--agent", "http://127.0.0.1:9"])
from weightsync_inference import proxy
app = proxy.ProxyApp(proxy.ProxyConfig(upstream=args.upstream, agent=args.agent))
proxy.uvicorn_config(app, "127.0.0.1", 0)
print(sorted(m for m in ("torch", "vllm", "transformers", "grpc", "numpy", "safetensors") if m in sys.modules))
"""


def test_the_proxy_loads_no_torch_vllm_or_grpc() -> None:
    # The proxy runs in a container of its own beside vLLM: its command's whole import path
    # (the CLI parser with every subcommand's flags, the app, uvicorn's config) stays light.
    out = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", f"the proxy's import path loaded {out.stdout.strip()}: {out.stderr[-2000:]}"
