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

``/health`` is answered here (readiness: vLLM's ``/health`` answers 200 and vLLM is not
paused), so a Kubernetes probe needs no access to vLLM itself, and a replica that stays
paused after a failed update (fail-stop) is taken out of the Service until it loads a
whole version; a routine update's pause lasts less than a probe period.

Every completion says which weights made it: the proxy reads vLLM's weight version before
it forwards a completion route and again after the response ended. A JSON response carries
``x-weightsync-versions: 12``, or ``12,13`` when an update finished while it was in flight
(its tokens may come from both; a request that waited out an update in vLLM's queue is also
reported with both: the attribution errs towards "mixed", never towards "one version"; while a
staged version switches in between two steps, vLLM reports ``12,13`` and the completions that
read it are reported with both). A
streamed response carries the version it started on in ``x-weightsync-version-start`` and
ends with an SSE comment line ``: weightsync-versions 12,13`` after vLLM's last event, which
clients that follow the SSE rules skip. Where vLLM has no such route (no development routes),
the headers are left out; where it has one but cannot answer it (an engine that died as the
completion ended), a JSON completion is refused with 502 rather than returned unattributed,
and a stream ends without the comment. The cost is two loopback reads of ``/weight_info`` per completion.

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

from weightsync_inference.http_engine import INITIAL_WEIGHT_VERSIONS

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
IS_PAUSED = "/is_paused"
WEIGHT_INFO = "/weight_info"
GENERATION = frozenset({"/v1/completions", "/v1/chat/completions"})
"""The routes whose responses say which weight versions generated them."""
VERSIONS_HEADER = "x-weightsync-versions"
UNATTRIBUTED = (
    "vLLM's weight version could not be read {when} the completion ({why}; is the engine still up?): the proxy "
    "returns no completion it cannot attribute to the weights that made it; retry it"
)
START_HEADER = "x-weightsync-version-start"
SSE_VERSIONS = ": weightsync-versions "
PAUSED_REASON = (
    "vLLM is paused: a weight update is in progress, or one failed after bytes landed and the replica "
    "waits for a whole version (it never serves a mix)"
)

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
    upstream: str = "http://127.0.0.1:8001"
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    health_timeout_s: float = 5.0
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


class _Unattributed(Exception):
    """vLLM has a weight-version route but did not answer it with a version."""


def _named(e: Exception) -> str:
    return str(e) if isinstance(e, _Unattributed) else type(e).__name__


class ProxyApp:
    """The ASGI application; ``uvicorn`` (see ``serve``) runs it."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._client: httpx.AsyncClient | None = None

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

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

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
            if ok and await self._paused():
                ok, reason = False, PAUSED_REASON
        except httpx.HTTPError as e:
            ok, reason = False, f"vLLM at {self.config.upstream} is unreachable ({type(e).__name__})"
        body = json.dumps({"status": "ok"} if ok else {"status": "unavailable", "reason": reason}).encode()
        await _respond(send, 200 if ok else 503, b"" if head else body)

    async def _paused(self) -> bool:
        """vLLM's own pause state (a development route, reachable here on loopback only)."""
        try:
            r = await self.client().get(IS_PAUSED, timeout=self.config.health_timeout_s)
            return r.status_code == 200 and bool(r.json().get("is_paused"))
        except (httpx.HTTPError, ValueError, AttributeError):
            return False  # a server without the development routes cannot be paused

    async def _weight_version(self) -> Span | None:
        """The versions vLLM's engine may be generating with: the one it last finished loading (0: the weights it
        started with), or two while a staged version switches in between steps (the agent labels the engine
        ``"12,13"`` around that call); None when it has no such route (not in development mode); raises
        ``_Unattributed`` when it has one but no answer (``httpx``'s errors when vLLM is unreachable)."""
        r = await self.client().get(WEIGHT_INFO, timeout=self.config.health_timeout_s)  # httpx errors: unreachable
        if r.status_code == 404:
            return None
        try:
            text = str(r.json().get("weight_version")) if r.status_code == 200 else f"HTTP {r.status_code}"
        except (ValueError, AttributeError) as e:
            raise _Unattributed(f"{WEIGHT_INFO} answered no JSON object") from e
        if text in INITIAL_WEIGHT_VERSIONS:
            return 0, 0
        low, _, high = text.partition(",")
        if low.isdigit() and (high or low).isdigit() and int(low) <= int(high or low):
            return int(low), int(high or low)
        raise _Unattributed(text)

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
            start = await self._weight_version() if route in GENERATION else None
            upstream = await client.send(request, stream=True)
        except _Unattributed as e:
            await _respond(send, 502, _error_body(502, "BadGateway", UNATTRIBUTED.format(when="before", why=e)))
            return
        except httpx.TimeoutException as e:
            message = f"vLLM did not answer within the proxy's timeouts ({type(e).__name__})"
            await _respond(send, 504, _error_body(504, "GatewayTimeout", message))
            return
        except httpx.HTTPError as e:
            message = f"vLLM at {c.upstream} is unreachable ({type(e).__name__}); it may still be starting"
            await _respond(send, 502, _error_body(502, "BadGateway", message))
            return
        versions = None if start is None else _Versions(start, self._weight_version)
        try:
            await _relay(upstream, receive, send, versions)
        finally:
            await upstream.aclose()


async def _respond(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


Span = tuple[int, int]
"""The lowest and highest weight version an engine may be generating with."""


def _text(low: int, high: int) -> str:
    return str(low) if low == high else f"{low},{high}"


@dataclass(frozen=True)
class _Versions:
    """A completion's weight versions: those read before it was forwarded, and how to read those after."""

    start: Span
    read: Callable[[], Awaitable[Span | None]]

    async def label(self) -> str | None:
        """``"12"``, ``"12,13"`` when the version changed in flight, None when vLLM no longer says."""
        end = await self.read()
        if end is None:
            return None
        return _text(min(self.start[0], end[0]), max(self.start[1], end[1]))


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
        headers.append((START_HEADER.encode(), _text(*versions.start).encode()))
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
        except (_Unattributed, httpx.HTTPError) as e:
            if held:
                message = UNATTRIBUTED.format(when="after", why=_named(e))
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
    "GENERATION",
    "HEALTH",
    "ROUTES",
    "SSE_VERSIONS",
    "START_HEADER",
    "VERSIONS_HEADER",
    "ProxyApp",
    "ProxyConfig",
    "not_exposed_message",
    "route_decision",
    "serve",
    "uvicorn_config",
]
