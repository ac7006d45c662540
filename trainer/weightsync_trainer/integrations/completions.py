"""Rollouts through the job's OpenAI endpoint: token ids, their logprobs, and the weights that made them.

The TRL ``rollout_func`` and the Atropos server class both generate here: a ``/v1/completions``
request with token-id prompts (no re-tokenization on the server), ``return_token_ids`` and
``logprobs: 0`` (the chosen token's logprob, what GRPO's importance ratio needs), through the
weightsync proxy in front of the replicas. The proxy's ``x-weightsync-versions`` header comes back
as ``Completion.served``, so each sample knows which version generated it.

Every request has a timeout; 502/503/504 and connection errors (a replica restarting, the proxy
refusing a completion it could not attribute) are retried a few times with a short backoff, then
raised as ``RetryableError`` naming the endpoint and the last answer.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from weightsync.errors import PermanentError, RetryableError
from weightsync.served import OPENAI_URL_ENV, VERSIONS_HEADER, Served

RETRY_STATUSES = frozenset({502, 503, 504})
ATTEMPTS = 4
BACKOFF_S = 1.0


def endpoint(env: Mapping[str, str] | None = None) -> str:
    """The job's OpenAI endpoint (``$WEIGHTSYNC_OPENAI_URL``), without a trailing slash."""
    url = (os.environ if env is None else env).get(OPENAI_URL_ENV, "").rstrip("/")
    if not url:
        raise PermanentError(
            f"${OPENAI_URL_ENV} is not set: the operator sets it in trainer pods (the job's OpenAI Service), "
            "`weightsync run` sets it locally; or pass the endpoint's URL explicitly"
        )
    return url.removesuffix("/v1")


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """What a completion request asks for besides its prompt."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    model: str | None = None
    """The served model's name; None lets vLLM pick its only model."""

    def body(self, prompt_ids: Sequence[int], n: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.model is not None:
            body["model"] = self.model
        return body


@dataclass(frozen=True)
class Completion:
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The logprob of each generated token under the weights that generated it."""
    finish_reason: str
    served: Served | None
    """The weight versions that generated it; None when the endpoint does not say (not behind the proxy)."""


def parse(url: str, body: Any, headers: Mapping[str, str], prompt_ids: Sequence[int], n: int) -> list[Completion]:
    """The choices of one ``/v1/completions`` answer, checked: one per requested completion, token ids and logprobs
    of equal length."""
    served = Served.parse(headers.get(VERSIONS_HEADER))
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise PermanentError(f"{url}/v1/completions answered {got} choices for n={n}: is it a vLLM OpenAI server?")
    out: list[Completion] = []
    for i, choice in enumerate(sorted(choices, key=lambda c: int(c.get("index", 0)))):
        tokens = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(tokens, list) or not isinstance(logprobs, list) or len(tokens) != len(logprobs):
            raise PermanentError(
                f"{url}/v1/completions choice {i}: token_ids and logprobs.token_logprobs must be lists of one length "
                f"(got {type(tokens).__name__}, {type(logprobs).__name__}); the request asks for return_token_ids "
                "and logprobs=0, which vLLM answers"
            )
        reason = str(choice.get("finish_reason") or "stop")
        out.append(Completion(tuple(prompt_ids), tuple(tokens), tuple(float(x) for x in logprobs), reason, served))
    return out


def _error(response: httpx.Response) -> str:
    return f"HTTP {response.status_code}: {response.text[:300]}"


class _Retry(Exception):
    """An answer worth retrying (502/503/504): the proxy refused or lost a replica."""


class _Attempts:
    """One request's retry loop, written once for the blocking and the asyncio client (their I/O differs by
    ``await`` only). Iterating waits before each attempt after the first; each attempt runs inside ``with`` (a
    connection error or a retryable status is kept as the reason and the loop goes on) and returns
    ``settle(answer)``; after the last, ``failure()`` is the error to raise::

        attempts = _Attempts(url, prompt_ids, n)
        for _ in attempts:
            with attempts:
                return attempts.settle(http.post(...))
        raise attempts.failure()
    """

    def __init__(self, url: str, prompt_ids: Sequence[int], n: int) -> None:
        self.url, self.prompt_ids, self.n = url, prompt_ids, n
        self.error = ""

    def __iter__(self) -> Iterator[int]:
        for attempt in range(ATTEMPTS):
            time.sleep(BACKOFF_S * attempt)
            yield attempt

    async def __aiter__(self) -> AsyncIterator[int]:
        for attempt in range(ATTEMPTS):
            await asyncio.sleep(BACKOFF_S * attempt)
            yield attempt

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> bool:
        if isinstance(e, (httpx.TransportError, _Retry)):
            self.error = str(e) if isinstance(e, _Retry) else f"{type(e).__name__}: {e}"
            return True
        return False

    def settle(self, r: httpx.Response) -> list[Completion]:
        """An answer's completions; raises ``_Retry`` when retrying may help, ``PermanentError`` when it cannot."""
        if r.status_code in RETRY_STATUSES:
            raise _Retry(_error(r))
        if r.status_code != 200:
            raise PermanentError(f"{self.url}/v1/completions refused the request: {_error(r)}")
        return parse(self.url, r.json(), r.headers, self.prompt_ids, self.n)

    def failure(self) -> RetryableError:
        return RetryableError(
            f"{self.url}/v1/completions failed {ATTEMPTS} times, last: {self.error}; is the job's inference up?"
        )


class Client:
    """Blocking completions through the job's OpenAI endpoint (``endpoint()`` unless ``url`` is given)."""

    def __init__(self, url: str | None = None, *, timeout_s: float = 300.0) -> None:
        self.url = (url or endpoint()).rstrip("/").removesuffix("/v1")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, trust_env=False)

    def complete(self, prompt_ids: Sequence[int], n: int, sampling: Sampling) -> list[Completion]:
        attempts = _Attempts(self.url, prompt_ids, n)
        for _ in attempts:
            with attempts:
                return attempts.settle(self._http.post("/v1/completions", json=sampling.body(prompt_ids, n)))
        raise attempts.failure()

    def close(self) -> None:
        self._http.close()


class AsyncClient:
    """``Client`` for asyncio code (the Atropos server class)."""

    def __init__(self, url: str | None = None, *, timeout_s: float = 300.0) -> None:
        self.url = (url or endpoint()).rstrip("/").removesuffix("/v1")
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, trust_env=False)

    async def complete(self, prompt_ids: Sequence[int], n: int, sampling: Sampling) -> list[Completion]:
        attempts = _Attempts(self.url, prompt_ids, n)
        async for _ in attempts:
            with attempts:
                return attempts.settle(await self._http.post("/v1/completions", json=sampling.body(prompt_ids, n)))
        raise attempts.failure()

    async def healthy(self) -> bool:
        """The endpoint's ``/health`` answers 200 (the proxy: vLLM up and not paused)."""
        try:
            return (await self._http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        await self._http.aclose()
