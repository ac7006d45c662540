"""One URL for a fleet's replicas off Kubernetes: what the job's OpenAI Service is in a cluster.

In an RLJob, trainer pods reach every replica's proxy through one Service
(``$WEIGHTSYNC_OPENAI_URL``), which kube-proxy balances per connection. ``weightsync run``
and the multi-host tests need the same thing without a cluster: this forwards each TCP
connection to the next replica proxy in turn (skipping one that refuses), byte for byte,
so every header the proxies set reaches the client unchanged. Run it in a process of its
own (``python -m weightsync.cli._endpoint LISTEN UPSTREAM...``) or in a thread
(``Endpoint.start``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import threading
from collections.abc import Sequence

CONNECT_TIMEOUT_S = 5.0


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(1 << 16):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class Endpoint:
    """Round-robin TCP forwarding from ``listen`` (``host:port``) to ``upstreams`` (``host:port`` each)."""

    def __init__(self, listen: str, upstreams: Sequence[str]) -> None:
        if not upstreams:
            raise ValueError("an endpoint needs at least one upstream")
        self.listen = listen
        self.upstreams = [_split(u) for u in upstreams]
        self._next = itertools.cycle(range(len(self.upstreams)))
        self.ready = threading.Event()
        self._stopped = threading.Event()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for _ in self.upstreams:
            host, port = self.upstreams[next(self._next)]
            try:
                return await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                continue  # that replica is down: the next one, as a Service drops an endpoint that is not ready
        return None

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream = await self._connect()
        if upstream is None:
            client_w.close()
            return
        up_r, up_w = upstream
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))

    async def serve(self) -> None:
        host, port = _split(self.listen)
        server = await asyncio.start_server(self._handle, host, port)
        self.ready.set()
        async with server:
            while not self._stopped.is_set():
                await asyncio.sleep(0.2)

    def start(self, timeout_s: float = 10.0) -> threading.Thread:
        """Serve on a daemon thread until ``stop``; returns once it listens."""
        thread = threading.Thread(target=asyncio.run, args=(self.serve(),), name="weightsync-endpoint", daemon=True)
        thread.start()
        if not self.ready.wait(timeout_s):
            raise TimeoutError(f"the endpoint did not listen on {self.listen} within {timeout_s:.0f}s")
        return thread

    def stop(self) -> None:
        self._stopped.set()


if __name__ == "__main__":
    asyncio.run(Endpoint(sys.argv[1], sys.argv[2:]).serve())
