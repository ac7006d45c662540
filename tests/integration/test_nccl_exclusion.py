"""The NCCL channel leaves a member out and the rest finish the version: real processes, its gloo code path.

Three replicas share one group (the NCCL channel over gloo, ``WEIGHTSYNC_NCCL_TRANSPORT=gloo``: the
same rosters, heartbeats, attempts and resume as on GPUs; tests/gpu runs it over NCCL). Each fault
costs the others the join deadline, not the transfer timeout, and the sender tells ``on_lost`` the
moment it leaves the member out:

- one replica never joins: the roster of attempt 1 leaves it out at the join deadline; it learns so
  when it comes late;
- one replica is frozen (SIGSTOP) mid-version: its heartbeat stops, the sender forms attempt 2 with
  the other two, which finish the version from where the slower of them was;
- one replica is killed (SIGKILL) mid-version: gloo's collective fails at once, the survivors arrive
  at attempt 2 within the join deadline, the dead one does not;
- one replica's route to the trainer is refused after the group formed (each process on its own host):
  left out at the join deadline, and it learns so itself within the join deadline.

Every survivor's digests are the trainer's, for every tensor. CI runs the first fault, the refused route and the
moved-off one; ``make faults`` runs all (the others take the same paths with another trigger).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import netns
from tests.receivers import Receivers
from weightsync.channels import nccl, wire
from weightsync.channels.base import Endpoint, Offer, Rendezvous, SendReport, UpdateTicket
from weightsync.channels.wire import dtype_name
from weightsync.coordinator import negotiation
from weightsync.coordinator.models import Capabilities
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
ALL = os.environ.get("WEIGHTSYNC_FAULTS") == "all"
JOIN_S = 6.0
GROUPS = 12
"""Groups of 4 MiB: more than the sockets buffer, so a frozen member holds its broadcast."""


@pytest.fixture(autouse=True)
def gloo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(nccl.TRANSPORT_ENV, "gloo")
    yield


def _groups(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1024, 1024, generator=g), torch.randn(7, generator=g)] for _ in range(GROUPS)]


def _table(groups: list[list[torch.Tensor]]) -> TensorTable:
    return TensorTable.build(
        [[(f"l{i}.t{j}", dtype_name(t.dtype), tuple(t.shape)) for j, t in enumerate(g)] for i, g in enumerate(groups)]
    )


def _plan(sender: nccl.NcclSender, replicas: tuple[str, ...]) -> dict[str, Rendezvous]:
    """The coordinator's plan for ``replicas`` on NCCL (its own negotiation: one membership, ranks in id order)."""
    caps = Capabilities(host="n", channels=(Channel.NCCL,), nccl_domain="d")
    trainer = Capabilities(host="n", channels=(Channel.NCCL,), nccl_domain="d")
    offers = {Channel.NCCL: Offer(Channel.NCCL, Endpoint(sender.host, sender.port))}
    candidates = [negotiation.Candidate(r, "i-" + r, caps) for r in replicas]
    plans, _, _ = negotiation.negotiate(
        trainer, offers, candidates, (Channel.NCCL,), negotiation.GroupState(), 1, JOIN_S
    )
    return {p.replica_id: p.rendezvous.with_timeout(120) for p in plans}


def _stalling(groups: list[list[torch.Tensor]], after: int, stall: threading.Event) -> Iterator[list[torch.Tensor]]:
    """The trainer's gather, holding after group ``after`` until ``stall`` is set (the test injects its fault)."""
    for i, group in enumerate(groups):
        if i == after:
            stall.wait(60)
        yield group


def _sender_and_plan(
    replicas: tuple[str, ...], host: str = "127.0.0.1"
) -> tuple[nccl.NcclSender, dict[str, Rendezvous], dict[str, float]]:
    sender = nccl.NcclSender(device="cpu", host=host, timeout_s=120)
    lost: dict[str, float] = {}
    sender.on_lost = lambda rid, why: lost.setdefault(rid, time.monotonic())
    return sender, _plan(sender, replicas), lost


def _formed(
    tmp_path: Path,
    sender: nccl.NcclSender,
    plan: dict[str, Rendezvous],
    table: TensorTable,
    hosts: netns.Hosts | None = None,
) -> Receivers:
    """A receiver process per replica of ``plan`` (on its own host with ``hosts``), all in the group the sender
    formed with them."""
    receivers = Receivers(tmp_path, plan, table.layout_digest(), hosts=hosts)
    try:
        receivers.started()
        sender.take_plan(plan)
        receivers.start_joining()
        assert sender.ready(JOIN_S + 5, members=set(plan)) == {}
        receivers.joined(*plan)
    except BaseException:
        receivers.close()
        raise
    return receivers


def test_a_replica_that_never_joins_is_left_out_and_the_others_get_the_version(tmp_path: Path) -> None:
    groups = _groups(1)
    table = _table(groups)
    sender, plan, _ = _sender_and_plan(("a", "b", "late"))
    receivers = Receivers(tmp_path, {k: v for k, v in plan.items() if k != "late"}, table.layout_digest())
    try:
        receivers.started()
        t0 = time.monotonic()
        sender.take_plan(plan)
        receivers.start_joining()
        left_out = sender.ready(JOIN_S + 5, members={"a", "b", "late"})
        waited = time.monotonic() - t0
        assert set(left_out) == {"late"} and "within the join deadline" in left_out["late"], left_out
        assert JOIN_S - 1 < waited < JOIN_S + 5, f"ready took {waited:.1f}s for a {JOIN_S:g}s join deadline"
        report = sender.send(UpdateTicket(1, Channel.NCCL, table, table.layout_digest()), iter(groups))
        for rid in ("a", "b"):
            assert receivers.result(rid) == report.digests
        assert len(report.digests) == 2 * GROUPS
        # the late one comes after the roster was written: it is told it is out, at once
        late = Receivers(tmp_path / "late", {"late": plan["late"]}, table.layout_digest())
        late.start_joining()
        assert "was left out of attempt 1" in late.result("late")["error"]
        late.close()
    finally:
        receivers.close()
        sender.close()


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_a_member_lost_mid_version_is_left_out_and_the_others_finish_it(tmp_path: Path, fault: str) -> None:
    if not ALL:
        pytest.skip("in the full fault suite only: make faults")
    groups = _groups(2)
    table = _table(groups)
    sender, plan, lost = _sender_and_plan(("a", "b", "c"))
    receivers = _formed(tmp_path, sender, plan, table)
    stall = threading.Event()
    report: list[SendReport] = []
    try:
        ticket = UpdateTicket(1, Channel.NCCL, table, table.layout_digest())
        sending = threading.Thread(target=lambda: report.append(sender.send(ticket, _stalling(groups, 4, stall))))
        sending.start()
        time.sleep(1.0)  # the first groups land everywhere; the gather holds
        victim = receivers.procs["c"]
        victim.send_signal(signal.SIGSTOP if fault == "frozen" else signal.SIGKILL)
        t0 = time.monotonic()
        stall.set()
        sending.join(120)
        took = time.monotonic() - t0
        assert report, "the sender did not finish"
        assert set(report[0].failed) == {"c"}, report[0].failed
        assert took < 2 * JOIN_S + 10, f"the others finished {took:.1f}s after the fault ({JOIN_S:g}s deadline)"
        assert lost["c"] - t0 < 2 * JOIN_S + 5  # told when left out, not with the report
        for rid in ("a", "b"):
            assert receivers.result(rid) == report[0].digests
        assert len(report[0].digests) == 2 * GROUPS
    finally:
        stall.set()
        receivers.close()
        sender.close()


def test_a_member_cut_off_from_the_sender_learns_within_the_join_deadline_that_it_is_out(tmp_path: Path) -> None:
    """Every process on its own host; after the group formed, one member's route to the sender is refused (its
    packets go nowhere, the sender's still arrive), as between two versions of a fleet. Its heartbeat stops
    reaching the sender, which leaves it out at the join deadline, and the others get the version. The member
    itself learns within the join deadline that it cannot reach the sender (each of its reads of the sender's
    store is bounded by it), not when the route comes back: torch's store client waits on an unanswered socket
    until TCP gives up, minutes, and inside a vLLM worker that held the replica's volume fallback behind it."""
    netns.require()
    groups = _groups(4)
    table = _table(groups)
    with netns.Hosts(("a", "b", "c")) as hosts:
        sender, plan, lost = _sender_and_plan(("a", "b", "c"), hosts.bridge_address)
        receivers = _formed(tmp_path, sender, plan, table, hosts)
        try:
            assert hosts.run("c", ["ip", "route", "add", "unreachable", f"{hosts.bridge_address}/32"]).returncode == 0
            t0 = time.monotonic()
            report = sender.send(UpdateTicket(1, Channel.NCCL, table, table.layout_digest()), iter(groups))
            assert set(report.failed) == {"c"} and "silent for over the join deadline" in report.failed["c"], report
            assert lost["c"] - t0 < JOIN_S + 5
            for rid in ("a", "b"):
                assert receivers.result(rid) == report.digests
            error = receivers.result("c", code=3)["error"]
            out = time.monotonic() - t0
            assert "on the sender's store did not complete within 6.0s" in error, error
            assert out < JOIN_S + wire.GRACE_S + 5, f"the member cut off learnt it was out {out:.1f}s after the fault"
        finally:
            receivers.close()
            sender.close()


def test_a_member_moved_off_the_channel_is_left_out_before_the_first_byte(tmp_path: Path) -> None:
    """The group formed with all three; for the next version the coordinator moved one off NCCL (its lease ran
    out, say): the sender forms the group again without it before it sends, and the other two get the version."""
    groups = _groups(3)
    table = _table(groups)
    sender, plan, lost = _sender_and_plan(("a", "b", "c"))
    receivers = _formed(tmp_path, sender, plan, table)
    try:
        receivers.procs["c"].send_signal(signal.SIGSTOP)  # it will never take part again
        left_out = sender.ready(1.0, members={"a", "b"})
        assert set(left_out) == {"c"} and "the coordinator moved it" in left_out["c"]
        t0 = time.monotonic()
        report = sender.send(UpdateTicket(1, Channel.NCCL, table, table.layout_digest()), iter(groups))
        assert time.monotonic() - t0 < JOIN_S, "the sender waited for the moved member to fall silent"
        assert "c" in lost and set(report.failed) == {"c"}
        for rid in ("a", "b"):
            assert receivers.result(rid) == report.digests
    finally:
        receivers.close()
        sender.close()
