"""Leader election on a ``coordination.k8s.io`` Lease: one operator reconciles, the others stand by.

The rules are client-go's (the ones controller-runtime operators such as KubeRay's use):

- A candidate takes the Lease when nobody holds it, or when its record has not changed for
  ``leaseDurationSeconds`` *as the candidate's own monotonic clock saw it* (never the holder's
  ``renewTime``: the hosts' clocks may disagree).
- Every write carries the ``resourceVersion`` it read, so of two candidates racing for a free
  Lease the API server takes one and refuses the other (409).
- The leader renews every ``retry_s`` with one PUT of the Lease as it last wrote it (a standby
  reads it with one GET per try). Once the leader has not renewed for ``renew_deadline_s``, or
  it sees another holder, it stops at once (``on_lost``; the operator exits the process, the
  only way to stop reconciles running in threads). A standby takes over only after ``lease_s``
  without a change, which is longer than the deadline, so the two never reconcile together.
- A leader that stops cleanly releases the Lease (empties the holder), so a standby takes over
  at its next try instead of after ``lease_s``.

The chart makes the Lease, empty (so ``helm uninstall`` removes it and the operators need no
right to create Leases); outside the chart the first candidate creates it, if it may.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from weightsync_operator.kubeapi import LEASE, Api, Obj

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timing:
    """client-go's defaults; ``renew_deadline_s`` < ``lease_s`` is what keeps two leaders apart."""

    lease_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_s < self.renew_deadline_s < self.lease_s:
            raise ValueError(
                f"leader election needs 0 < retry ({self.retry_s}s) < renew deadline ({self.renew_deadline_s}s) "
                f"< lease duration ({self.lease_s}s)"
            )


@dataclass(frozen=True)
class Election:
    """Where the Lease lives and who this candidate is."""

    namespace: str
    name: str
    identity: str
    timing: Timing = field(default_factory=Timing)

    def candidate(self, api: Api) -> Lease:
        return Lease(api, self.namespace, self.name, self.identity, self.timing)


def default_identity() -> str:
    """The pod's name (the chart passes it as POD_NAME) or the host's, and a random suffix: a restarted process
    is a new candidate, never mistaken for the leader it replaces."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # a MicroTime


@dataclass
class Lease:
    """One candidate for the Lease ``namespace/name``."""

    api: Api
    namespace: str
    name: str
    identity: str
    timing: Timing = field(default_factory=Timing)
    holder: str = ""
    """The holder the last attempt saw ("" when free or unknown)."""
    _seen: tuple[str, float] = ("", 0.0)
    """The record's resourceVersion last seen, and when (monotonic): the clock a takeover is judged by."""
    _written: Obj | None = None
    """The Lease as this candidate last wrote it: a leader renews it with one PUT, no GET (a 409 says somebody
    else wrote, and the next attempt reads)."""

    def attempt(self, timeout: float) -> bool:
        """One try to take or renew the Lease; True when this candidate holds it afterwards."""
        now = _now()
        mine = {"holderIdentity": self.identity, "leaseDurationSeconds": round(self.timing.lease_s), "renewTime": now}
        if self._written is not None:
            self._written = self.api.replace({**self._written, "spec": {**self._written["spec"], **mine}}, timeout)
            if self._written is not None:
                return True
        current = self.api.get(LEASE.kind, self.namespace, self.name, timeout=timeout)
        if current is None:
            body: Obj = {
                "apiVersion": LEASE.api_version,
                "kind": LEASE.kind,
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {**mine, "acquireTime": now, "leaseTransitions": 0},
            }
            won = self.api.create(body, timeout=timeout)  # the first renewal reads what was created
            self.holder = self.identity if won else ""
            self._seen = ("", 0.0)
            return won
        spec = current.get("spec") or {}
        version = current["metadata"]["resourceVersion"]
        if version != self._seen[0]:
            self._seen = (version, time.monotonic())
        self.holder = spec.get("holderIdentity") or ""
        expired = time.monotonic() - self._seen[1] > float(spec.get("leaseDurationSeconds") or 0)
        if self.holder not in ("", self.identity) and not expired:
            return False
        taking_over = self.holder != self.identity
        spec = {
            **spec,
            **mine,
            "acquireTime": now if taking_over else spec.get("acquireTime", now),
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (1 if taking_over else 0),
        }
        self._written = self.api.replace({**current, "spec": spec}, timeout=timeout)
        if self._written is None:
            return False  # somebody wrote in between: the next attempt reads who
        self.holder = self.identity
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Block until this candidate leads (True) or ``stop`` is set (False)."""
        waiting_on = None
        while not stop.is_set():
            try:
                if self.attempt(timeout=self.timing.retry_s):
                    log.info("leading as %s (Lease %s/%s)", self.identity, self.namespace, self.name)
                    return True
            except Exception as err:  # noqa: BLE001 - any failure is a failed try (timeouts are urllib3's)
                log.warning("leader election: %s", err)
            if self.holder and self.holder != waiting_on:
                waiting_on = self.holder
                log.info("standing by as %s: %s leads", self.identity, self.holder)
            stop.wait(self.timing.retry_s)
        return False

    def keep(self, on_lost: Callable[[str], None], stop: threading.Event) -> None:
        """Renew in a daemon thread until ``stop``; call ``on_lost(why)`` once leadership may have gone."""

        def renew() -> None:
            renewed = time.monotonic()
            while not stop.wait(self.timing.retry_s):
                left = self.timing.renew_deadline_s - (time.monotonic() - renewed)
                try:
                    # up to three calls per attempt (a refused PUT, the GET, the PUT), each bounded so that hung
                    # ones end within the deadline
                    if left > 0 and self.attempt(timeout=max(left / 3, 0.1)):
                        renewed = time.monotonic()
                        continue
                except Exception as err:  # noqa: BLE001 - any failure is a failed renewal
                    log.warning("leader election: renewing failed: %s", err)
                if self.holder not in ("", self.identity):
                    return on_lost(f"the Lease {self.namespace}/{self.name} is held by {self.holder}")
                if time.monotonic() - renewed >= self.timing.renew_deadline_s:
                    return on_lost(f"the Lease was not renewed for {self.timing.renew_deadline_s:g}s")

        threading.Thread(target=renew, name="leader-lease", daemon=True).start()

    def release(self) -> None:
        """Give the Lease up (if still held) so a standby takes over at its next try."""
        try:
            current = self.api.get(LEASE.kind, self.namespace, self.name, timeout=self.timing.retry_s)
            if current is None or (current.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            spec = {**current["spec"], "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _now()}
            if self.api.replace({**current, "spec": spec}, timeout=self.timing.retry_s):
                log.info("released the Lease %s/%s", self.namespace, self.name)
        except Exception as err:  # noqa: BLE001 - a standby then takes over when the Lease expires
            log.warning(
                "leader election: releasing failed (a standby takes over after %gs): %s", self.timing.lease_s, err
            )
