"""The CPU stream between real processes: one group per replica, a dead replica costs only itself."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from weightsync.channels.base import Rendezvous, UpdateTicket, direct_rendezvous
from weightsync.channels.cpu import CpuSender
from weightsync.channels.wire import dtype_name
from weightsync.errors import TransferTimeoutError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
JOIN_S = 40.0
"""The join deadline where the receivers are processes started after the plan: their start-up (torch's import on
a loaded 2-core machine) must fit in it."""


def _groups() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(512, 512, generator=g).bfloat16(), torch.randn(3, generator=g)] for _ in range(6)]


def _ticket(groups: list[list[torch.Tensor]]) -> UpdateTicket:
    table = TensorTable.build(
        [[(f"l{i}.t{j}", dtype_name(t.dtype), tuple(t.shape)) for j, t in enumerate(g)] for i, g in enumerate(groups)]
    )
    # the bucket size travels in the stream's header: the receivers are never told it
    return UpdateTicket(1, Channel.CPU, table, table.layout_digest(), bucket_bytes=1 << 19)


def _receiver(rdv: Rendezvous, layout_digest: str, out: Path, die_after: int | None = None) -> subprocess.Popen[bytes]:
    """A receiver process; it writes ``<out>.joined`` once its group formed and ``out`` (its digests) when done."""
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.procs",
        "receive",
        "--rendezvous",
        json.dumps(rdv.to_dict()),
        "--version",
        "1",
        "--layout-digest",
        layout_digest,
        "--out",
        str(out),
        "--joined",
        str(out.with_suffix(".joined")),
    ]
    if die_after is not None:
        cmd += ["--die-after", str(die_after)]
    return subprocess.Popen(cmd, cwd=ROOT)


def test_replica_dying_mid_stream_does_not_cost_the_other_its_version(tmp_path: Path) -> None:
    groups = _groups()
    ticket = _ticket(groups)
    assert ticket.table is not None
    sender = CpuSender(timeout_s=30)
    plan = {
        rid: direct_rendezvous(sender.offer(), group=f"group-{rid}", join_timeout_s=JOIN_S).with_timeout(30)
        for rid in ("lives", "dies")
    }
    assert plan["lives"].secret != plan["dies"].secret  # one membership (and store prefix) per replica
    lost: dict[str, float] = {}
    sender.on_lost = lambda rid, why: lost.setdefault(rid, time.monotonic())
    sender.take_plan(plan)
    procs = {
        rid: _receiver(rdv, ticket.table.layout_digest(), tmp_path / f"{rid}.json", 2 if rid == "dies" else None)
        for rid, rdv in plan.items()
    }
    try:
        report = sender.send(ticket, iter(groups))
        sent = time.monotonic()
        assert procs["lives"].wait(timeout=60) == 0 and procs["dies"].wait(timeout=60) == 17
    finally:
        for p in procs.values():
            p.kill()
    assert set(report.failed) == {"dies"} and "bucket" in report.failed["dies"]
    assert json.loads((tmp_path / "lives.json").read_text()) == report.digests and len(report.digests) == 12
    assert set(sender.groups) == {"lives"}  # the dead replica's group is dropped; the other's is kept
    assert set(lost) == {"dies"} and lost["dies"] <= sent  # told the moment it was lost, not with the report
    sender.close()


def test_sender_fails_within_its_timeout_when_the_only_replica_dies(tmp_path: Path) -> None:
    groups = _groups()
    ticket = _ticket(groups)
    assert ticket.table is not None
    sender = CpuSender(timeout_s=10)
    rdv = direct_rendezvous(sender.offer(), group="only", join_timeout_s=JOIN_S).with_timeout(10)
    sender.take_plan({"only": rdv})
    proc = _receiver(rdv, ticket.table.layout_digest(), tmp_path / "only.json", die_after=1)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "only.joined").exists():  # time the stream, not the receiver's start
            assert proc.poll() is None and time.monotonic() < deadline, "the receiver never joined"
            time.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="every group failed"):
            sender.send(ticket, iter(groups))
        assert time.monotonic() - t0 < 15
        assert proc.wait(timeout=60) == 17
    finally:
        proc.kill()
    sender.close()


def test_ready_gives_up_on_a_replica_that_never_joined_and_streams_to_the_one_that_did(tmp_path: Path) -> None:
    """A planned replica that never joins (partitioned, or slow to start) costs the others nothing: ``ready``
    leaves it out once the join deadline's rest passed (here 5 s) instead of letting the stream wait for its
    group, and names it; a replica the coordinator moved away (``members``) is left out without a wait."""
    groups = _groups()
    ticket = _ticket(groups)
    assert ticket.table is not None
    sender = CpuSender(timeout_s=30)
    # the absent replica is planned first: its group's wait on the store starts first and must not hold up the
    # other's (it did for its whole 30 s timeout while the groups shared one store connection)
    plan = {
        rid: direct_rendezvous(sender.offer(), group=f"group-{rid}", join_timeout_s=JOIN_S).with_timeout(30)
        for rid in ("away", "joins", "moved")
    }
    planned = time.monotonic()
    sender.take_plan(plan)
    proc = _receiver(plan["joins"], ticket.table.layout_digest(), tmp_path / "joins.json")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "joins.joined").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the receiver never joined"
            time.sleep(0.1)
        t0 = time.monotonic()
        # the one that never joins costs this wait, not its join deadline nor its 30 s timeout
        left_out = sender.ready(5.0, members={"away", "joins"})
        assert time.monotonic() - t0 < 8
        assert time.monotonic() - planned < JOIN_S, "forming the joined group waited for the absent one"
        report = sender.send(ticket, iter(groups))
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert set(sender.groups) == {"joins"} and set(left_out) == {"away", "moved"}, left_out
    assert "did not form within the join deadline" in left_out["away"]
    assert "the coordinator moved it" in left_out["moved"]
    assert not report.failed, report.failed  # left out before the first byte: reported by ``ready``, not again
    assert json.loads((tmp_path / "joins.json").read_text()) == report.digests
    sender.close()


def test_a_frozen_replica_is_dropped_once_it_falls_a_join_deadline_behind(tmp_path: Path) -> None:
    """A replica that stops reading without closing its connection (a frozen process; a pod whose network went
    away sends no reset either) gives no error: the sender drops it once it falls the join deadline behind the
    other, far sooner than the transfer timeout, and tells ``on_lost`` then; the other replica loads the version.
    Its group's queued sends are not waited out one after the other."""
    g = torch.Generator().manual_seed(1)
    groups = [[torch.randn(1024, 1024, generator=g)] for _ in range(16)]  # 64 MB: more than the sockets buffer
    ticket = _ticket(groups)
    assert ticket.table is not None
    timeout_s = 120
    sender = CpuSender(timeout_s=timeout_s)
    plan = {
        rid: direct_rendezvous(sender.offer(), group=f"group-{rid}", join_timeout_s=JOIN_S).with_timeout(timeout_s)
        for rid in ("lives", "frozen")
    }
    lost: dict[str, float] = {}
    sender.on_lost = lambda rid, why: lost.setdefault(rid, time.monotonic())
    sender.take_plan(plan)
    procs = {rid: _receiver(rdv, ticket.table.layout_digest(), tmp_path / f"{rid}.json") for rid, rdv in plan.items()}
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{rid}.joined").exists() for rid in plan):
            assert time.monotonic() < deadline, "the receivers never joined"
            time.sleep(0.05)
        procs["frozen"].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        report = sender.send(ticket, iter(groups))
        took = time.monotonic() - t0
        assert set(report.failed) == {"frozen"}, report.failed
        assert "the join deadline) after the others took it" in report.failed["frozen"]
        assert JOIN_S <= took < JOIN_S + 15, f"the sender took {took:.1f}s for a {JOIN_S:g}s join deadline"
        assert lost["frozen"] - t0 < JOIN_S + 5  # told when dropped, not at the end
        assert procs["lives"].wait(timeout=60) == 0
        assert json.loads((tmp_path / "lives.json").read_text()) == report.digests
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGCONT)
            p.kill()
    sender.close()
