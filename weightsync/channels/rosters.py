"""Who is in a group channel's communicator: decided by the sender at the join deadline, again when a member dies.

A group channel (NCCL: one communicator for every replica planned on it) cannot form
without all of its ranks, and a collective blocks every member when one stops. So the
communicator is formed from a *roster* the sender writes, not from the plan alone:

1. The sender sets ``attempt`` (1 for a new membership) and waits until every planned
   rank *arrived* (``a<N>/arrived/<rank>``) or the join deadline passed; a replica is in
   only when all of its ranks (its tensor-parallel workers) arrived. It writes the roster
   (``roster/<N>``: the ranks in, and the group index to resume from) and every member in
   it forms the communicator of attempt N over the keys under ``a<N>/`` with its index in
   the roster as its rank. A member not in it learns it is out and fails at once (its
   replica takes the version from the volume).
2. While a collective is pending, the sender watches the members' heartbeats
   (``hb/<rank>``, set every ``HEARTBEAT_S`` by a thread of each member): one silent for
   longer than the join deadline is dead or frozen. The sender then aborts the
   communicator, sets ``attempt`` to N+1 and waits (until a new join deadline) for the
   others to arrive at N+1, each with the number of groups it completed; the roster of
   N+1 leaves the dead out and resumes at the fewest groups completed, so the rest finish
   the version from where the slowest survivor was (the sender keeps the last groups it
   sent for that). Members watch ``attempt`` during their own waits and re-arrive. A
   sender that gives up on the group instead (its own source failed) says so
   (``abandoned``), and the members fail at once.

A member reads these keys through a store whose every operation ends within the join deadline
(``wire.BoundedStore``): one that cannot hear the sender that long has been left out by it (its
heartbeat went silent), so it fails at once instead of waiting on a socket nobody answers.

The cost of a member's fault to the others is the join deadline plus one communicator
formation (measured on the GPU host: bench/nccl_reform.py, docs/gpu-channels.md), never a
transfer timeout. Keys live under the membership's secret prefix, so only planned
members can arrive. Nothing here imports torch: the store is any torch.distributed
``Store``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.errors import PermanentError, TransferTimeoutError

HEARTBEAT_S = 0.5
"""How often a member says it is alive; the sender reads them only while a collective is pending."""
POLL_S = 0.02


@dataclass(frozen=True)
class Roster:
    """One attempt's communicator: the ranks in it (the sender's 0 first) and the group index to resume from."""

    attempt: int
    ranks: tuple[int, ...]
    resume: int = 0

    def __post_init__(self) -> None:
        if not self.ranks or self.ranks[0] != 0 or list(self.ranks) != sorted(set(self.ranks)):
            raise PermanentError(f"roster {self.attempt}: ranks {list(self.ranks)} must start at 0, sorted, unique")

    def index(self, rank: int) -> int:
        """``rank``'s rank in this attempt's communicator."""
        return self.ranks.index(rank)

    def to_json(self) -> str:
        return json.dumps({"attempt": self.attempt, "ranks": list(self.ranks), "resume": self.resume})

    @classmethod
    def parse(cls, raw: bytes | str) -> Roster:
        try:
            d = json.loads(raw)
            return cls(int(d["attempt"]), tuple(int(r) for r in d["ranks"]), int(d["resume"]))
        except (KeyError, TypeError, ValueError) as e:
            raise PermanentError(f"a roster on the store is malformed ({e}): {raw!r}") from None


class Excluded(TransferTimeoutError):
    """This member is not in the roster: it arrived after the join deadline, or the sender found it dead."""


def owners(first_ranks: Mapping[str, int], world_size: int) -> dict[int, str]:
    """Rank -> replica id, from each replica's first rank (its workers take the ranks up to the next replica's)."""
    ordered = sorted(first_ranks.items(), key=lambda kv: kv[1])
    out: dict[int, str] = {}
    for i, (rid, first) in enumerate(ordered):
        end = ordered[i + 1][1] if i + 1 < len(ordered) else world_size
        out.update(dict.fromkeys(range(first, end), rid))
    return out


def arrived_key(attempt: int, rank: int) -> str:
    return f"a{attempt}/arrived/{rank}"


def current_attempt(store: Any) -> int:
    """The attempt the sender leads now (0 before it started one)."""
    return int(store.get("attempt")) if store.check(["attempt"]) else 0


def lead(
    store: Any,
    attempt: int,
    wanted: Callable[[], Collection[int]],
    owner: Mapping[int, str],
    deadline: float,
) -> Roster:
    """The sender's side of one attempt: announce it, wait until every rank ``wanted()`` lists arrived or
    ``deadline`` (monotonic) passed, and write the roster: the replicas all of whose wanted ranks arrived.
    ``wanted`` is read at every poll, so ranks the coordinator moved away stop being waited for at once."""
    if store.check(["abandoned"]):  # a verdict on an earlier attempt of this membership
        store.delete_key("abandoned")
    store.set("attempt", str(attempt))
    while True:
        want = set(wanted())
        arrived = {r for r in want if store.check([arrived_key(attempt, r)])}
        if arrived == want or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    by_replica: dict[str, set[int]] = {}
    for r in want:
        by_replica.setdefault(owner[r], set()).add(r)
    ranks = sorted(r for rs in by_replica.values() if rs <= arrived for r in rs)
    done = [int(store.get(arrived_key(attempt, r))) for r in ranks]
    roster = Roster(attempt, (0, *ranks), min(done) if done else 0)
    store.set(f"roster/{attempt}", roster.to_json())
    return roster


def join(store: Any, rank: int, attempt: int, done: int, timeout_s: float, group: str) -> Roster:
    """A member's side of one attempt: arrive (having completed ``done`` groups) and wait for the roster; raise
    ``Excluded`` when this rank is not in it, ``TransferTimeoutError`` when none came within ``timeout_s``."""
    store.set(arrived_key(attempt, rank), str(done))
    key = f"roster/{attempt}"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TransferTimeoutError(
                f"group {group!r}: the sender wrote no roster for attempt {attempt} within {timeout_s:.1f}s "
                "(it died, or gave up on the group)"
            )
        time.sleep(POLL_S)
    roster = Roster.parse(store.get(key))
    if rank not in roster.ranks:
        raise Excluded(
            f"group {group!r}: rank {rank} was left out of attempt {attempt} (it arrived after the join deadline, "
            "or the sender found it silent); this replica takes the version from the volume"
        )
    return roster


def abandon(store: Any, why: str) -> None:
    """The sender gave up on the group for this version (its own source failed, every member is gone): members
    stop waiting for a new attempt at once."""
    store.set("abandoned", why)


def abandoned(store: Any) -> str:
    """Why the sender gave up on the group (empty while it has not)."""
    return bytes(store.get("abandoned")).decode() if store.check(["abandoned"]) else ""


def first_attempt(store: Any, timeout_s: float, group: str) -> int:
    """The attempt a new member arrives at: the one the sender announced (it announces when it plans the group)."""
    deadline = time.monotonic() + timeout_s
    while (attempt := current_attempt(store)) == 0:
        if time.monotonic() > deadline:
            raise TransferTimeoutError(f"group {group!r}: the sender announced no attempt within {timeout_s:.1f}s")
        time.sleep(POLL_S)
    return attempt


class Heartbeat:
    """A member's thread that sets ``hb/<rank>`` every ``HEARTBEAT_S`` until ``stop`` (on a store connection of its
    own: a member's main connection may be inside a blocking wait). Errors are ignored: a sender that went away
    has nobody to tell."""

    def __init__(self, store: Any, rank: int) -> None:
        self.store, self.rank = store, rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        beat = 0
        while not self._stop.is_set():
            beat += 1
            with contextlib.suppress(RuntimeError):  # the sender went away: nobody to tell
                self.store.set(f"hb/{self.rank}", str(beat))
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()


class Silence:
    """The sender's view of its members' heartbeats during one wait: which ranks stayed silent for ``limit_s``."""

    def __init__(self, store: Any, ranks: Iterable[int], limit_s: float) -> None:
        self.store, self.ranks, self.limit_s = store, tuple(ranks), limit_s
        now = time.monotonic()
        self._seen: dict[int, tuple[bytes, float]] = dict.fromkeys(self.ranks, (b"", now))

    def silent(self) -> set[int]:
        """Read every heartbeat once; the ranks whose beat has not changed for longer than ``limit_s``."""
        now = time.monotonic()
        out = set()
        for r in self.ranks:
            beat = bytes(self.store.get(f"hb/{r}")) if self.store.check([f"hb/{r}"]) else b""
            last, since = self._seen[r]
            if beat != last:
                self._seen[r] = (beat, now)
            elif now - since > self.limit_s:
                out.add(r)
        return out
