"""The CPU stream between real processes: one group per replica, a dead replica costs only itself."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import torch

from tests.receivers import Receivers
from weightsync.channels.base import Rendezvous, UpdateTicket, direct_rendezvous
from weightsync.channels.cpu import CpuSender
from weightsync.channels.wire import dtype_name
from weightsync.errors import TransferTimeoutError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.integration
JOIN_S = 8.0
"""The join deadline: the receivers are started first and join when told (``tests.receivers``)."""


def _groups() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(512, 512, generator=g).bfloat16(), torch.randn(3, generator=g)] for _ in range(6)]


def _ticket(groups: list[list[torch.Tensor]]) -> UpdateTicket:
    table = TensorTable.build(
        [[(f"l{i}.t{j}", dtype_name(t.dtype), tuple(t.shape)) for j, t in enumerate(g)] for i, g in enumerate(groups)]
    )
    # the bucket size travels in the stream's header: the receivers are never told it
    return UpdateTicket(1, Channel.CPU, table, table.layout_digest(), bucket_bytes=1 << 19)


def _plan(sender: CpuSender, rids: tuple[str, ...], timeout_s: float) -> dict[str, Rendezvous]:
    """One membership per replica, as the coordinator plans the CPU stream."""
    return {
        rid: direct_rendezvous(sender.offer(), group=f"group-{rid}", join_timeout_s=JOIN_S).with_timeout(timeout_s)
        for rid in rids
    }


def _joined(
    tmp_path: Path, sender: CpuSender, plan: dict[str, Rendezvous], layout: str, die_after: dict[str, int] | None = None
) -> Receivers:
    """The receivers of ``plan`` started, then planned and told to join."""
    receivers = Receivers(tmp_path, plan, layout, die_after)
    receivers.started()
    sender.take_plan(plan)
    receivers.start_joining()
    return receivers


def test_replica_dying_mid_stream_does_not_cost_the_other_its_version(tmp_path: Path) -> None:
    groups = _groups()
    ticket = _ticket(groups)
    assert ticket.table is not None
    sender = CpuSender(timeout_s=30)
    plan = _plan(sender, ("lives", "dies"), 30)
    assert plan["lives"].secret != plan["dies"].secret  # one membership (and store prefix) per replica
    lost: dict[str, float] = {}
    sender.on_lost = lambda rid, why: lost.setdefault(rid, time.monotonic())
    receivers = _joined(tmp_path, sender, plan, ticket.table.layout_digest(), die_after={"dies": 2})
    try:
        report = sender.send(ticket, iter(groups))
        sent = time.monotonic()
        assert receivers.procs["lives"].wait(timeout=60) == 0 and receivers.procs["dies"].wait(timeout=60) == 17
    finally:
        receivers.close()
    assert set(report.failed) == {"dies"} and "bucket" in report.failed["dies"]
    assert receivers.result("lives") == report.digests and len(report.digests) == 12
    assert set(sender.groups) == {"lives"}  # the dead replica's group is dropped; the other's is kept
    assert set(lost) == {"dies"} and lost["dies"] <= sent  # told the moment it was lost, not with the report
    sender.close()


def test_sender_fails_within_its_timeout_when_the_only_replica_dies(tmp_path: Path) -> None:
    groups = _groups()
    ticket = _ticket(groups)
    assert ticket.table is not None
    sender = CpuSender(timeout_s=10)
    plan = _plan(sender, ("only",), 10)
    receivers = _joined(tmp_path, sender, plan, ticket.table.layout_digest(), die_after={"only": 1})
    try:
        receivers.joined("only")  # time the stream, not the join
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="every group failed"):
            sender.send(ticket, iter(groups))
        assert time.monotonic() - t0 < 15
        assert receivers.procs["only"].wait(timeout=60) == 17
    finally:
        receivers.close()
    sender.close()


def test_ready_gives_up_on_a_replica_that_never_joined_and_streams_to_the_one_that_did(tmp_path: Path) -> None:
    """A planned replica that never joins (partitioned, or slow to start) costs the others nothing: ``ready``
    leaves it out once the join deadline passed instead of letting the stream wait for its group, and names it;
    a replica the coordinator moved away (``members``) is left out without a wait. The one that never joins is
    planned first: its group's wait on the store must not hold up the other's (it did for its whole timeout while
    the groups shared one store connection)."""
    groups = _groups()
    ticket = _ticket(groups)
    assert ticket.table is not None
    sender = CpuSender(timeout_s=30)
    plan = _plan(sender, ("away", "joins", "moved"), 30)
    receivers = Receivers(tmp_path, {"joins": plan["joins"]}, ticket.table.layout_digest())
    try:
        receivers.started()
        planned = time.monotonic()
        sender.take_plan(plan)
        receivers.start_joining()
        receivers.joined("joins")
        assert time.monotonic() - planned < JOIN_S, "forming the joined group waited for the absent one"
        left_out = sender.ready(JOIN_S, members={"away", "joins"})
        assert JOIN_S - 1 < time.monotonic() - planned < JOIN_S + 5, "ready did not wait out the join deadline"
        report = sender.send(ticket, iter(groups))
        assert receivers.result("joins", 0) == report.digests
    finally:
        receivers.close()
    assert set(sender.groups) == {"joins"} and set(left_out) == {"away", "moved"}, left_out
    assert "did not form within the join deadline" in left_out["away"]
    assert "the coordinator moved it" in left_out["moved"]
    assert not report.failed, report.failed  # left out before the first byte: reported by ``ready``, not again
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
    plan = _plan(sender, ("lives", "frozen"), timeout_s)
    lost: dict[str, float] = {}
    sender.on_lost = lambda rid, why: lost.setdefault(rid, time.monotonic())
    receivers = _joined(tmp_path, sender, plan, ticket.table.layout_digest())
    try:
        receivers.joined("lives", "frozen")
        receivers.procs["frozen"].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        report = sender.send(ticket, iter(groups))
        took = time.monotonic() - t0
        assert set(report.failed) == {"frozen"}, report.failed
        assert "the join deadline) after the others took it" in report.failed["frozen"]
        assert JOIN_S <= took < JOIN_S + 15, f"the sender took {took:.1f}s for a {JOIN_S:g}s join deadline"
        assert lost["frozen"] - t0 < JOIN_S + 5  # told when dropped, not at the end
        assert receivers.result("lives", 0) == report.digests
    finally:
        receivers.close()
    sender.close()
