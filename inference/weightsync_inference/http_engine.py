"""A served vLLM engine (its OpenAI server in dev mode) behind the lifecycle's ``EngineControl``.

The replica agent is a sidecar beside vLLM and reaches it on localhost; the dev-mode
routes it drives (``/pause``, ``/init_weight_transfer_engine``, ``/update_weights``, ...)
let anyone who reaches the port replace the weights, so this client refuses any base
URL that is not a loopback address, and ignores ``*_proxy`` environment variables (a
proxy would take weight updates off the pod).

Errors keep vLLM's own text. A worker's exception travels engine core -> API server ->
HTTP as ``{"error": {"message": ...}}``; ``EngineHttpError`` carries that message. Whether
a failed update left bytes in the parameters is not read from that text: the agent asks
the workers for their receipts (``/collective_rpc``, ``weightsync_inference.worker``).
Every call has a timeout; the update's comes from its ticket, because only the publisher
knows how long moving its bytes may take.

    engine = HttpEngine("http://127.0.0.1:8001")
    replica = Replica(engine)
    replica.init_transfer(Rendezvous(Channel.VOLUME, root="/ckpt").to_dict())
    replica.apply(ticket)                     # pause(keep) -> start -> update -> finish -> resume
    engine.weight_version()                   # str(ticket.version)
    engine.receipt()                          # what the workers computed while loading it
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any
from urllib.parse import urlsplit

import httpx

from weightsync.errors import PermanentError, RetryableError, TransferTimeoutError, WeightsyncError
from weightsync.sharding.fills import EngineLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import PauseMode
from weightsync_inference import receipts, staging, worker

LOOPBACK_NAMES = ("localhost",)
INITIAL_WEIGHT_VERSIONS = frozenset({"default", "None"})
"""What vLLM's ``/weight_info`` says before any update finished (0.32: ``default``; earlier: ``None``): the weights
the server started with, version 0 to weightsync."""
NO_EXTENSION = (
    f"start vLLM with --worker-extension-cls {worker.QUALNAME} (the weightsync worker extension: the agent asks "
    "each worker through it what it is and what it loaded)"
)
ENGINE_GRACE_S = 30.0
"""How much longer the agent waits for a call than the engine's own bounded waits take (the rendezvous and the
ticket carry them): the engine's error, which says whether bytes landed, then arrives before the HTTP timeout."""


class EngineHttpError(WeightsyncError):
    """vLLM answered a route with a non-2xx status; ``message`` is vLLM's own error text."""

    def __init__(self, route: str, status: int, message: str) -> None:
        super().__init__(f"vLLM {route} answered {status}: {message}")
        self.route = route
        self.status = status
        self.message = message


def require_loopback(base_url: str) -> str:
    """``base_url`` without a trailing slash, or an error when its host is not a loopback address."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PermanentError(f"vLLM URL {base_url!r} is not an http(s) URL; expected e.g. http://127.0.0.1:8001")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in LOOPBACK_NAMES
    if not loopback:
        raise PermanentError(
            f"vLLM URL {base_url!r} is not on this host: its dev-mode routes can pause the server and replace "
            "its weights, so the agent talks to vLLM on 127.0.0.1 only; run the agent beside vLLM and bind "
            "vLLM with --host 127.0.0.1"
        )
    return base_url.rstrip("/")


def error_text(response: httpx.Response) -> str:
    """vLLM's error message from any of its error shapes, else the raw body."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return err if isinstance(err, str) else json.dumps(err)
    return json.dumps(body)


class HttpEngine:
    """vLLM's weight-transfer lifecycle over HTTP, for one served engine on this host."""

    def __init__(
        self,
        base_url: str,
        *,
        control_timeout_s: float = 30.0,
        transfer_timeout_s: float = 300.0,
        generate_timeout_s: float = 120.0,
        model: str | None = None,
        pause_mode: PauseMode = PauseMode.KEEP,
    ) -> None:
        """``control_timeout_s`` bounds pause/resume/start/queries; ``transfer_timeout_s`` bounds
        init (a rendezvous), finish (the layerwise reload's finalisation) and a pause that waits for
        requests in flight (``pause_mode`` wait); an update uses its ticket's ``timeout_s``."""
        self.base_url = require_loopback(base_url)
        self.pause_mode = pause_mode
        self.control_timeout_s = control_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.generate_timeout_s = generate_timeout_s
        self.model = model
        # No keep-alive: after a failed route vLLM's server closes the connection it answered
        # on (starlette re-raises past the error handler), and reusing it made the next call
        # (the lifecycle's /resume) fail with "connection reset". Localhost connects are cheap.
        self._client = httpx.Client(
            base_url=self.base_url,
            trust_env=False,
            timeout=control_timeout_s,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HttpEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        route: str,
        *,
        timeout_s: float | None = None,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        timeout = timeout_s if timeout_s is not None else self.control_timeout_s
        try:
            response = self._client.request(method, route, json=body, params=params, timeout=timeout)
        except httpx.TimeoutException as e:
            raise TransferTimeoutError(
                f"vLLM {route} did not answer within {timeout:.0f}s ({type(e).__name__}) at {self.base_url}"
            ) from e
        except httpx.TransportError as e:
            raise RetryableError(
                f"vLLM {route} at {self.base_url} is unreachable ({type(e).__name__}: {e}); is the server up?"
            ) from e
        if not response.is_success:
            raise EngineHttpError(route, response.status_code, error_text(response))
        if not response.content:
            return None
        return response.json()

    # -- the lifecycle (EngineControl) ------------------------------------------------------

    def pause(self) -> None:
        """Pause scheduling (``vocabulary.PauseMode``: keep freezes in-flight requests, which continue on
        ``resume``; wait lets them finish first; abort ends them). The caches are kept here (vLLM's default would
        clear them now, through a parameter it deprecates): ``reset_caches`` drops them once the weights changed."""
        waits = self.pause_mode is PauseMode.WAIT
        timeout = self.transfer_timeout_s if waits else None
        params = {"mode": self.pause_mode.value, "clear_cache": "false"}
        self._call("POST", "/pause", params=params, timeout_s=timeout)

    def reset_caches(self) -> None:
        """vLLM's prefix cache (requests in flight preempted, to be computed again; a KV connector's cache too) and
        its encoder cache. The multimodal processor cache stays: it holds preprocessed inputs, not the weights'
        outputs."""
        params = {"reset_running_requests": "true", "reset_external": "true"}
        answer = self._call("POST", "/reset_prefix_cache", params=params)
        if not (isinstance(answer, dict) and answer.get("success") is True):
            raise WeightsyncError(
                f"vLLM's /reset_prefix_cache answered {answer!r:.200}: its prefix cache (or its KV connector's) was "
                "not reset, so it would serve KV computed under the previous weights"
            )
        self._call("POST", "/reset_encoder_cache")

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        timeout = float(init_info.get("timeout_s", self.transfer_timeout_s)) + ENGINE_GRACE_S
        self._call("POST", "/init_weight_transfer_engine", body={"init_info": init_info}, timeout_s=timeout)

    def start(self) -> None:
        self._call("POST", "/start_weight_update")

    def update(self, update_info: dict[str, Any]) -> None:
        # the receiver's first wait lasts the join deadline and the transfer timeout (``UpdateTicket.join_timeout_s``)
        transfer = float(update_info.get("timeout_s", self.transfer_timeout_s))
        timeout = transfer + float(update_info.get("join_timeout_s", 0)) + ENGINE_GRACE_S
        self._call("POST", "/update_weights", body={"update_info": update_info}, timeout_s=timeout)

    def finish(self, version: str) -> None:
        self._call("POST", "/finish_weight_update", body={"weight_version": version}, timeout_s=self.transfer_timeout_s)

    # -- queries -------------------------------------------------------------------------------

    def weight_version(self) -> str:
        """The version the engine last finished loading (one of ``INITIAL_WEIGHT_VERSIONS`` before the first)."""
        return str(self._call("GET", "/weight_info")["weight_version"])

    @property
    def between_steps(self) -> bool:
        return self.pause_mode is PauseMode.KEEP

    def switch(self, update_info: dict[str, Any]) -> receipts.Receipt:
        timeout = float(update_info.get("timeout_s", self.transfer_timeout_s))
        answers = self._workers("weightsync_switch", json.dumps(update_info), timeout_s=timeout)
        return receipts.merge([receipts.Receipt.from_dict(r) for r in answers])

    def label(self, version: str) -> None:
        self._call("POST", "/update_weight_version", body={"new_version": version})

    def _workers(self, method: str, *args: str, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """One JSON answer per worker from the weightsync worker extension (``/collective_rpc``; string args)."""
        timeout = timeout_s if timeout_s is not None else self.control_timeout_s
        body = {"method": method, "timeout": timeout, "args": list(args)}
        try:
            answer = self._call("POST", "/collective_rpc", body=body, timeout_s=timeout + ENGINE_GRACE_S)
        except EngineHttpError as e:
            if f"has no attribute '{method}'" in e.message:  # vLLM's workers were started without our extension
                raise PermanentError(f"vLLM's workers have no {method}: {NO_EXTENSION}") from None
            raise
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise PermanentError(f"vLLM's /collective_rpc {method} answered {answer!r:.200}; {NO_EXTENSION}")
        return results

    def identity(self) -> list[receipts.Identity]:
        return [receipts.Identity.from_dict(r) for r in self._workers("weightsync_identity")]

    def receipt(self) -> receipts.Receipt:
        return receipts.merge([receipts.Receipt.from_dict(r) for r in self._workers("weightsync_receipt")])

    def last_table(self) -> TensorTable | None:
        return receipts.last_table(self._workers("weightsync_table"))

    def engine_layout(self, table: TensorTable) -> EngineLayout:
        """What each worker keeps of ``table``'s tensors (recorded from vLLM's loaders), merged."""
        answers = self._workers("weightsync_layout", json.dumps(table.to_dict()), timeout_s=self.transfer_timeout_s)
        return EngineLayout.merged(table.layout_digest(), answers)

    def receive_regions(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker receives its regions of a sharded update (``sharded.request``); one answer per worker. As
        long as the rendezvous' join deadline and transfer timeout together (the workers' own bounded waits)."""
        rdv = request["rendezvous"]
        timeout = float(rdv.get("join_timeout_s", 0)) + float(rdv.get("timeout_s", self.transfer_timeout_s))
        return receipts.regions_answers(
            self._workers("weightsync_receive_regions", json.dumps(request), timeout_s=timeout)
        )

    def release_regions(self) -> list[int]:
        """Every worker lets its region groups go (``WorkerExtension.weightsync_release_regions``)."""
        return [int(a["released"]) for a in self._workers("weightsync_release_regions")]

    def read_regions(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker reads its regions of a sharded volume version (``volume_reads.request``); one answer each.
        Bounded like a transfer: each worker reads and checks its tiles from the volume."""
        return self._workers("weightsync_read_regions", json.dumps(request), timeout_s=self.transfer_timeout_s)

    def parameter_digests(self) -> list[dict[str, str]]:
        """Each worker's digests of the parameters it computes with (``held.parameter_digests``), in worker order: two
        replicas of one layout holding the same weights answer alike, whichever path loaded them. Reads every
        parameter (packed ones through their kernels), so it is bounded like a transfer, not like a query."""
        answers = self._workers("weightsync_parameter_digests", timeout_s=self.transfer_timeout_s)
        return [{str(name): str(digest) for name, digest in a.items()} for a in answers]

    def stage(self, update_info: dict[str, Any], nbytes: int) -> str:
        answers = self._workers("weightsync_stage", json.dumps(update_info), str(nbytes))
        return "; ".join(str(a.get("error", "")) for a in answers if not a.get("ok"))

    def stage_status(self) -> staging.StageStatus:
        return staging.merge([staging.StageStatus.from_dict(r) for r in self._workers("weightsync_stage_status")])

    def healthy(self) -> bool:
        """Whether vLLM answers ``/health`` with 200 within the control timeout."""
        try:
            return self._client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Greedy token ids and their log-probabilities for each token-id prompt (as ``OfflineEngine``)."""
        return greedy(self._client, prompts, max_tokens, model=self.model, timeout_s=self.generate_timeout_s)


def greedy(
    client: httpx.Client,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    model: str | None = None,
    timeout_s: float = 120.0,
) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and log-probabilities per token-id prompt from an OpenAI server (vLLM, or the proxy)."""
    body: dict[str, Any] = {
        "prompt": prompts,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    response = client.post("/v1/completions", json=body, timeout=timeout_s)
    if not response.is_success:
        raise EngineHttpError("/v1/completions", response.status_code, error_text(response))
    result: list[tuple[list[int], list[float]]] = []
    for choice in sorted(response.json()["choices"], key=lambda c: int(c["index"])):
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice.get("logprobs") or {}
        lps = [float(lp) for lp in logprobs.get("token_logprobs", [])]
        if len(lps) != len(ids):
            raise PermanentError(
                f"the server returned {len(ids)} tokens but {len(lps)} log-probabilities for prompt {choice['index']}"
            )
        result.append((ids, lps))
    if len(result) != len(prompts):
        raise PermanentError(f"the server answered {len(result)} choices for {len(prompts)} prompts")
    return result


__all__ = ["EngineHttpError", "HttpEngine", "error_text", "greedy", "require_loopback"]
