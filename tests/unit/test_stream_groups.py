"""Negotiation gives every CPU-stream replica its own group, and NCCL replicas one shared group."""

from __future__ import annotations

import pytest

from weightsync.coordinator import negotiation
from weightsync.coordinator.models import Capabilities, EngineKind, SenderOffer
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit

TRAINER = Capabilities(host="h", channels=(Channel.NCCL, Channel.CPU), nccl_domain="d", engine=EngineKind.GPU)
OFFERS = {Channel.CPU: SenderOffer(Channel.CPU, "h", 1), Channel.NCCL: SenderOffer(Channel.NCCL, "h", 2)}


def _replica(rid: str, engine: EngineKind) -> negotiation.Candidate:
    caps = Capabilities(host="h", channels=(Channel.NCCL, Channel.CPU), nccl_domain="d", engine=engine)
    return negotiation.Candidate(rid, "inc-" + rid, caps)


def test_cpu_groups_are_pairwise_and_nccl_shared() -> None:
    replicas = [
        _replica("a", EngineKind.CPU),
        _replica("b", EngineKind.CPU),
        _replica("c", EngineKind.GPU),
        _replica("d", EngineKind.GPU),
    ]
    plans, _, state = negotiation.negotiate(TRAINER, OFFERS, replicas, list(Channel), negotiation.GroupState())
    by = {p.replica_id: p for p in plans}
    assert by["a"].channel is Channel.CPU and by["c"].channel is Channel.NCCL
    assert by["a"].rendezvous.group_id != by["b"].rendezvous.group_id
    assert (by["a"].rendezvous.world_size, by["a"].rendezvous.rank_offset) == (2, 1)
    assert by["c"].rendezvous.group_id == by["d"].rendezvous.group_id
    assert by["c"].rendezvous.world_size == 3 and {by["c"].rendezvous.rank_offset, by["d"].rendezvous.rank_offset} == {
        1,
        2,
    }

    # b leaves: a keeps its group id (no rebuild), the NCCL group is unchanged
    again, _, _ = negotiation.negotiate(
        TRAINER, OFFERS, [r for r in replicas if r.replica_id != "b"], list(Channel), state
    )
    by2 = {p.replica_id: p for p in again}
    assert by2["a"].rendezvous.group_id == by["a"].rendezvous.group_id
    assert by2["c"].rendezvous.group_id == by["c"].rendezvous.group_id
