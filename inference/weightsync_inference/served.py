"""What a replica serves, by its agent's account: the proxy's source for attribution and readiness.

The agent is the only process that changes a replica's weights, so it knows without asking
the engine which versions the engine may be generating with: one (``12``) while it serves,
two (``12,13``) from just before it pauses for an update (or switches a staged version in
between two steps) until the new weights are visible and everything computed under the old
ones is dropped, and whether the replica is paused or torn. ``lifecycle.Replica`` keeps that
on a ``Board`` at each of those moments; the agent serves the board on loopback (``serve``,
``GET /served``), and the proxy reads it before it forwards a completion and after the
response ended.

Why not vLLM itself: an update holds vLLM's engine loop (an in-place ``update_weights`` runs
in it for the whole transfer), and ``/weight_info`` and ``/is_paused`` are calls into that
loop, so they answer nothing for as long as the update takes (18 s seen while a version
stalled). The board answers from memory in well under a millisecond, whatever the engine is
doing; a proxy that cannot read it says the replica is unavailable rather than guess.

    board = Board()
    replica = Replica(engine, board=board)   # the lifecycle updates it
    server = serve(board, "127.0.0.1", 8002) # GET /served -> {"versions": "12", "state": "serving"}
                                             # (8002: ``weightsync agent --served-listen``'s default)
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from weightsync.errors import PermanentError
from weightsync.vocabulary import EngineState

PATH = "/served"


@dataclass(frozen=True)
class Served:
    """The versions an engine may be generating with (``low`` to ``high``) and what it may do."""

    low: int
    high: int
    state: EngineState

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise PermanentError(f"served versions {self.low},{self.high}: expected 0 <= low <= high")

    @classmethod
    def one(cls, version: int, state: EngineState = EngineState.SERVING) -> Served:
        return cls(version, version, state)

    @property
    def versions(self) -> str:
        """``"12"``, or ``"12,13"`` while a switch may be under way: what a completion's header carries."""
        return str(self.low) if self.low == self.high else f"{self.low},{self.high}"

    def to_json(self) -> dict[str, Any]:
        return {"versions": self.versions, "state": self.state.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Served:
        """Parsed and checked once, at the proxy's edge; an error names the field and what came."""
        try:
            low, _, high = str(data["versions"]).partition(",")
            return cls(int(low), int(high or low), EngineState(str(data["state"])))
        except (KeyError, TypeError, ValueError, PermanentError) as e:
            raise PermanentError(
                f"the agent's {PATH} answered {dict(data)!r:.200}: {type(e).__name__}: {e}; expected "
                '{"versions": "12" or "12,13", "state": "serving", "paused" or "torn"}'
            ) from None


class Board:
    """The latest ``Served`` of one replica, shared between the agent's threads and its HTTP server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: Served | None = None

    def set(self, served: Served) -> None:
        with self._lock:
            self._served = served

    def get(self) -> Served | None:
        """None until the agent has taken the engine over (it does not know what the engine serves yet)."""
        with self._lock:
            return self._served


class BoardServer:
    """The board on ``http://host:port/served`` from a daemon thread (port 0 picks a free one)."""

    def __init__(self, board: Board, host: str, port: int) -> None:
        self.connections: set[socket.socket] = set()
        handler = type("Handler", (_Handler,), {"board": board, "connections": self.connections})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.host, self.port = host, int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, name="weightsync-served", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving, kept-alive connections included (as the agent's process ending would)."""
        self._server.shutdown()
        self._server.server_close()
        for connection in list(self.connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


def serve(board: Board, host: str, port: int) -> BoardServer:
    return BoardServer(board, host, port)


class _Handler(BaseHTTPRequestHandler):
    board: Board
    connections: set[socket.socket]
    protocol_version = "HTTP/1.1"  # the proxy keeps its connection: no connect per read

    def setup(self) -> None:
        super().setup()
        self.connections.add(self.connection)

    def finish(self) -> None:
        self.connections.discard(self.connection)
        super().finish()

    def do_GET(self) -> None:
        if self.path != PATH:
            self._answer(404, {"error": f"only GET {PATH} is served here"})
            return
        served = self.board.get()
        if served is None:
            self._answer(503, {"state": "starting", "reason": "the agent has not taken the engine over yet"})
        else:
            self._answer(200, served.to_json())

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: the proxy reads the board twice per completion."""


__all__ = ["PATH", "Board", "BoardServer", "Served", "serve"]
