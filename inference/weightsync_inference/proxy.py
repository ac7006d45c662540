"""The client-facing door of a served replica: vLLM's OpenAI routes, and nothing else.

vLLM serves the RL routes the agent needs (``/pause``, ``/init_weight_transfer_engine``,
``/update_weights``, ``/weight_checker``, ...) only with ``VLLM_SERVER_DEV_MODE=1``, which
opens further development routes on the same port. Whoever reaches that port can pause
the server or replace its weights. So vLLM binds 127.0.0.1 (reachable inside its pod
only), the agent is the only client of its dev routes, and clients reach vLLM only
through this proxy, which forwards an explicit allow-list of OpenAI routes (``ROUTES``)
and answers 404, naming the route as not exposed, for everything else. The list is
exact paths, not prefixes: ``/v1/completions/../../pause`` or ``/v1/models/`` is not on
it. The forwarded path is the allow-list's own string, never the client's bytes, so
no decoding trick can make the upstream see a path other than the one checked.

What the replica serves comes from its agent, not from vLLM: the agent is the one process that
changes the weights and keeps, on loopback, which versions the engine may be generating with and
whether it is paused or torn (``served``: ``GET /served``, answered from memory). vLLM's own
``/weight_info`` and ``/is_paused`` are calls into the engine loop that an update holds, so they
answer nothing for as long as an update takes; asking them made completions fail with 504 and
``/health`` report a paused replica healthy.

``/health`` is answered here (readiness): vLLM's ``/health`` answers 200 and the agent says the
replica serves. Paused for an update, torn (a failed update left it paused until a whole version
loads: fail-stop), or an agent that does not answer (the proxy cannot tell what is served): 503
with the reason, so the Service routes around the replica.

Completions and embeddings (``WEIGHTED``) wait while the replica is paused for an update or
switches a staged version in, at most ``update_wait_s`` (``--update-wait``, default 600 s: a
job's ``sync.timeoutSeconds``, which bounds how long a version may stay STAGING and exceeds its
transfer timeout by the job config's own rule), then go on; past that, or when the replica is torn
or the agent does not answer, they get 503 with ``Retry-After``. Never a 504 or a false answer for
an update.

Every such answer says which weights made it: the proxy reads the agent's versions before it
forwards (once the replica serves) and again after the response ended. A JSON response carries
``x-weightsync-versions: 12``, or ``12,13`` when an update began while it was in flight (its
tokens, or the prompt KV it was computed from, may come from both; the attribution errs towards
"mixed", never towards "one version"). A streamed response carries the version it started on in
``x-weightsync-version-start`` and ends with an SSE comment line ``: weightsync-versions 12,13``
after vLLM's last event, which clients that follow the SSE rules skip. Where the agent cannot be
read after the answer ended, a JSON answer is refused with 502 rather than returned unattributed,
and a stream ends without the comment. The cost is two loopback reads of the agent's board per
answer, on a kept-alive connection.

Responses stream through as they arrive (server-sent events included); a client that
goes away closes the upstream request, which makes vLLM abort the generation. JSON
completions are sent once vLLM has answered in full (vLLM sends them only at the end
anyway), so their header can name the version they ended on. Request
bodies are bounded (413 above ``max_body_bytes``) and read within a deadline (408);
upstream connects, reads between chunks, and health checks each have a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import httpx

from weightsync.errors import PermanentError
from weightsync.vocabulary import EngineState
from weightsync_inference import served

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ROUTES: Mapping[str, frozenset[str]] = {
    "/v1/completions": frozenset({"POST"}),
    "/v1/chat/completions": frozenset({"POST"}),
    "/v1/embeddings": frozenset({"POST"}),
    "/v1/models": frozenset({"GET"}),
    "/tokenize": frozenset({"POST"}),
    "/detokenize": frozenset({"POST"}),
}
"""Every route the proxy forwards, with its methods. Anything else answers 404."""

HEALTH = "/health"
WEIGHTED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})
"""The routes whose answers the weights compute: held while the replica updates, and attributed to versions."""
VERSIONS_HEADER = "x-weightsync-versions"
UNATTRIBUTED = (
    "the replica's weight versions could not be read after the answer ({why}): the proxy returns nothing it "
    "cannot attribute to the weights that made it; retry it"
)
START_HEADER = "x-weightsync-version-start"
SSE_VERSIONS = ": weightsync-versions "
PAUSED_REASON = "a weight update is in progress (the replica is paused, or switches a staged version in)"
TORN_REASON = (
    "an update failed after bytes reached the parameters; the replica stays paused until a whole version loads "
    "(it never serves a mix)"
)
RETRY_SOON_S = 1
"""Retry-After for a replica whose update outlasted the wait, or whose agent does not answer (yet)."""
RETRY_TORN_S = 10
"""Retry-After for a torn replica: a whole version loads from the volume first."""

# Hop-by-hop headers (RFC 9110 7.6.1) and those the proxy sets itself.
_DROP_REQUEST = frozenset(
    {
        "host",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authorization",
        "content-length",
        "expect",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "x-real-ip",
    }
)
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    agent: str
    """The replica's agent (``weightsync agent --served-listen``): what the replica serves."""
    upstream: str = "http://127.0.0.1:8001"
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    health_timeout_s: float = 5.0
    agent_timeout_s: float = 2.0
    update_wait_s: float = 600.0
    """How long a completion waits for an update to end before it gets 503 (``--update-wait``)."""
    max_connections: int = 512


def route_decision(method: str, path: str) -> int:
    """The status the proxy gives ``method path`` before forwarding: 200 (forward or health), 404 or 405."""
    if path == HEALTH:
        return 200 if method in ("GET", "HEAD") else 405
    methods = ROUTES.get(path)
    if methods is None:
        return 404
    return 200 if method in methods else 405


def _error_body(status: int, kind: str, message: str) -> bytes:
    """An error in the OpenAI shape vLLM uses, so clients parse proxy errors like vLLM's."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


def not_exposed_message(method: str, path: str) -> str:
    exposed = ", ".join([*ROUTES, HEALTH])
    return f"route {method} {path} is not exposed by the weightsync proxy; it forwards only: {exposed}"


class _BodyTooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class _Unavailable(Exception):
    """The replica cannot answer now: 503 with ``reason`` and ``Retry-After: retry_after_s``."""

    def __init__(self, reason: str, retry_after_s: int = RETRY_SOON_S) -> None:
        super().__init__(reason)
        self.reason, self.retry_after_s = reason, retry_after_s


class ProxyApp:
    """The ASGI application; ``uvicorn`` (see ``serve``) runs it."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._client: httpx.AsyncClient | None = None
        self._agent: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            c = self.config
            # No keep-alive upstream: vLLM closes a connection after a route fails with an
            # unhandled error, and a pooled connection reused after that fails the next request.
            self._client = httpx.AsyncClient(
                base_url=c.upstream.rstrip("/"),
                trust_env=False,
                timeout=httpx.Timeout(c.read_timeout_s, connect=c.connect_timeout_s, pool=c.connect_timeout_s),
                limits=httpx.Limits(max_connections=c.max_connections, max_keepalive_connections=0),
            )
        return self._client

    def agent_client(self) -> httpx.AsyncClient:
        if self._agent is None:  # kept alive: read twice per answer
            c = self.config
            self._agent = httpx.AsyncClient(base_url=c.agent.rstrip("/"), trust_env=False, timeout=c.agent_timeout_s)
        return self._agent

    async def aclose(self) -> None:
        for client in (self._client, self._agent):
            if client is not None:
                await client.aclose()
        self._client = self._agent = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        # websockets are not served: uvicorn answers 403 when the app does not accept

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = str(scope["method"]), str(scope["path"])
        decision = route_decision(method, path)
        if decision == 404:
            await _respond(send, 404, _error_body(404, "NotFoundError", not_exposed_message(method, path)))
        elif decision == 405:
            allowed = ROUTES.get(path, frozenset({"GET", "HEAD"}))
            message = f"route {path} accepts {', '.join(sorted(allowed))}, not {method}"
            await _respond(
                send,
                405,
                _error_body(405, "MethodNotAllowed", message),
                [(b"allow", ", ".join(sorted(allowed)).encode())],
            )
        elif path == HEALTH:
            await self._health(send, head=method == "HEAD")
        else:
            await self._forward(scope, receive, send, path)

    async def _health(self, send: Send, head: bool) -> None:
        try:
            r = await self.client().get(HEALTH, timeout=self.config.health_timeout_s)
            ok, reason = r.status_code == 200, f"vLLM /health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, f"vLLM at {self.config.upstream} is unreachable ({type(e).__name__})"
        if ok:
            try:
                state = (await self._served()).state
                if state is not EngineState.SERVING:
                    ok, reason = False, TORN_REASON if state is EngineState.TORN else PAUSED_REASON
            except _Unavailable as e:
                ok, reason = False, e.reason
        body = json.dumps({"status": "ok"} if ok else {"status": "unavailable", "reason": reason}).encode()
        await _respond(send, 200 if ok else 503, b"" if head else body)

    async def _served(self) -> served.Served:
        """What the replica serves, by its agent's board; ``_Unavailable`` when the agent cannot say."""
        where = self.config.agent
        try:
            r = await self.agent_client().get(served.PATH)
        except httpx.HTTPError as e:
            raise _Unavailable(
                f"the replica's agent at {where} does not answer ({type(e).__name__}): which weights it serves is "
                "unknown"
            ) from None
        try:
            body = r.json()
            if r.status_code != 200:
                raise _Unavailable(f"the replica's agent at {where} answered {r.status_code}: {body.get('reason')}")
            return served.Served.from_json(body)
        except (ValueError, AttributeError, PermanentError) as e:
            raise _Unavailable(f"the replica's agent at {where} answered {r.status_code}, no board: {e}") from None

    async def _until_serving(self) -> served.Served:
        """The board once the replica serves: waits out an update (at most ``update_wait_s``), polling the agent with
        a backoff from 5 ms (a staged switch takes milliseconds) to 250 ms (an in-place update, seconds)."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.config.update_wait_s, 0.005
        while True:
            board = await self._served()
            if board.state is EngineState.SERVING:
                return board
            if board.state is EngineState.TORN:
                raise _Unavailable(TORN_REASON, RETRY_TORN_S)
            left = deadline - loop.time()
            if left <= 0:
                raise _Unavailable(
                    f"{PAUSED_REASON}, for more than the {self.config.update_wait_s:g}s a request waits (the proxy's "
                    "--update-wait)"
                )
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 0.25)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise _BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        async with asyncio.timeout(self.config.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                chunk = bytes(message.get("body", b""))
                size += len(chunk)
                if size > limit:
                    raise _BodyTooLarge
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)

    async def _forward(self, scope: Scope, receive: Receive, send: Send, route: str) -> None:
        c = self.config
        try:
            body = await self._read_body(scope, receive)
        except _BodyTooLarge:
            message = f"request body exceeds {c.max_body_bytes} bytes (the proxy's --max-body-bytes)"
            await _respond(send, 413, _error_body(413, "RequestTooLarge", message))
            return
        except TimeoutError:
            message = f"request body not received within {c.body_timeout_s:.0f}s"
            await _respond(send, 408, _error_body(408, "RequestTimeout", message))
            return
        except _ClientGone:
            return
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in _DROP_REQUEST
        ]
        client_addr = scope.get("client")
        if client_addr:
            headers.append(("x-forwarded-for", str(client_addr[0])))
        query = scope.get("query_string", b"").decode("latin-1")
        url = route + (f"?{query}" if query else "")
        client = self.client()
        request = client.build_request(str(scope["method"]), url, headers=headers, content=body)
        try:
            start = await self._until_serving() if route in WEIGHTED else None
            upstream = await client.send(request, stream=True)
        except _Unavailable as e:
            retry = [(b"retry-after", str(e.retry_after_s).encode())]
            await _respond(send, 503, _error_body(503, "ServiceUnavailable", e.reason), retry)
            return
        except httpx.TimeoutException as e:
            message = f"vLLM did not answer within the proxy's timeouts ({type(e).__name__})"
            await _respond(send, 504, _error_body(504, "GatewayTimeout", message))
            return
        except httpx.HTTPError as e:
            message = f"vLLM at {c.upstream} is unreachable ({type(e).__name__}); it may still be starting"
            await _respond(send, 502, _error_body(502, "BadGateway", message))
            return
        versions = None if start is None else _Versions(start, self._served)
        try:
            await _relay(upstream, receive, send, versions)
        finally:
            await upstream.aclose()


async def _respond(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _text(low: int, high: int) -> str:
    return str(low) if low == high else f"{low},{high}"


@dataclass(frozen=True)
class _Versions:
    """An answer's weight versions: those the replica served when it was forwarded, and how to read them after."""

    start: served.Served
    read: Callable[[], Awaitable[served.Served]]

    async def label(self) -> str:
        """``"12"``, or ``"12,13"`` when the versions changed (or were changing) while it was in flight."""
        end = await self.read()
        return _text(min(self.start.low, end.low), max(self.start.high, end.high))


async def _relay(upstream: httpx.Response, receive: Receive, send: Send, versions: _Versions | None = None) -> None:
    """Stream ``upstream`` to the client chunk by chunk; stop (closing upstream) when the client leaves.

    With ``versions`` (a completion route), a JSON answer is held until it ended so its header names the versions
    it was generated with; a stream starts with the start version and ends with a comment naming them."""
    headers = [
        (k.encode("latin-1"), v.encode("latin-1"))
        for k, v in upstream.headers.multi_items()
        if k.lower() not in _DROP_RESPONSE
    ]
    streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
    if versions is not None and streamed:
        headers.append((START_HEADER.encode(), versions.start.versions.encode()))
    held = versions is not None and not streamed
    if not held:
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers})

    async def pump() -> None:
        body: list[bytes] = []
        try:
            async for chunk in upstream.aiter_raw():
                if held:
                    body.append(chunk)
                else:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as e:  # headers are sent: all we can do is end the stream
            log.warning("upstream stream ended early: %s: %s", type(e).__name__, e)
        try:
            label = await versions.label() if versions is not None else None
        except _Unavailable as e:
            if held:
                message = UNATTRIBUTED.format(why=e.reason)
                await _respond(send, 502, _error_body(502, "BadGateway", message))
                return
            label = None  # a stream already sent its tokens: it ends without the versions comment
        if held:
            extra = [(VERSIONS_HEADER.encode(), label.encode())] if label else []
            await send({"type": "http.response.start", "status": upstream.status_code, "headers": headers + extra})
            await send({"type": "http.response.body", "body": b"".join(body)})
            return
        if label and streamed:
            await send({"type": "http.response.body", "body": f"{SSE_VERSIONS}{label}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping, watching = asyncio.create_task(pump()), asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pumping, watching):
            task.cancel()
        await asyncio.gather(pumping, watching, return_exceptions=True)
    if pumping in done and pumping.exception() is not None:
        log.warning("client stream ended early: %s", pumping.exception())


def uvicorn_config(app: ProxyApp, host: str, port: int, log_level: str = "info") -> Any:
    """The ``uvicorn.Config`` the proxy runs under (``serve`` and the tests share it)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        proxy_headers=False,  # the proxy is the edge: it trusts no client's X-Forwarded-For
        server_header=False,
        limit_concurrency=app.config.max_connections,
        timeout_graceful_shutdown=30,
    )


def serve(host: str, port: int, config: ProxyConfig, log_level: str = "info") -> None:
    """Run the proxy until interrupted (uvicorn handles SIGINT/SIGTERM with a graceful drain)."""
    import uvicorn

    uvicorn.Server(uvicorn_config(ProxyApp(config), host, port, log_level)).run()


__all__ = [
    "HEALTH",
    "ROUTES",
    "SSE_VERSIONS",
    "START_HEADER",
    "VERSIONS_HEADER",
    "WEIGHTED",
    "ProxyApp",
    "ProxyConfig",
    "not_exposed_message",
    "route_decision",
    "serve",
    "uvicorn_config",
]
