"""The phases of one publish on the sending rank: each does one job and returns what it did, typed and timed.

``Publisher.publish`` runs them in order and builds its report from their results alone::

    opened = open_version(...)        # Opened: the version and its plans (or Unpublished: the coordinator is away)
    joined = join(...)                # Joined: the live senders, and the receivers left out before the first byte
    streamed = stream(...)            # Streamed: the digests sent, the receivers lost mid-stream, the volume snapshot
    verdict = settle(...)             # Verdict: the version's state once settled, the durable copy when awaited
    released = release(...)           # Released: one-sided channels' buffers free again

Each result carries the seconds its phase took, measured by the phase itself (``_Clock``),
so no phase's time is derived from another's. A phase talks to the coordinator through
the client and to the replicas only through the channel contract (``channels.base``):
a sharded sender (every trainer rank sending its own regions) slots into ``stream``
without touching the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from weightsync.channels.base import NoReceiver, Offer, Sender, SendReport, UpdateTicket
from weightsync.coordinator import models
from weightsync.coordinator.client import CoordinatorClient
from weightsync.errors import RetryableError, WeightsyncError
from weightsync.tensors import content_digest
from weightsync.vocabulary import Channel, ReplicaState, VersionState
from weightsync_trainer.durable import Snapshot, VolumeCopies
from weightsync_trainer.sources import WeightSource

log = logging.getLogger(__name__)


class _Clock:
    """Seconds since the phase began."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.t0


def take_part(source: WeightSource) -> None:
    """Iterate the gather without sending: what every rank that does not send does (gathers are collective)."""
    for _ in source.groups():
        pass


# ---- open ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Opened:
    opened: models.OpenedVersion
    seconds: float

    @property
    def version(self) -> int:
        return self.opened.version


@dataclass(frozen=True)
class Unpublished:
    """The coordinator stayed unreachable past the client's deadline: the step was not published."""

    reason: str
    seconds: float


def open_version(
    client: CoordinatorClient,
    source: WeightSource,
    step: int,
    summary: models.TableSummary,
    offers: Sequence[Offer],
    timeout_s: float,
    gather_on_failure: bool = True,
) -> Opened | Unpublished:
    """Open the version at the coordinator, which plans every live replica. A coordinator that is down or
    unreachable does not stop training (the next publish sends a whole version anyway); any other refusal
    raises. On both the gather still runs when the other ranks are in it (``gather_on_failure``; a trainer that
    sends regions tells its ranks in its round whether a gather follows, ``region_sends``)."""
    clock = _Clock()
    try:
        # as long as a transfer may take: a restarted coordinator holds opens for a lease TTL
        opened = client.open_version(step, summary, offers=offers, timeout_s=timeout_s)
    except WeightsyncError as e:
        if gather_on_failure:
            take_part(source)
        if not isinstance(e, RetryableError):
            raise
        log.warning("step %d not published: the coordinator is unreachable (%s)", step, e)
        return Unpublished(f"not published: the coordinator is unreachable ({e})", clock.seconds())
    return Opened(opened, clock.seconds())


# ---- join ------------------------------------------------------------------------------------------------------------


class LostReports:
    """Receivers lost while a version is under way, told to the coordinator at once (``ReportLost``), so each moves
    to its fallback alone and before its own receive timeout. Reports go out on a thread of their own: a sender
    loses a receiver on its sending thread, which must not wait for a round trip."""

    def __init__(self, client: CoordinatorClient, version: int) -> None:
        self.client, self.version = client, version
        self._queue: queue.SimpleQueue[tuple[str, str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-lost-v{version}", daemon=True)
        self._thread.start()

    def __call__(self, replica_id: str, why: str) -> None:
        self._queue.put((replica_id, why))

    def _run(self) -> None:
        done = False
        while not done:
            batch: dict[str, str] = {}
            item = self._queue.get()
            while item is not None:  # what is queued goes in one call
                batch[item[0]] = item[1]
                if self._queue.empty():
                    break
                item = self._queue.get()
            done = item is None
            if batch:
                self._tell(batch)

    def _tell(self, lost: Mapping[str, str]) -> None:
        try:
            self.client.report_lost(self.version, lost)
        except WeightsyncError as e:  # the final report (``ReportSent``) names them again
            log.warning("v%d: could not report the lost receivers %s at once: %s", self.version, sorted(lost), e)

    def close(self) -> None:
        """Send what is queued, then stop (bounded: the client's own deadline bounds each call)."""
        self._queue.put(None)
        self._thread.join()


@dataclass(frozen=True)
class Joined:
    live: dict[Channel, Sender]
    """The senders that stream this version (each has at least one receiver whose group formed)."""
    lost: dict[str, str]
    """Receivers left out before the first byte (replica id -> why); those still planned on their channel were
    reported to the coordinator already (the others it had moved or dropped itself)."""
    seconds: float


JOINED_STATES = frozenset({ReplicaState.PLANNED, ReplicaState.JOINED})
JOIN_POLL_S = 0.25
"""How often the publisher reads who joined while it waits for joins (each read is one call to the coordinator)."""
READY_GRACE_S = 1.0
"""How long past the join deadline a sender may still take to settle its groups: a receiver reports itself joined
once its group formed, so the groups of those the coordinator saw join are formed already."""


def _members(info: models.VersionInfo, channel: Channel) -> set[str]:
    return {r.replica_id for r in info.replicas if r.channel is channel and r.state in JOINED_STATES}


def join(
    client: CoordinatorClient, senders: Mapping[Channel, Sender], opened: models.OpenedVersion, lost: LostReports
) -> Joined:
    """Hand each sender its receivers (groups form in the background, each join bounded by the plan's join
    deadline), wait for the replicas to join until that deadline, and go on with those that did: the others are
    reported lost at once and take the version from the volume, alone."""
    clock = _Clock()
    for ch, sender in senders.items():
        sender.take_plan(opened.receivers(ch))
    live = {ch: s for ch, s in senders.items() if opened.receivers(ch)}
    left_out: dict[str, str] = {}
    if not live:
        return Joined(live, left_out, clock.seconds())
    join_s = max(rdv.join_timeout_s for ch in live for rdv in opened.receivers(ch).values())
    deadline = time.monotonic() + join_s
    info: models.VersionInfo | None = None
    met = False
    while not met and time.monotonic() < deadline:
        # in slices: a group that waits for all its members (NCCL) learns at once of one the coordinator moved to
        # the volume (its own side failed: refused, no route) instead of waiting for it until the deadline
        slice_s = min(JOIN_POLL_S, max(0.001, deadline - time.monotonic()))
        try:
            info, met = client.wait_joined(opened.version, slice_s)
        except WeightsyncError as e:
            log.warning("v%d: the coordinator did not answer the wait for joins (%s)", opened.version, e)
            break  # every planned receiver whose group forms by the deadline takes part
        for ch, sender in live.items():
            sender.narrow(_members(info, ch))
    if not met:
        waiting = sorted(r.replica_id for r in info.replicas if r.state is ReplicaState.PLANNED) if info else []
        log.warning("v%d: receivers %s did not join in %gs; sending to those that did", opened.version, waiting, join_s)
    for ch, sender in list(live.items()):
        # the receivers still planned on this channel: the coordinator moved one whose side failed to the volume,
        # and dropped one whose lease ran out (it never will join)
        members = _members(info, ch) if info is not None else set(opened.receivers(ch))
        try:
            out = sender.ready(max(0.0, deadline - time.monotonic()) + READY_GRACE_S, members)
        except WeightsyncError as e:
            log.warning("v%d: the %s sender is not ready: %s", opened.version, ch.value, e)
            named = e.left_out if isinstance(e, NoReceiver) else {}
            out = {rid: named.get(rid, f"{ch.value}: {e}") for rid in opened.receivers(ch)}
            del live[ch]
        left_out.update(out)
        for rid in sorted(members.intersection(out)):  # the others' plans moved already: nothing to tell
            lost(rid, out[rid])
    if left_out:
        log.warning("v%d: sending without %s: %s", opened.version, sorted(left_out), left_out)
    return Joined(live, left_out, clock.seconds())


# ---- stream ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Streamed:
    digests: dict[str, str]
    """Per tensor, what the senders computed where the bytes lay (verification on)."""
    failed: dict[str, str]
    """Receivers a channel lost mid-stream (replica id -> why)."""
    snapshot: Snapshot
    """A copy of each group for the volume (empty without one)."""
    seconds: float

    @property
    def content_digest(self) -> str:
        """What every replica's ack must match (empty with verification off)."""
        return content_digest(self.digests) if self.digests else ""


class _Tee:
    """One gather feeding several senders, each on its own thread through its own queue.

    The queues are unbounded so that the gather never waits for the slowest channel: a sender stalled on a dead
    peer (until its transfer timeout) must not hold back the groups of the others, whose receivers would time out
    too. The cost is memory only where the source materialises groups (a DTensor's gather): a stalled channel
    keeps references to the groups it has not sent until it fails."""

    def __init__(self, jobs: Mapping[Channel, tuple[Sender, UpdateTicket]]) -> None:
        self.queues: dict[Channel, queue.Queue[Sequence[torch.Tensor] | None]] = {}
        self.reports: dict[Channel, SendReport] = {}
        self.errors: dict[Channel, BaseException] = {}
        self.threads: dict[Channel, threading.Thread] = {}
        for ch, (sender, ticket) in jobs.items():
            q: queue.Queue[Sequence[torch.Tensor] | None] = queue.Queue()
            self.queues[ch] = q
            self.threads[ch] = threading.Thread(
                target=self._run, args=(ch, sender, ticket, q), name=f"weightsync-send-{ch.value}", daemon=True
            )
            self.threads[ch].start()

    def _run(
        self, ch: Channel, sender: Sender, ticket: UpdateTicket, q: queue.Queue[Sequence[torch.Tensor] | None]
    ) -> None:
        def groups() -> Iterator[Sequence[torch.Tensor]]:
            while (item := q.get()) is not None:
                yield item

        try:
            self.reports[ch] = sender.send(ticket, groups())
        except BaseException as e:  # noqa: BLE001 - reported for this channel's receivers
            self.errors[ch] = e

    def put(self, group: Sequence[torch.Tensor] | None) -> None:
        for ch, q in self.queues.items():
            if self.threads[ch].is_alive():
                q.put(group)

    def join(self) -> None:
        self.put(None)
        for t in self.threads.values():
            t.join()


def stream(
    source: WeightSource,
    live: Mapping[Channel, Sender],
    tickets: Mapping[Channel, UpdateTicket],
    receivers: Mapping[Channel, Sequence[str]],
    keep: bool,
    lost: LostReports,
) -> Streamed:
    """Gather once; feed every live sender (one thread per sender when there are several); keep a copy of each group
    for the volume when ``keep``. A receiver a sender loses is reported at once (``lost``); a sender that fails
    loses its ``receivers``; the gather (collective) goes on."""
    clock = _Clock()
    snapshot: Snapshot = []
    for sender in live.values():
        sender.on_lost = lost

    def gathered() -> Iterator[list[torch.Tensor]]:
        for group in source.groups():
            if keep:
                snapshot.append([t.detach().clone() for t in group])
            yield group

    reports: dict[Channel, SendReport] = {}
    errors: dict[Channel, BaseException] = {}
    if len(live) == 1:
        ch, sender = next(iter(live.items()))
        groups = gathered()
        try:
            reports[ch] = sender.send(tickets[ch], groups)
        except Exception as e:  # noqa: BLE001 - reported for this channel's receivers; the gather goes on
            errors[ch] = e
        for _ in groups:  # a failed sender stops early; the gather (collective) goes on
            pass
    else:
        tee = _Tee({ch: (s, tickets[ch]) for ch, s in live.items()})
        for group in gathered():
            tee.put(group)
        tee.join()
        reports, errors = tee.reports, tee.errors
    failed: dict[str, str] = {}
    digests: dict[str, str] = {}
    for report in reports.values():
        failed.update(report.failed)
        digests = digests or report.digests
    for ch, error in errors.items():
        log.warning("v%d: the %s sender failed: %s", tickets[ch].version, ch.value, error)
        failed.update({rid: f"{ch.value}: {error}" for rid in receivers[ch]})
    for sender in live.values():
        sender.on_lost = None
    lost.close()
    return Streamed(digests, failed, snapshot, clock.seconds())


# ---- the verdict -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    state: VersionState
    reason: str
    channels: dict[str, str] = field(default_factory=dict)
    """Replica id -> the channel it was planned on (the volume for a replica that fell back)."""
    durable_seconds: float = 0.0
    """The volume copy, when a replica waited for it (on the version's path); 0 otherwise."""
    seconds: float = 0.0
    """The waits for the replicas' acks (the calls to the coordinator; the durable copy is not among them)."""


def settle(
    client: CoordinatorClient,
    copies: VolumeCopies,
    version: int,
    step: int,
    digest: str,
    failed: Mapping[str, str],
    snapshot: Snapshot,
    wait_s: float,
    region_digests: Mapping[str, str] | None = None,
) -> Verdict:
    """Report what was sent and wait for the verdict; write the volume copy first when a replica waits for it,
    else after the verdict in the background. A coordinator that became unreachable leaves the outcome unknown
    (STAGING): the bytes went out peer to peer, only the verdict is missing. ``region_digests``: replica id -> the
    senders' combined digest of the regions sent to it (its ack must match that, not ``digest``)."""
    waited, durable_seconds = 0.0, 0.0
    regions = dict(region_digests or {})
    try:
        clock = _Clock()
        info = client.report_sent(version, digest, failed, wait_s=wait_s, region_digests=regions)
        waited += clock.seconds()
        if info.durable_needed:
            copy = _Clock()
            volume_error = copies.write(version, step, snapshot)
            durable_seconds = copy.seconds()
            clock = _Clock()
            if volume_error:  # the replicas waiting for it fail now, not at the version's timeout
                client.report_sent(version, digest, failed, volume_error=volume_error, region_digests=regions)
            info = client.wait_version(version, wait_s)
            waited += clock.seconds()
        else:
            copies.write_later(version, step, snapshot)
    except RetryableError as e:
        # a restarted coordinator fails the version (its plans died with it); one that was only unreachable may
        # still settle it
        log.warning("v%d: the coordinator became unreachable mid-publish (%s); its outcome is unknown", version, e)
        copies.write_later(version, step, snapshot)
        reason = f"outcome unknown: the coordinator is unreachable ({e})"
        return Verdict(VersionState.STAGING, reason, {}, durable_seconds, waited)
    channels = {r.replica_id: r.channel.value for r in info.replicas if r.channel is not None}
    return Verdict(info.state, info.reason, channels, durable_seconds, waited)


# ---- release ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Released:
    failed: dict[str, str]
    """Receivers that did not consume the version in time (replica id -> why)."""
    seconds: float


def release(
    live: Mapping[Channel, Sender], receivers: Mapping[Channel, Sequence[str]], version: int, timeout_s: float
) -> Released:
    """Wait until one-sided channels' receivers consumed the version (their buffers may change after)."""
    clock = _Clock()
    failed: dict[str, str] = {}
    for ch, sender in live.items():
        try:
            sender.release(version, timeout_s)
        except WeightsyncError as e:
            failed.update({rid: f"{ch.value}: {e}" for rid in receivers[ch]})
    return Released(failed, clock.seconds())
