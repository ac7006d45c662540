"""The coordinator's state machine behind one lock: jobs, members and their leases, versions, watchers.

No gRPC here: the servicer translates wire messages into calls on ``Coordinator``
and its exceptions (``faults``) into status codes, so every rule is testable in one
process. ``Coordinator`` is a thin facade: it owns the one condition that guards
all state (``state.CoreState``), takes it for each call, and delegates to the
module that holds the rule:

- ``leases``: registration rules, lease grant and renewal, removing a member;
- ``versions``: opening a version and negotiating its plans, progress, acks, the
  fallback to the volume, the publisher's report of what it sent;
- ``verdicts``: settling a version (READY supersedes, FAILED aborts) and failing it;
- ``durability``: durable marks, volume plans sent on durability, volume retention;
- ``streams``: per-member event queues, what a new stream replays, who is watching;
- ``reads``: job summaries and version lists;
- ``reaper``: what time passing does (expired leases, version timeouts);
- ``gauges``: the metrics recomputed from the state on ticks and scrapes.

Calls are short (no I/O but a few store writes per version; ``mark_durable``
reads the manifest off the lock), so contention stays far below the RPC cost.
Blocking waits (``wait_version``) release the lock on the condition; replica
streams read per-member queues, so an ack wakes only whoever waits on that version.

Time comes from an injectable ``clock.Clock`` (``SystemClock`` by default):
monotonic time for leases, version timeouts, the watching window and wait
deadlines; wall time for ``opened_at``/``settled_at``. Nothing expires between
ticks: the reaper thread (``tick``) applies expiry, so with a ``ManualClock`` a
test advances the clock and calls ``tick()``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from weightsync import metrics as metrics_mod
from weightsync.channels import manifests
from weightsync.channels.base import Offer
from weightsync.coordinator import durability, faults, leases, reads, reaper, streams, versions
from weightsync.coordinator.clock import SYSTEM_CLOCK, Clock
from weightsync.coordinator.models import (
    AckReport,
    Assignment,
    Capabilities,
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
from weightsync.coordinator.state import CoreState
from weightsync.coordinator.store import MemoryStore, VersionStore
from weightsync.sharding import plans as sharding_plans
from weightsync.sharding.plans import Region
from weightsync.vocabulary import VersionState

_PLAN_TRIES = 3
"""Opens of one version that compute their new plan off the lock before one computes it under the lock."""


class Coordinator:
    """Thread-safe control-plane state. Call ``tick()`` periodically (the server's reaper does)."""

    def __init__(
        self,
        *,
        lease_ttl_s: float = 10.0,
        default_policy: JobPolicy | None = None,
        store: VersionStore | None = None,
        metrics: metrics_mod.CoordinatorMetrics | None = None,
        volumes: Mapping[str, Path] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``volumes``: each job's checkpoint volume as this process mounts it (job -> root). With one, the
        coordinator hashes the manifests itself when versions become durable and prunes the volume.
        ``clock``: where time comes from (the process's own clocks by default; ``clock.ManualClock`` in tests)."""
        if lease_ttl_s <= 0:
            raise faults.InvalidArgument(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self._cond = threading.Condition()
        self._state = CoreState(
            cond=self._cond,
            clock=clock,
            lease_ttl_s=lease_ttl_s,
            default_policy=default_policy or JobPolicy(),
            store=store if store is not None else MemoryStore(),
            metrics=metrics,
            volumes={job: Path(root) for job, root in (volumes or {}).items()},
        )
        with self._cond:
            for job in self._state.store.jobs():
                self._state.job(job, create=True)

    # what the servicer, the server and the CLI read

    @property
    def lease_ttl_s(self) -> float:
        return self._state.lease_ttl_s

    @property
    def default_policy(self) -> JobPolicy:
        return self._state.default_policy

    @property
    def store(self) -> VersionStore:
        return self._state.store

    @property
    def metrics(self) -> metrics_mod.CoordinatorMetrics | None:
        return self._state.metrics

    @property
    def volumes(self) -> dict[str, Path]:
        return self._state.volumes

    @property
    def clock(self) -> Clock:
        return self._state.clock

    # ---- members (leases) -------------------------------------------------------------------------------------

    def register(
        self,
        job_name: str,
        role: Role,
        member_id: str,
        incarnation: str,
        capabilities: Capabilities,
        *,
        policy: JobPolicy | None = None,
        offers: Sequence[Offer] = (),
        current_version: int = 0,
        layout: Layout | None = None,
    ) -> Lease:
        with self._cond:
            return leases.register(
                self._state,
                job_name,
                role,
                member_id,
                incarnation,
                capabilities,
                policy=policy,
                offers=offers,
                current_version=current_version,
                layout=layout,
            )

    def renew(self, lease_id: str) -> Lease:
        with self._cond:
            return leases.renew(self._state, lease_id)

    # ---- versions ---------------------------------------------------------------------------------------------

    def open_version(
        self,
        lease_id: str,
        job_name: str,
        incarnation: str,
        step: int,
        table: TableSummary,
        offers: Sequence[Offer] = (),
    ) -> OpenedVersion:
        """A new transfer plan (a layout or the membership changed) is computed off the lock, so the other calls,
        renewals above all, go on meanwhile (Qwen3-235B to 8 replicas: seconds); opened again with it, the
        membership may have changed in between: a few tries, then the plan is computed under the lock."""
        for _ in range(_PLAN_TRIES):
            with self._cond:
                try:
                    return versions.open_version(
                        self._state, lease_id, job_name, incarnation, step, table, offers, compute_plan=False
                    )
                except sharding_plans.Unplanned as e:
                    needed = e
            computed = sharding_plans.plan(needed.trainer, needed.members)
            with self._cond:
                self._state.job(job_name).transfer_plans.put(computed)
        with self._cond:
            return versions.open_version(self._state, lease_id, job_name, incarnation, step, table, offers)

    def plan_regions(self, lease_id: str, plan_key: str, replica_id: str) -> tuple[Region, ...]:
        """A replica's regions of a plan whose parts a message left out for their size (``versions.plan_regions``)."""
        with self._cond:
            return versions.plan_regions(self._state, lease_id, plan_key, replica_id)

    def report_progress(self, lease_id: str, version: int, progress: Progress) -> None:
        with self._cond:
            versions.report_progress(self._state, lease_id, version, progress)

    def ack(self, lease_id: str, report: AckReport) -> VersionState:
        with self._cond:
            return versions.ack(self._state, lease_id, report)

    def report_sent(self, lease_id: str, version: int, sent: SentReport) -> VersionInfo:
        """The publisher sent ``version``: record what it sent, and fail replicas that loaded something else."""
        with self._cond:
            return versions.report_sent(self._state, lease_id, version, sent)

    def report_lost(self, lease_id: str, version: int, lost: Mapping[str, str]) -> None:
        """The publisher lost these receivers mid-version: each falls back to the volume now, alone."""
        with self._cond:
            versions.report_lost(self._state, lease_id, version, lost)

    def wait_version(self, job_name: str, version: int, until: WaitFor, timeout_s: float) -> tuple[VersionInfo, bool]:
        """Block until the version reached ``until`` (or settled) or ``timeout_s`` passed on the core's clock.

        Each real wait is bounded by what the clock says is left, recomputed after every wake-up: a notification
        (an ack, a join, a durable mark) wakes it at once. Under a ``ManualClock`` a positive timeout ends only
        once the clock was advanced past it."""
        clock = self._state.clock
        deadline = clock.monotonic() + max(0.0, timeout_s)
        with self._cond:
            rec = self._state.record(self._state.job(job_name), version)
            while not versions.reached(rec, until):
                left = deadline - clock.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return rec.info(), versions.reached(rec, until)

    def mark_durable(
        self, job_name: str, version: int, manifest_path: str, checksum: str, content_digest: str = ""
    ) -> VersionInfo:
        """The version's volume copy landed. A coordinator that mounts the job's volume reads the manifest itself
        (from its own mount, never from the client's path) and records its checksum and the content digest of the
        digests it lists; otherwise it records the publisher's. Replicas planned on the volume for this version
        are sent it now."""
        with self._cond:
            durability.check(self._state, job_name, version, checksum, content_digest)
        root = self._state.volumes.get(job_name)
        on_volume: list[int] = []
        if root is not None:  # read off the lock
            manifest_path, content_digest = durability.verify(root, job_name, version, checksum, content_digest)
            on_volume = manifests.list_versions(root)
        with self._cond:
            durable = durability.Durable(manifest_path, checksum, content_digest)
            info, doomed = durability.record(self._state, job_name, version, durable, on_volume)
        if root is not None and doomed:
            manifests.delete(root, doomed)
        return info

    # ---- streams ------------------------------------------------------------------------------------------------

    def subscribe(self, lease_id: str) -> queue.SimpleQueue[Assignment | None]:
        """A fresh event queue for the member's new stream (ending any previous one), primed with a catch-up
        and any staging assignment it missed, then the old queue's unread events (an ABORT sent while no
        stream was open, say). The agent may see a version twice: it dedupes by version number."""
        with self._cond:
            return streams.subscribe(self._state, lease_id)

    def stream_ended(self, lease_id: str) -> None:
        """The servicer calls this when a watch stream of ``lease_id`` ends, however it ends."""
        with self._cond:
            streams.stream_ended(self._state, lease_id)

    # ---- reads ------------------------------------------------------------------------------------------------

    def get_job(self, job_name: str) -> JobInfo:
        with self._cond:
            return reads.get_job(self._state, job_name)

    def list_versions(self, job_name: str, limit: int = 0) -> list[VersionInfo]:
        with self._cond:
            return reads.list_versions(self._state, job_name, limit)

    def jobs(self) -> list[str]:
        with self._cond:
            return reads.job_names(self._state)

    # ---- time and metrics ---------------------------------------------------------------------------------------

    def tick(self) -> None:
        """Expire leases that were not renewed and versions that stayed STAGING too long; refresh the gauges."""
        now = self._state.clock.monotonic()
        with self._cond:
            reaper.tick(self._state, now)
            if self._state.dirty:
                self._state.refresh_gauges()

    def refresh_metrics(self) -> None:
        """Recompute the gauges now (a /metrics scrape calls it; so does every tick when something changed)."""
        with self._cond:
            self._state.refresh_gauges()
