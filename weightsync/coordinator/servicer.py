"""The gRPC servicer: wire requests in, ``Coordinator`` calls, wire responses out.

Each method validates its request through ``serde`` (INVALID_ARGUMENT naming the
field), calls the core, and maps the core's ``faults`` to their status codes.
Nothing here holds state. The replica stream (``WatchVersions``) blocks on the
member's event queue with a bounded wait, ends when the lease is dropped or
replaced (the client re-registers and re-watches), and is cancelled cleanly when
the client goes away.
"""

from __future__ import annotations

import functools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet

from weightsync.coordinator import faults, serde
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import JobPolicy, Role, WaitFor
from weightsync.errors import PermanentError, RetryableError
from weightsync.sharding.plans import Region

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_WAIT_S = 3600.0
STREAM_POLL_S = 5.0
STREAM_WINDOW_S = 50.0
"""The server ends each watch stream cleanly after 40-50 s (jittered); the client re-opens it at once.

Ending it here, well before the client's own deadline (300 s), frees the handler's
worker thread before the new stream arrives, so re-opens reuse pool threads, and
spreads a large fleet's re-opens out. Short windows also bound how long a stream
silently cut by a middlebox goes unnoticed. In the 256-replica soak the
coordinator's memory rose once, at the first round of re-opens, and then stayed
flat; a 50 s window puts that round inside the first minute."""
ENCODED_PARTS = 4
"""Parts ``GetPlanRegions`` keeps encoded (Qwen3-235B's: ~13 MB each)."""


def _status(error: BaseException) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, faults.code_of(error), grpc.StatusCode.INTERNAL)


def _guard(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn the core's errors into statuses; log what we did not expect."""

    @functools.wraps(fn)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> T:
        try:
            return fn(self, request, context)
        except (PermanentError, RetryableError) as e:
            context.abort(_status(e), str(e))
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: internal error ({type(e).__name__}: {e})")
        raise AssertionError("unreachable")  # context.abort raises

    return wrapper


def _guard_stream(fn: Callable[..., Iterator[T]]) -> Callable[..., Iterator[T]]:
    """``_guard`` for a streaming method: its body runs while gRPC iterates the stream, so what it raises (an
    unknown lease at the first ``next``) must be mapped there too, or gRPC reports UNKNOWN instead of the status."""

    @functools.wraps(fn)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> Iterator[T]:
        try:
            yield from fn(self, request, context)
        except (PermanentError, RetryableError) as e:
            context.abort(_status(e), str(e))
        except Exception as e:
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: internal error ({type(e).__name__}: {e})")

    return wrapper


def _nonempty(value: str, field: str, fix: str) -> str:
    if not value:
        raise faults.InvalidArgument(f"{field} is empty; {fix}")
    return value


class Servicer:
    def __init__(self, core: Coordinator, max_message_bytes: int) -> None:
        self.core = core
        self.max_message_bytes = max_message_bytes
        """What one answer may hold: a list that would exceed it is cut (``ListVersionsResponse.truncated``)."""
        self._lock = threading.Lock()
        self._encoded: list[tuple[tuple[Region, ...], list[pb.PlanRegionsChunk]]] = []
        """The parts ``GetPlanRegions`` encoded last, newest first, by the plan's own regions (identical replicas
        share them: ``sharding.plans.plan``): the trainer and every replica read the same part."""

    def implementations(self) -> dict[str, Callable[[Any, grpc.ServicerContext], Any]]:
        return {
            name: getattr(self, name)
            for name in (
                "Register",
                "Renew",
                "OpenVersion",
                "WatchVersions",
                "ReportProgress",
                "Ack",
                "WaitVersion",
                "ReportSent",
                "ReportLost",
                "MarkDurable",
                "GetJob",
                "ListVersions",
                "GetPlanRegions",
            )
        }

    @_guard
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterResponse:
        role = serde.role(request.role)
        if not request.HasField("capabilities"):
            raise faults.InvalidArgument("capabilities is missing; send what this process can send or receive")
        caps = serde.capabilities(request.capabilities)
        if not caps.channels:
            raise faults.InvalidArgument("capabilities.channels is empty; list at least one channel, e.g. volume")
        policy: JobPolicy | None = None
        if role is Role.TRAINER and request.HasField("policy"):
            policy = serde.policy(request.policy, self.core.default_policy)
        offers = [serde.offer(o, f"offers[{i}]") for i, o in enumerate(request.offers)]
        lease = self.core.register(
            request.job,
            role,
            request.member_id,
            request.incarnation,
            caps,
            policy=policy,
            offers=offers,
            current_version=request.current_version,
            layout=serde.registered_layout(request, role),
        )
        return serde.register_response(lease)

    @_guard
    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewResponse:
        lease = self.core.renew(_nonempty(request.lease_id, "lease_id", "send the lease id Register returned"))
        return serde.renew_response(lease)

    @_guard
    def OpenVersion(self, request: pb.OpenVersionRequest, context: grpc.ServicerContext) -> pb.OpenVersionResponse:
        _nonempty(request.lease_id, "lease_id", "register the trainer first")
        if not request.HasField("table"):
            raise faults.InvalidArgument("table is missing; send models.summarize(tensor_table)")
        opened = self.core.open_version(
            request.lease_id,
            request.job,
            request.incarnation,
            request.step,
            serde.table(request.table),
            [serde.offer(o, f"offers[{i}]") for i, o in enumerate(request.offers)],
        )
        return serde.opened_to(opened, request.held_plan_key, self._room())

    @_guard_stream
    def WatchVersions(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchEvent]:
        lease_id = _nonempty(request.lease_id, "lease_id", "register the replica first")
        events = self.core.subscribe(lease_id)

        def ended() -> None:
            events.put(None)  # this stream's own queue: ends the loop on cancel
            self.core.stream_ended(lease_id)

        context.add_callback(ended)
        # the plan parts this stream sent in full, as its client keeps them; a client that keeps none gets them all
        held = serde.HeldRegions() if request.keeps_regions else None
        ends = time.monotonic() + STREAM_WINDOW_S * random.uniform(0.8, 1.0)
        while context.is_active():
            left = ends - time.monotonic()
            if left <= 0:
                return
            try:
                item = events.get(timeout=min(STREAM_POLL_S, left))
            except queue.Empty:
                continue
            if item is None:
                return
            yield serde.event_to(item, held, self._room())

    @_guard
    def ReportProgress(
        self, request: pb.ReportProgressRequest, context: grpc.ServicerContext
    ) -> pb.ReportProgressResponse:
        self.core.report_progress(
            _nonempty(request.lease_id, "lease_id", "register the replica first"),
            request.version,
            serde.progress(request.progress),
        )
        return serde.progress_response()

    @_guard
    def Ack(self, request: pb.AckRequest, context: grpc.ServicerContext) -> pb.AckResponse:
        state = self.core.ack(_nonempty(request.lease_id, "lease_id", "register the replica first"), serde.ack(request))
        return serde.ack_response(state)

    @staticmethod
    def _bounded(wait_s: float, context: grpc.ServicerContext) -> float:
        """A requested wait, cut to what the call's own deadline leaves."""
        remaining = context.time_remaining()
        return min(wait_s, remaining if remaining is not None else MAX_WAIT_S)

    @_guard
    def WaitVersion(self, request: pb.WaitVersionRequest, context: grpc.ServicerContext) -> pb.WaitVersionResponse:
        if not 0 < request.timeout_s <= MAX_WAIT_S:
            raise faults.InvalidArgument(f"timeout_s is {request.timeout_s}; send a wait between 0 and {MAX_WAIT_S:g}s")
        timeout = self._bounded(request.timeout_s, context)
        info, met = self.core.wait_version(request.job, request.version, serde.wait_for(request.until), timeout)
        return serde.wait_response(info, met)

    @_guard
    def ReportSent(self, request: pb.ReportSentRequest, context: grpc.ServicerContext) -> pb.ReportSentResponse:
        sent = serde.report_sent(request)
        lease_id = _nonempty(request.lease_id, "lease_id", "register the trainer first")
        if not 0 <= request.wait_s <= MAX_WAIT_S:
            raise faults.InvalidArgument(f"wait_s is {request.wait_s}; send a wait between 0 and {MAX_WAIT_S:g}s")
        info = self.core.report_sent(lease_id, request.version, sent)
        if request.wait_s > 0:
            info, _ = self.core.wait_version(
                info.job, request.version, WaitFor.SETTLED_OR_DURABLE_NEEDED, self._bounded(request.wait_s, context)
            )
        return serde.report_sent_response(info)

    @_guard
    def ReportLost(self, request: pb.ReportLostRequest, context: grpc.ServicerContext) -> pb.ReportLostResponse:
        lost = serde.report_lost(request)
        self.core.report_lost(
            _nonempty(request.lease_id, "lease_id", "register the trainer first"), request.version, lost
        )
        return serde.report_lost_response()

    @_guard
    def MarkDurable(self, request: pb.MarkDurableRequest, context: grpc.ServicerContext) -> pb.MarkDurableResponse:
        info = self.core.mark_durable(
            request.job, request.version, request.manifest_path, request.manifest_checksum, request.content_digest
        )
        return serde.mark_durable_response(info)

    @_guard_stream
    def GetPlanRegions(
        self, request: pb.PlanRegionsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PlanRegionsChunk]:
        lease_id = _nonempty(request.lease_id, "lease_id", "register first")
        key = _nonempty(request.plan_key, "plan_key", "send the key of the part whose regions were left out")
        regions = self.core.plan_regions(lease_id, key, request.replica_id)
        with self._lock:
            chunks = next((c for r, c in self._encoded if r is regions), None)
        if chunks is None:  # seconds of host time for Qwen3-235B's part: once per part, its replicas' and rank 0's
            chunks = list(serde.region_chunks(regions, self._room().left))
            with self._lock:
                self._encoded = [(regions, chunks), *self._encoded[: ENCODED_PARTS - 1]]
        yield from chunks

    def _room(self) -> serde.Room:
        """One answer's room for plan regions: half the message limit (the rest of a message is small)."""
        return serde.Room(self.max_message_bytes // 2)

    @_guard
    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.GetJobResponse:
        return serde.get_job_response(self.core.get_job(request.job))

    @_guard
    def ListVersions(self, request: pb.ListVersionsRequest, context: grpc.ServicerContext) -> pb.ListVersionsResponse:
        return serde.list_response(self.core.list_versions(request.job, request.limit), self.max_message_bytes)
