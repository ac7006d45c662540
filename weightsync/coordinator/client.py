"""The typed, synchronous client the trainer's publisher and each replica's agent use.

One client is one member of one job (a trainer or a replica). Registering starts a
daemon thread that renews the lease every third of its TTL; when the coordinator
has forgotten the lease (it expired, or the coordinator restarted) the thread
registers again with the same incarnation, which keeps the member's place in any
staging plan. ``close()`` stops the thread and the channel.

Publisher, one sync::

    client = CoordinatorClient("10.0.0.5:50051", token=token, tls=TlsConfig(ca_file="ca.pem"))
    client.register_trainer("my-job", "trainer-0", Capabilities(host=node, channels=(Channel.CPU, Channel.VOLUME)))
    opened = client.open_version(step, models.summarize(table), offers=[SenderOffer(Channel.CPU, host, port)])
    client.wait_receivers_ready(opened.version, timeout_s=60)   # every planned replica is ready or dropped
    ...send over each plan's channel (rebuild a group whose id in opened.groups() changed)...
    state = client.wait_version(opened.version, timeout_s=300)  # READY, FAILED or SUPERSEDED
    client.mark_durable(opened.version, manifest_path, manifest_sha256)  # later, when the volume copy lands

Agent::

    client.register_replica("my-job", "replica-0", caps, current_version=0)
    for a in client.watch():                       # CATCH_UP first when a durable READY version exists
        if a.kind is EventKind.ABORT: ...; continue
        client.report_ready(a.version)
        ...receive, load, verify...
        client.ack(AckReport(a.version, a.table.table_digest, ok=True, phases={SyncPhase.TOTAL: t}))

Every call has a deadline (``timeout_s``); UNAVAILABLE (coordinator restarting,
network blip) is retried with exponential backoff until that deadline, every
other status raises the matching ``faults`` error at once.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Self, TypeVar

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet

from weightsync.coordinator import _service, auth, faults, serde
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.coordinator.models import (
    AckReport,
    Assignment,
    Capabilities,
    EngineKind,
    JobInfo,
    JobPolicy,
    Lease,
    OpenedVersion,
    Progress,
    SenderOffer,
    TableSummary,
    VersionInfo,
    WaitFor,
)
from weightsync.coordinator.tls import TlsConfig
from weightsync.errors import PermanentError, RetryableError, WeightsyncError
from weightsync.vocabulary import VersionState

__all__ = ["CoordinatorClient", "TlsConfig"]
log = logging.getLogger(__name__)
T = TypeVar("T")
STREAM_WINDOW_S = 300.0
"""Watch streams are re-opened after this long, so even the stream carries a deadline."""


def _error(e: grpc.RpcError) -> WeightsyncError:
    code = e.code() if hasattr(e, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = e.details() if hasattr(e, "details") else str(e)
    cls = faults.BY_CODE.get(name)
    return cls(details or name) if cls else RetryableError(f"{name}: {details}")


class CoordinatorClient:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        insecure: bool = False,
        timeout_s: float = 10.0,
        incarnation: str | None = None,
        max_message_bytes: int = 16 << 20,
    ) -> None:
        """``tls=None`` still means TLS (system roots); only ``insecure=True`` dials in plaintext."""
        self.target, self.timeout_s = target, timeout_s
        self.incarnation = incarnation or uuid.uuid4().hex
        self._metadata = ((auth.HEADER, f"Bearer {token}"),) if token else ()
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if insecure:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            cfg = tls or TlsConfig()
            if cfg.server_name:
                options.append(("grpc.ssl_target_name_override", cfg.server_name))
            self._channel = grpc.secure_channel(target, cfg.credentials(), options=options)
        self._rpc: dict[str, Any] = _service.stubs(self._channel)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._register_request: pb.RegisterRequest | None = None
        self._lease: Lease | None = None
        self._renewer: threading.Thread | None = None
        self._active: list[Any] = []

    # ---- plumbing ----------------------------------------------------------------------------------------------

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """One unary call, retrying UNAVAILABLE with backoff until the deadline."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        delay = 0.05
        renewed = False
        while True:
            left = deadline - time.monotonic()
            try:
                return self._rpc[method](request, timeout=max(left, 0.001), metadata=self._metadata)
            except grpc.RpcError as e:
                lease_lost = e.code() is grpc.StatusCode.NOT_FOUND and (e.details() or "").startswith("lease ")
                if lease_lost and not renewed and method != "Register" and hasattr(request, "lease_id"):
                    # the coordinator restarted or our lease lapsed: register again (same incarnation) and retry once
                    renewed = True
                    self._reregister(stale=request.lease_id)
                    request.lease_id = self.lease.lease_id
                    continue
                if e.code() is not grpc.StatusCode.UNAVAILABLE or self._closed.is_set():
                    raise _error(e) from None
                if time.monotonic() + delay >= deadline:
                    waited = timeout_s or self.timeout_s
                    raise faults.Unavailable(
                        f"coordinator {self.target} unavailable for {waited:g}s: {e.details()}; "
                        "is it running, and is the address right?"
                    ) from None
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 2.0)

    @property
    def lease(self) -> Lease:
        if self._lease is None:
            raise PermanentError("not registered: call register_trainer() or register_replica() first")
        return self._lease

    @property
    def job(self) -> str:
        if self._register_request is None:
            raise PermanentError("not registered: call register_trainer() or register_replica() first")
        return self._register_request.job

    # ---- registration and leases ---------------------------------------------------------------------------------

    def _register(self, request: pb.RegisterRequest) -> Lease:
        response = self._call("Register", request)
        lease = Lease(response.lease.lease_id, response.lease.ttl_s)
        with self._lock:
            self._register_request, self._lease = request, lease
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_loop, name="coordinator-lease", daemon=True)
            self._renewer.start()
        return lease

    def register_trainer(
        self,
        job: str,
        trainer_id: str,
        capabilities: Capabilities,
        *,
        policy: JobPolicy | None = None,
        offers: Sequence[SenderOffer] = (),
    ) -> Lease:
        request = pb.RegisterRequest(
            job=job,
            role=pb.ROLE_TRAINER,
            member_id=trainer_id,
            incarnation=self.incarnation,
            capabilities=serde.capabilities_to(capabilities),
            policy=serde.policy_to(policy) if policy else None,
            offers=[serde.offer_to(o) for o in offers],
        )
        return self._register(request)

    def register_replica(
        self, job: str, replica_id: str, capabilities: Capabilities, *, current_version: int = 0
    ) -> Lease:
        request = pb.RegisterRequest(
            job=job,
            role=pb.ROLE_REPLICA,
            member_id=replica_id,
            incarnation=self.incarnation,
            capabilities=serde.capabilities_to(capabilities),
            current_version=current_version,
        )
        return self._register(request)

    def _renew_loop(self) -> None:
        while not self._closed.wait(max(0.05, (self._lease.ttl_s if self._lease else 3.0) / 3)):
            try:
                self._call("Renew", pb.RenewRequest(lease_id=self.lease.lease_id))
            except faults.NotFound:
                log.warning("coordinator forgot our lease (expired or restarted); registering again")
            except WeightsyncError as e:
                if not self._closed.is_set():
                    log.warning("lease renewal failed: %s", e)

    def set_current_version(self, version: int) -> None:
        """Tell later re-registrations which version this replica serves (the agent calls it after a load)."""
        with self._lock:
            if self._register_request is not None:
                self._register_request.current_version = version

    # ---- publisher -------------------------------------------------------------------------------------------------

    def open_version(
        self, step: int, table: TableSummary, *, offers: Sequence[SenderOffer] = (), timeout_s: float | None = None
    ) -> OpenedVersion:
        request = pb.OpenVersionRequest(
            lease_id=self.lease.lease_id,
            job=self.job,
            incarnation=self.incarnation,
            step=step,
            table=serde.table_to(table),
            offers=[serde.offer_to(o) for o in offers],
        )
        response = self._call("OpenVersion", request, timeout_s)
        return OpenedVersion(response.version, tuple(serde.plan(p) for p in response.plans), response.reused)

    def _wait(self, version: int, until: WaitFor, timeout_s: float) -> tuple[VersionInfo, bool]:
        request = pb.WaitVersionRequest(
            job=self.job,
            version=version,
            timeout_s=timeout_s,
            until=pb.WAIT_FOR_RECEIVERS_READY if until is WaitFor.RECEIVERS_READY else pb.WAIT_FOR_SETTLED,
        )
        response = self._call("WaitVersion", request, timeout_s + self.timeout_s)
        return serde.version_info(response.info), response.condition_met

    def wait_receivers_ready(self, version: int, timeout_s: float) -> VersionInfo:
        """Block until every planned live receiver reported ready (or was dropped); raise on timeout."""
        info, met = self._wait(version, WaitFor.RECEIVERS_READY, timeout_s)
        if not met:
            waiting = [r.replica_id for r in info.replicas if r.status == "planned"]
            raise faults.DeadlineExceeded(f"version {version}: receivers {waiting} not ready after {timeout_s:g}s")
        return info

    def wait_version(self, version: int, timeout_s: float) -> VersionState:
        """The version's state once settled (READY, FAILED, SUPERSEDED), or STAGING if ``timeout_s`` passed."""
        return self._wait(version, WaitFor.SETTLED, timeout_s)[0].state

    def version_info(self, version: int, timeout_s: float = 0.001) -> VersionInfo:
        return self._wait(version, WaitFor.SETTLED, timeout_s)[0]

    def mark_durable(self, version: int, manifest_path: str, manifest_sha256: str) -> VersionInfo:
        response = self._call(
            "MarkDurable",
            pb.MarkDurableRequest(
                job=self.job, version=version, manifest_path=manifest_path, manifest_sha256=manifest_sha256
            ),
        )
        return serde.version_info(response.info)

    # ---- replica -----------------------------------------------------------------------------------------------------

    def watch(self) -> Iterator[Assignment]:
        """Assignments for this replica until ``close()``; reconnects across lease changes and restarts."""
        delay = 0.05
        while not self._closed.is_set():
            lease_id = self.lease.lease_id
            call = self._rpc["WatchVersions"](
                pb.WatchRequest(lease_id=lease_id), timeout=STREAM_WINDOW_S, metadata=self._metadata
            )
            with self._lock:
                self._active.append(call)
            try:
                for event in call:
                    delay = 0.05
                    yield serde.event(event)
            except grpc.RpcError as e:
                code = e.code()
                if self._closed.is_set() or code is grpc.StatusCode.CANCELLED:
                    return
                if code is grpc.StatusCode.NOT_FOUND:  # lease gone (expired, coordinator restarted)
                    self._reregister(stale=lease_id)
                elif code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _error(e) from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                with self._lock:
                    self._active.remove(call)

    def _reregister(self, stale: str | None = None) -> None:
        """Register again with the same incarnation, unless another thread already replaced lease ``stale``."""
        with self._lock:
            request = self._register_request
            if stale is not None and self._lease is not None and self._lease.lease_id != stale:
                return
        if request is not None:
            try:
                self._register(request)
            except RetryableError as e:
                log.warning("re-registration failed: %s", e)

    def report_ready(self, version: int) -> None:
        self.report_progress(version, Progress.READY_TO_RECEIVE)

    def report_progress(self, version: int, progress: Progress) -> None:
        wire = {
            Progress.READY_TO_RECEIVE: pb.PROGRESS_READY_TO_RECEIVE,
            Progress.RECEIVING: pb.PROGRESS_RECEIVING,
            Progress.LOADING: pb.PROGRESS_LOADING,
        }[progress]
        self._call(
            "ReportProgress", pb.ReportProgressRequest(lease_id=self.lease.lease_id, version=version, progress=wire)
        )

    def ack(self, report: AckReport) -> VersionState:
        """Report the outcome of one version; returns the version's state after this ack."""
        response = self._call("Ack", serde.ack_to(self.lease.lease_id, report))
        if report.ok:
            self.set_current_version(report.version)
        return serde.state(response.state)

    # ---- reads -----------------------------------------------------------------------------------------------------

    def get_job(self, job: str | None = None) -> JobInfo:
        return serde.job_info(self._call("GetJob", pb.GetJobRequest(job=job or self.job)).job)

    def list_versions(self, job: str | None = None, limit: int = 0) -> list[VersionInfo]:
        response = self._call("ListVersions", pb.ListVersionsRequest(job=job or self.job, limit=limit))
        return [serde.version_info(v) for v in response.versions]

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for call in list(self._active):
                call.cancel()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=self.timeout_s)
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cpu_replica(host: str = "127.0.0.1", volume_id: str = "", volume_mount: str = "") -> Capabilities:
    """Capabilities of a CPU-engine replica that receives the cpu stream (and the volume when mounted)."""
    from weightsync.vocabulary import Channel

    channels = (Channel.CPU, Channel.VOLUME) if volume_id else (Channel.CPU,)
    return Capabilities(
        host=host, channels=channels, engine=EngineKind.CPU, volume_id=volume_id, volume_mount=volume_mount
    )
