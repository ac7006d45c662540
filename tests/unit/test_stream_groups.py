"""Negotiation gives every CPU-stream replica its own membership, and NCCL replicas one shared membership."""

from __future__ import annotations

import pytest

from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import negotiation
from weightsync.coordinator.models import Capabilities, EngineKind
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit

TRAINER = Capabilities(host="h", channels=(Channel.NCCL, Channel.CPU), nccl_domain="d", engine=EngineKind.GPU)
OFFERS = {
    Channel.CPU: Offer(Channel.CPU, Endpoint("10.0.0.1", 1)),
    Channel.NCCL: Offer(Channel.NCCL, Endpoint("10.0.0.1", 2)),
}
PREFERENCE = tuple(Channel)


def _replica(rid: str, engine: EngineKind) -> negotiation.Candidate:
    # a CPU engine has no NCCL domain (NCCL needs only the same domain: with one it would take NCCL)
    domain = "d" if engine is EngineKind.GPU else ""
    caps = Capabilities(host="h", channels=(Channel.NCCL, Channel.CPU), nccl_domain=domain, engine=engine)
    return negotiation.Candidate(rid, "inc-" + rid, caps)


def test_cpu_memberships_are_pairwise_and_nccl_shared() -> None:
    replicas = [
        _replica("a", EngineKind.CPU),
        _replica("b", EngineKind.CPU),
        _replica("c", EngineKind.GPU),
        _replica("d", EngineKind.GPU),
    ]
    plans, _, state = negotiation.negotiate(TRAINER, OFFERS, replicas, PREFERENCE, negotiation.GroupState())
    by = {p.replica_id: p.rendezvous for p in plans}
    assert {p.replica_id: p.channel for p in plans} == {
        "a": Channel.CPU,
        "b": Channel.CPU,
        "c": Channel.NCCL,
        "d": Channel.NCCL,
    }
    # each CPU replica has its own group: its own name, secret and generation, ranks 1..devices of 2
    assert by["a"].group != by["b"].group and by["a"].secret != by["b"].secret
    assert by["a"].group.startswith("cpu-a-") and by["b"].group.startswith("cpu-b-")
    assert by["a"].generation != by["b"].generation
    assert (by["a"].world_size, by["a"].rank) == (2, 1) and (by["b"].world_size, by["b"].rank) == (2, 1)
    assert by["a"].endpoint == by["b"].endpoint == Endpoint("10.0.0.1", 1)
    # the NCCL replicas share one membership
    assert by["c"].same_membership(by["d"]) and by["c"].group.startswith("nccl-")
    assert by["c"].world_size == 3 and {by["c"].rank, by["d"].rank} == {1, 2}
    assert set(state.memberships) == {"cpu/a", "cpu/b", "nccl"} and state.minted == 3

    # b leaves: a keeps its membership (no rebuild), the NCCL membership is unchanged, nothing is minted
    again, _, state2 = negotiation.negotiate(
        TRAINER, OFFERS, [r for r in replicas if r.replica_id != "b"], PREFERENCE, state
    )
    by2 = {p.replica_id: p.rendezvous for p in again}
    assert by2["a"] == by["a"] and by2["c"] == by["c"] and by2["d"] == by["d"]
    assert set(state2.memberships) == {"cpu/a", "nccl"} and state2.minted == 3

    # b comes back: only b's membership is new (the next generation)
    back, _, state3 = negotiation.negotiate(TRAINER, OFFERS, replicas, PREFERENCE, state2)
    by3 = {p.replica_id: p.rendezvous for p in back}
    assert by3["a"] == by["a"] and by3["c"] == by["c"]
    assert by3["b"].generation == 4 and by3["b"].secret != by["b"].secret and state3.minted == 4
