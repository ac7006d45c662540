"""A stand-in for vLLM's HTTP server, for the unit tests of ``HttpEngine``'s calls (a mock: the real server's
answers are tested against vLLM in the integration tier)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextmanager
def serving(answer: Callable[[dict[str, Any]], tuple[int, Any]]) -> Iterator[str]:
    """A loopback server answering each POST's JSON body with ``answer(body)`` (status, JSON); yields its URL."""

    class Vllm(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            status, reply = answer(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Vllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
