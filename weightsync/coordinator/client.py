"""The typed, synchronous client the trainer's publisher and each replica's agent use.

One client is one member of one job (a trainer or a replica). Registering starts a
daemon thread that renews the lease every third of its TTL. When the coordinator
has forgotten the lease (it expired, or the coordinator restarted), the next call
or watch that meets the NOT_FOUND registers again with the same incarnation (one
place, so two threads never race to register), which keeps the member's place in
any staging plan. ``close()`` stops the thread and the channel.

Publisher, one sync (``weightsync_trainer.publisher.Publisher`` does all of this)::

    client = CoordinatorClient("10.0.0.5:50051", token=token, tls=TlsConfig(ca_file="ca.pem"))
    client.register_trainer("my-job", "trainer-0", caps, offers=[sender.offer() for sender in senders])
    opened = client.open_version(step, models.summarize(table))
    ...each sender.take_plan(opened.receivers(sender.channel))...
    client.wait_receivers_joined(opened.version, timeout_s=60)   # every live-planned replica joined or dropped
    ...send over each channel from one gather...
    info = client.report_sent(opened.version, content_digest, failed, wait_s=300)  # settled, or durable_needed
    client.mark_durable(opened.version, manifest_path, manifest_checksum, content_digest)  # when the copy lands

Agent::

    client.register_replica("my-job", "replica-0", caps, current_version=0)
    for a in client.watch():                       # CATCH_UP first when a durable READY version exists
        if a.kind is EventKind.ABORT: ...; continue
        client.report_joined(a.version)
        ...receive, load, verify...
        client.ack(AckReport(a.version, layout_digest, ok=True, content_digest=..., phases={SyncPhase.TOTAL: t}))

Every call has a deadline (``timeout_s``); UNAVAILABLE (coordinator restarting,
network blip) is retried with exponential backoff until that deadline, every
other status raises the matching ``faults`` error at once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Self, TypeVar

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet

from weightsync.channels.base import Offer
from weightsync.coordinator import _service, auth, faults, serde
from weightsync.coordinator.models import (
    AckReport,
    Assignment,
    Capabilities,
    EngineKind,
    JobInfo,
    JobPolicy,
    Layout,
    Lease,
    OpenedVersion,
    Progress,
    Role,
    SentReport,
    TableSummary,
    VersionInfo,
    WaitFor,
)
from weightsync.coordinator.tls import TlsConfig
from weightsync.errors import PermanentError, RetryableError, WeightsyncError
from weightsync.sharding.fills import EngineLayout
from weightsync.sharding.plans import Region
from weightsync.sharding.shards import TrainerLayout
from weightsync.vocabulary import ReplicaState, VersionState

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


@dataclass(frozen=True)
class Registration:
    """What this member registers with (again, after a lost lease): its latest served version included."""

    job: str
    role: Role
    member_id: str
    capabilities: Capabilities
    policy: JobPolicy | None = None
    offers: tuple[Offer, ...] = ()
    current_version: int = 0
    layout: Layout | None = None


RECONNECT_MIN_MS, RECONNECT_MAX_MS = 250, 2000
DECODED_PARTS = 4
"""Parts read with ``GetPlanRegions`` kept decoded by their bytes (Qwen3-235B's: 355,584 regions, ~5 s to decode)."""


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
            # gRPC's own reconnect backoff grows to 120 s: after a long coordinator outage a client would
            # otherwise find the restarted coordinator only minutes later
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_MIN_MS),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_MIN_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
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
        self._registration: Registration | None = None
        self._lease: Lease | None = None
        self._renewer: threading.Thread | None = None
        self._active: list[Any] = []
        # the replicas' regions of the plans open_version returned, and this replica's its watch stream sent; a part
        # left out that this end does not hold (too large for one message) is read with GetPlanRegions
        self._opened_parts = serde.HeldRegions(fetch=self.plan_regions)
        self._watched_parts = serde.HeldRegions(fetch=self.plan_regions)
        self._decoded: dict[bytes, tuple[Region, ...]] = {}  # parts read, newest first, by their bytes' digest

    # ---- plumbing ----------------------------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        request: Callable[[], Any],
        timeout_s: float | None = None,
        read: Callable[[Any], Any] | None = None,
    ) -> Any:
        """One call, retrying UNAVAILABLE with backoff until the deadline.

        ``request`` builds the message each try, so a retry after re-registering carries the new lease. ``read``
        takes a streaming method's answer (read whole inside the try: a stream's errors come as it is read).
        """
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        delay = 0.05
        renewed = False
        unavailable = False
        while True:
            left = deadline - time.monotonic()
            try:
                answer = self._rpc[method](request(), timeout=max(left, 0.001), metadata=self._metadata)
                return answer if read is None else read(answer)
            except grpc.RpcError as e:
                lease_lost = e.code() is grpc.StatusCode.NOT_FOUND and (e.details() or "").startswith("lease ")
                if lease_lost and not renewed and method not in ("Register", "Renew") and self._lease is not None:
                    # the coordinator restarted or our lease lapsed: register again (same incarnation) and retry once
                    renewed = True
                    self._reregister(stale=self._lease.lease_id)
                    continue
                # the last try ran into the deadline while the coordinator was unreachable: say so, not "slow"
                gone = unavailable and e.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                if (e.code() is not grpc.StatusCode.UNAVAILABLE and not gone) or self._closed.is_set():
                    raise _error(e) from None
                unavailable = True
                if gone or time.monotonic() + delay >= deadline:
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
        if self._registration is None:
            raise PermanentError("not registered: call register_trainer() or register_replica() first")
        return self._registration.job

    # ---- registration and leases ---------------------------------------------------------------------------------

    def _register(self, r: Registration) -> Lease:
        response = self._call(
            "Register",
            lambda: serde.register_request(
                r.job,
                r.role,
                r.member_id,
                self.incarnation,
                r.capabilities,
                r.policy,
                r.offers,
                r.current_version,
                r.layout,
            ),
        )
        lease = serde.lease(response.lease)
        with self._lock:
            self._registration, self._lease = r, lease
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
        offers: Sequence[Offer] = (),
        layout: TrainerLayout | None = None,
    ) -> Lease:
        """``layout``: where the trainer's tensors lie across its ranks (``weightsync_trainer.layouts``); with it
        the coordinator plans the sharded path for every replica that registered its engine layout."""
        return self._register(
            Registration(job, Role.TRAINER, trainer_id, capabilities, policy, tuple(offers), layout=layout)
        )

    def register_replica(
        self,
        job: str,
        replica_id: str,
        capabilities: Capabilities,
        *,
        current_version: int = 0,
        layout: EngineLayout | None = None,
    ) -> Lease:
        """``layout``: what each of the replica's workers keeps (``EngineLayout.merged``), for the sharded path."""
        return self._register(
            Registration(job, Role.REPLICA, replica_id, capabilities, current_version=current_version, layout=layout)
        )

    def _renew_loop(self) -> None:
        while not self._closed.wait(max(0.05, (self._lease.ttl_s if self._lease else 3.0) / 3)):
            try:
                self._call("Renew", functools.partial(serde.renew_request, self.lease.lease_id))
            except faults.NotFound:
                log.warning("coordinator forgot our lease (expired or restarted); the next call registers again")
            except WeightsyncError as e:
                if not self._closed.is_set():
                    log.warning("lease renewal failed: %s", e)

    def set_current_version(self, version: int) -> None:
        """Tell later re-registrations which version this replica serves (the agent calls it after a load)."""
        with self._lock:
            if self._registration is not None:
                self._registration = replace(self._registration, current_version=version)

    # ---- publisher -------------------------------------------------------------------------------------------------

    def open_version(
        self, step: int, table: TableSummary, *, offers: Sequence[Offer] = (), timeout_s: float | None = None
    ) -> OpenedVersion:
        held = self._opened_parts

        def request(key: str) -> Any:
            return serde.open_request(self.lease.lease_id, self.job, self.incarnation, step, table, offers, key)

        key = held.newest
        return serde.opened(self._call("OpenVersion", lambda: request(key), timeout_s), held)

    def plan_regions(self, plan_key: str, replica_id: str) -> tuple[Region, ...]:
        """Replica ``replica_id``'s regions of plan ``plan_key``, read in chunks: a part a message left out that this
        end does not hold (``ReplicaRegions.held``; too large for one message, or forgotten). A part whose bytes
        equal one read before (replicas of one engine layout: rank 0 reads every replica's) is not decoded again."""

        def read(answer: Iterator[Any]) -> tuple[Region, ...]:
            chunks = list(answer)
            h = hashlib.sha256()
            for c in chunks:
                h.update(c.SerializeToString())
            same = self._decoded.get(h.digest())
            if same is None:
                same = serde.chunked_regions(chunks, f"replica {replica_id!r}'s regions of plan {plan_key[:19]}...")
                self._decoded = {h.digest(): same, **dict(list(self._decoded.items())[: DECODED_PARTS - 1])}
            return same

        return self._call(  # type: ignore[no-any-return]
            "GetPlanRegions", lambda: serde.plan_regions_request(self.lease.lease_id, plan_key, replica_id), read=read
        )

    def _wait(self, version: int, until: WaitFor, timeout_s: float, job: str | None = None) -> tuple[VersionInfo, bool]:
        response = self._call(
            "WaitVersion",
            lambda: serde.wait_request(job or self.job, version, until, timeout_s),
            timeout_s + self.timeout_s,
        )
        return serde.version_info(response.info), response.condition_met

    def wait_joined(self, version: int, timeout_s: float) -> tuple[VersionInfo, bool]:
        """The version once every replica planned on a live channel joined (or moved off it, or was dropped), or
        as it stands after ``timeout_s``; and whether they all had."""
        return self._wait(version, WaitFor.RECEIVERS_JOINED, timeout_s)

    def wait_receivers_joined(self, version: int, timeout_s: float) -> VersionInfo:
        """Block until every replica planned on a live channel joined (or was dropped); raise on timeout."""
        info, met = self.wait_joined(version, timeout_s)
        if not met:
            waiting = [r.replica_id for r in info.replicas if r.state is ReplicaState.PLANNED]
            raise faults.DeadlineExceeded(f"version {version}: receivers {waiting} did not join in {timeout_s:g}s")
        return info

    def wait_version(self, version: int, timeout_s: float, *, durable_needed: bool = False) -> VersionInfo:
        """The version once settled (READY, FAILED, SUPERSEDED), or as it stands when ``timeout_s`` passed.

        With ``durable_needed`` it also returns when a planned replica waits for the volume copy
        (``info.durable_needed``): the publisher then writes it and waits again.
        """
        until = WaitFor.SETTLED_OR_DURABLE_NEEDED if durable_needed else WaitFor.SETTLED
        return self._wait(version, until, timeout_s)[0]

    def version_info(self, version: int, timeout_s: float = 0.001, job: str | None = None) -> VersionInfo:
        """The version as it stands (``job``: another job than this member's, for status tools)."""
        return self._wait(version, WaitFor.SETTLED, timeout_s, job)[0]

    def report_sent(
        self,
        version: int,
        content_digest: str,
        failed: Mapping[str, str],
        *,
        volume_error: str = "",
        wait_s: float = 0.0,
        region_digests: Mapping[str, str] | None = None,
    ) -> VersionInfo:
        """Tell the coordinator what was sent (replicas' acks are checked against it), which receivers were lost,
        and, when the volume copy failed, why (the replicas waiting for it fail). May be called again.

        ``wait_s`` > 0 also waits, in the same call, until the version settled or a planned replica waits for the
        volume copy (``info.durable_needed``), or ``wait_s`` passed: one round trip less on every version's path.
        ``region_digests``: replica id -> the combined digest of the regions sent to it (the sharded path)."""
        sent = SentReport(content_digest, dict(failed), volume_error, dict(region_digests or {}))
        response = self._call(
            "ReportSent",
            lambda: serde.report_sent_to(self.lease.lease_id, version, sent, wait_s),
            wait_s + self.timeout_s,
        )
        return serde.version_info(response.info)

    def report_lost(self, version: int, lost: Mapping[str, str]) -> None:
        """Tell the coordinator, while the version is under way, which receivers a sender lost (they missed the
        join deadline, or their channel failed): each falls back to the volume at once, alone."""
        self._call("ReportLost", lambda: serde.report_lost_to(self.lease.lease_id, version, lost))

    def mark_durable(
        self, version: int, manifest_path: str, manifest_checksum: str, content_digest: str = ""
    ) -> VersionInfo:
        """The version's volume copy landed; ``content_digest``: over the per-tensor digests written there."""
        response = self._call(
            "MarkDurable",
            lambda: serde.mark_durable_request(self.job, version, manifest_path, manifest_checksum, content_digest),
        )
        return serde.version_info(response.info)

    # ---- replica -----------------------------------------------------------------------------------------------------

    def watch(self) -> Iterator[Assignment]:
        """Assignments for this replica until ``close()``; reconnects across lease changes and restarts."""
        delay = 0.05
        while not self._closed.is_set():
            lease_id = self.lease.lease_id
            call = self._rpc["WatchVersions"](
                serde.watch_request(lease_id), timeout=STREAM_WINDOW_S, metadata=self._metadata
            )
            with self._lock:
                self._active.append(call)
            try:
                for event in call:
                    try:
                        assignment = serde.event(event, self._watched_parts)
                    except WeightsyncError as e:
                        # its plan part could not be read (GetPlanRegions: the coordinator lost the plan, or is
                        # away): a new stream replays the version's assignment, and its part is read again then
                        log.warning("version %d's assignment: %s; the stream is opened again", event.version, e)
                        call.cancel()
                        time.sleep(delay)
                        delay = min(delay * 2, 2.0)
                        break
                    delay = 0.05
                    yield assignment
            except grpc.RpcError as e:
                code = e.code()
                if self._closed.is_set():
                    return
                if code is grpc.StatusCode.NOT_FOUND:  # lease gone (expired, coordinator restarted)
                    self._reregister(stale=lease_id)
                elif code not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.CANCELLED,  # by the server or a proxy on the way, not by us: open it again
                ):
                    raise _error(e) from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                with self._lock:
                    self._active.remove(call)

    def _reregister(self, stale: str | None = None) -> None:
        """Register again with the same incarnation, unless another thread already replaced lease ``stale``."""
        with self._lock:
            registration = self._registration
            if stale is not None and self._lease is not None and self._lease.lease_id != stale:
                return
        if registration is not None:
            try:
                self._register(registration)
            except RetryableError as e:
                log.warning("re-registration failed: %s", e)

    def report_joined(self, version: int) -> None:
        """This replica's receiver is set up for ``version`` and waits for its bytes."""
        self.report_progress(version, Progress.JOINED)

    def report_progress(self, version: int, progress: Progress) -> None:
        self._call("ReportProgress", lambda: serde.progress_request(self.lease.lease_id, version, progress))

    def ack(self, report: AckReport) -> VersionState:
        """Report the outcome of one version; returns the version's state after this ack."""
        response = self._call("Ack", lambda: serde.ack_to(self.lease.lease_id, report))
        if report.ok:
            self.set_current_version(report.version)
        return serde.state(response.state)

    # ---- reads -----------------------------------------------------------------------------------------------------

    def get_job(self, job: str | None = None) -> JobInfo:
        return serde.job_info(self._call("GetJob", lambda: serde.get_job_request(job or self.job)).job)

    def list_versions(self, job: str | None = None, limit: int = 0) -> list[VersionInfo]:
        """Newest first (``limit`` 0: all the coordinator keeps), cut short (logged) where the answer would pass
        the coordinator's message limit: a large fleet's per-replica details fill it in fewer versions."""
        response = self._call("ListVersions", lambda: serde.list_request(job or self.job, limit))
        if response.truncated:
            log.warning("ListVersions: the coordinator left out versions older than v%d", response.versions[-1].version)
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


def until_registered(register: Callable[[], Lease], who: str, stop: threading.Event | None = None) -> Lease | None:
    """``register()`` once the coordinator answers: a coordinator not up yet (or restarting) is waited out with
    jittered backoff (0.5 s doubling to 15 s, each wait logged); other errors raise. None if ``stop`` was set."""
    stop = stop or threading.Event()
    delay = 0.5
    while not stop.is_set():
        try:
            return register()
        except RetryableError as e:
            log.warning("%s: cannot register yet (%s); retrying in %.1fs", who, e, delay)
            stop.wait(delay * (0.5 + random.random()))
            delay = min(delay * 2, 15.0)
    return None
