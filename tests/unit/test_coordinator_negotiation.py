"""Negotiation rules: offered channels only, preference order, overrides, failure fallback, memberships and ranks."""

from __future__ import annotations

import pytest

from weightsync.channels.base import Endpoint, Offer, Rendezvous
from weightsync.coordinator import negotiation
from weightsync.coordinator.models import DEFAULT_PREFERENCE, LIVE_CHANNELS, Capabilities, EngineKind
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit

ALL = tuple(Channel)
TRAINER = Capabilities(
    host="n1",
    gpu_uuids=("GPU-0",),
    channels=ALL,
    nccl_domain="rack1",
    nixl=True,
    volume_id="vol",
    engine=EngineKind.GPU,
)
OFFERS = {
    Channel.IPC: Offer(Channel.IPC, Endpoint("10.0.0.1", 29400), devices=("GPU-0", "GPU-1")),
    Channel.NCCL: Offer(Channel.NCCL, Endpoint("10.0.0.1", 29500)),
    Channel.NIXL: Offer(Channel.NIXL, Endpoint("10.0.0.1", 29700), agent="trainer-0", metadata=b"\x00md", epoch=4),
    Channel.CPU: Offer(Channel.CPU, Endpoint("10.0.0.1", 29600)),
    Channel.VOLUME: Offer(Channel.VOLUME),
}


def gpu(rid: str, **kw: object) -> negotiation.Candidate:
    caps: dict[str, object] = dict(
        host="n2", channels=ALL, nccl_domain="rack1", volume_id="vol", volume_mount="/ckpt", engine=EngineKind.GPU
    )
    failed = kw.pop("failed", frozenset())
    caps.update(kw)
    return negotiation.Candidate(rid, "inc-" + rid, Capabilities(**caps), failed)  # type: ignore[arg-type]


def pick(
    c: negotiation.Candidate,
    preference: tuple[Channel, ...] = DEFAULT_PREFERENCE,
    offers: dict[Channel, Offer] = OFFERS,
    trainer: Capabilities = TRAINER,
) -> Channel | None:
    return negotiation.choose(trainer, offers, c, preference)[0]


def without(*channels: Channel) -> dict[Channel, Offer]:
    return {k: v for k, v in OFFERS.items() if k not in channels}


def test_default_preference_order() -> None:
    assert pick(gpu("a", host="n1", gpu_uuids=("GPU-1",))) is Channel.IPC
    assert pick(gpu("b")) is Channel.NCCL
    assert pick(gpu("c", nccl_domain="rack2", nixl=True)) is Channel.NIXL
    assert pick(gpu("d", nccl_domain="rack2", engine=EngineKind.CPU)) is Channel.CPU
    assert pick(gpu("e", nccl_domain="rack2")) is Channel.VOLUME
    assert pick(gpu("f", nccl_domain="", volume_id="other")) is None


def test_ipc_needs_the_same_host_and_gpus_among_the_offers_devices() -> None:
    assert pick(gpu("a", host="n1", gpu_uuids=("GPU-0", "GPU-1"))) is Channel.IPC  # a subset, all of them
    assert pick(gpu("a", host="n1", gpu_uuids=("GPU-9",))) is Channel.NCCL
    assert pick(gpu("a", host="n1", gpu_uuids=("GPU-1", "GPU-9"))) is Channel.NCCL  # one GPU elsewhere
    assert pick(gpu("a", host="n1")) is Channel.NCCL  # no GPUs reported
    assert pick(gpu("a", host="n2", gpu_uuids=("GPU-1",))) is Channel.NCCL  # same UUID, other host
    # the offer's devices decide, not the trainer's capabilities
    narrow = {**OFFERS, Channel.IPC: Offer(Channel.IPC, Endpoint("10.0.0.1", 29400), devices=("GPU-0",))}
    channel, reason = negotiation.choose(TRAINER, narrow, gpu("a", host="n1", gpu_uuids=("GPU-1",)), DEFAULT_PREFERENCE)
    assert channel is Channel.NCCL and "ipc: replica GPUs are not the trainer's" in reason
    _, reason = negotiation.choose(TRAINER, OFFERS, gpu("a", host="n2", gpu_uuids=("GPU-1",)), DEFAULT_PREFERENCE)
    assert "ipc: different hosts ('n1' vs 'n2')" in reason


def test_nccl_needs_only_the_same_non_empty_domain() -> None:
    # a CPU-engine replica in the trainer's NCCL domain takes NCCL: there is no engine-kind check
    assert pick(gpu("a", engine=EngineKind.CPU)) is Channel.NCCL
    no_domain = Capabilities(host="n1", channels=ALL, nixl=True, volume_id="vol")
    channel, reason = negotiation.choose(no_domain, OFFERS, gpu("b", nccl_domain="", nixl=True), DEFAULT_PREFERENCE)
    assert channel is Channel.NIXL and "nccl: different NCCL domains ('' vs '')" in reason


def test_only_channels_the_trainer_offered_are_negotiated() -> None:
    # the trainer's capabilities.channels no longer gate anything: the offers do
    volume_only_caps = Capabilities(
        host="n1", gpu_uuids=("GPU-0", "GPU-1"), channels=(Channel.VOLUME,), nccl_domain="rack1", volume_id="vol"
    )
    assert pick(gpu("b"), trainer=volume_only_caps) is Channel.NCCL
    channel, reason = negotiation.choose(TRAINER, without(Channel.NCCL), gpu("b"), DEFAULT_PREFERENCE)
    assert channel is Channel.VOLUME and "nccl: trainer did not offer it" in reason
    # the volume is negotiated only when offered too
    channel, reason = negotiation.choose(
        TRAINER, without(Channel.NCCL, Channel.VOLUME), gpu("b"), (Channel.NCCL, Channel.VOLUME)
    )
    assert channel is None and "volume: trainer did not offer it" in reason
    assert pick(gpu("a", host="n1", gpu_uuids=("GPU-1",)), offers=without(Channel.IPC)) is Channel.NCCL
    assert pick(gpu("c", nccl_domain="x", nixl=True), offers=without(Channel.NIXL)) is Channel.VOLUME
    # and only channels the replica receives
    assert pick(gpu("b", channels=(Channel.VOLUME,))) is Channel.VOLUME


def test_a_live_channel_needs_an_offered_endpoint() -> None:
    no_endpoint = {**OFFERS, Channel.NCCL: Offer(Channel.NCCL)}
    channel, reason = negotiation.choose(TRAINER, no_endpoint, gpu("b", nixl=True), DEFAULT_PREFERENCE)
    assert channel is Channel.NIXL and "nccl: trainer offered no rendezvous for it" in reason


def test_job_override_narrows_and_reorders() -> None:
    assert pick(gpu("b"), preference=(Channel.VOLUME, Channel.NCCL)) is Channel.VOLUME
    assert pick(gpu("b", volume_id=""), preference=(Channel.VOLUME,)) is None


def test_a_failed_channel_falls_back_to_the_volume() -> None:
    assert pick(gpu("b", failed=frozenset({Channel.NCCL, Channel.NIXL}))) is Channel.VOLUME
    _, reason = negotiation.choose(TRAINER, OFFERS, gpu("b", failed=frozenset({Channel.NCCL})), DEFAULT_PREFERENCE)
    assert "nccl: failed before for this replica" in reason


def test_reason_names_what_was_skipped() -> None:
    _, reason = negotiation.choose(TRAINER, OFFERS, gpu("f", nccl_domain="", volume_id="other"), DEFAULT_PREFERENCE)
    assert reason.startswith("no shared channel:")
    assert "ipc: different hosts" in reason and "volume: no shared" in reason
    channel, reason = negotiation.choose(TRAINER, OFFERS, gpu("c", nccl_domain="x", nixl=True), DEFAULT_PREFERENCE)
    assert channel is Channel.NIXL and reason.startswith("nixl; skipped ipc: ")


def test_memberships_ranks_and_generations() -> None:
    a, b = gpu("a", devices=2), gpu("b")
    plans, unplanned, groups = negotiation.negotiate(
        TRAINER, OFFERS, [b, a], DEFAULT_PREFERENCE, negotiation.GroupState()
    )
    by = {p.replica_id: p.rendezvous for p in plans}
    assert unplanned == [] and [p.replica_id for p in plans] == ["a", "b"]
    # the sender is rank 0; replicas take `devices` consecutive ranks in replica id order
    assert (by["a"].rank, by["b"].rank) == (1, 3)
    assert by["a"].world_size == by["b"].world_size == 4
    assert by["a"].endpoint == Endpoint("10.0.0.1", 29500) and by["a"].channel is Channel.NCCL
    first = by["a"]
    assert (first.group, first.generation, groups.minted) == ("nccl-1", 1, 1)
    assert len(first.secret) == 32 and int(first.secret, 16) >= 0
    assert by["b"].same_membership(first) and first.secret in first.prefix
    assert set(groups.memberships) == {"nccl"}
    assert groups.memberships["nccl"].members == (("a", "inc-a", 2), ("b", "inc-b", 1))

    # same members, same endpoint: the membership is kept (group, secret, generation), nothing minted
    plans2, _, groups2 = negotiation.negotiate(TRAINER, OFFERS, [a, b], DEFAULT_PREFERENCE, groups)
    assert all(p.rendezvous.same_membership(first) for p in plans2)
    assert {p.rendezvous.secret for p in plans2} == {first.secret} and groups2.minted == 1
    assert plans2 == plans

    # a member leaves: the next generation, a fresh secret, a new group name and world size
    plans3, _, groups3 = negotiation.negotiate(TRAINER, OFFERS, [a], DEFAULT_PREFERENCE, groups2)
    third = plans3[0].rendezvous
    assert not third.same_membership(first)
    assert (third.group, third.generation, groups3.minted) == ("nccl-2", 2, 2)
    assert third.secret != first.secret and (third.rank, third.world_size) == (1, 3)

    # a member restarts (new incarnation): a new membership too
    restarted = negotiation.Candidate("a", "inc-a2", a.capabilities)
    plans4, _, groups4 = negotiation.negotiate(TRAINER, OFFERS, [restarted], DEFAULT_PREFERENCE, groups3)
    fourth = plans4[0].rendezvous
    assert fourth.generation == 3 and fourth.secret != third.secret and not fourth.same_membership(third)

    # the sender moved (a new endpoint): a new membership at the new endpoint
    moved = {**OFFERS, Channel.NCCL: Offer(Channel.NCCL, Endpoint("10.0.0.2", 29500))}
    plans5, _, groups5 = negotiation.negotiate(TRAINER, moved, [restarted], DEFAULT_PREFERENCE, groups4)
    fifth = plans5[0].rendezvous
    assert fifth.generation == 4 and fifth.endpoint == Endpoint("10.0.0.2", 29500)
    assert not fifth.same_membership(fourth)

    # nobody planned on nccl: the membership is forgotten, but generations never go back
    _, _, groups6 = negotiation.negotiate(TRAINER, OFFERS, [], DEFAULT_PREFERENCE, groups5)
    assert groups6.memberships == {} and groups6.minted == 4
    plans7, _, _ = negotiation.negotiate(TRAINER, OFFERS, [a, b], DEFAULT_PREFERENCE, groups6)
    assert {p.rendezvous.generation for p in plans7} == {5} and plans7[0].rendezvous.secret != first.secret

    # a restarted coordinator remembers no membership, only version numbers: its generations start above the
    # version's floor, so they never repeat one minted before the restart
    floor = 7 * negotiation.GENERATIONS_PER_VERSION
    plans8, _, groups8 = negotiation.negotiate(TRAINER, OFFERS, [a, b], DEFAULT_PREFERENCE, negotiation.GroupState(), 7)
    assert {p.rendezvous.generation for p in plans8} == {floor + 1} and groups8.minted == floor + 1
    plans9, _, _ = negotiation.negotiate(TRAINER, OFFERS, [a], DEFAULT_PREFERENCE, groups8, 8)
    assert plans9[0].rendezvous.generation == 8 * negotiation.GENERATIONS_PER_VERSION + 1


def test_every_live_channel_gets_a_membership_and_the_volume_none() -> None:
    replicas = [
        gpu("i", host="n1", gpu_uuids=("GPU-1",)),
        gpu("n"),
        gpu("x", nccl_domain="x", nixl=True),
        gpu("c", nccl_domain="x", engine=EngineKind.CPU),
        gpu("v", nccl_domain="x"),
    ]
    plans, unplanned, groups = negotiation.negotiate(
        TRAINER, OFFERS, replicas, DEFAULT_PREFERENCE, negotiation.GroupState()
    )
    by = {p.replica_id: p for p in plans}
    assert unplanned == []
    assert {rid: p.channel for rid, p in by.items()} == {
        "c": Channel.CPU,
        "i": Channel.IPC,
        "n": Channel.NCCL,
        "v": Channel.VOLUME,
        "x": Channel.NIXL,
    }
    assert set(groups.memberships) == {"cpu/c", "ipc", "nccl", "nixl"} and groups.minted == 4
    generations = [by[r].rendezvous.generation for r in ("c", "i", "n", "x")]
    assert sorted(generations) == [1, 2, 3, 4]  # one fresh generation per membership
    for rid in ("c", "i", "n", "x"):
        rdv = by[rid].rendezvous
        assert by[rid].channel in LIVE_CHANNELS
        assert rdv.channel is by[rid].channel and rdv.endpoint == OFFERS[rdv.channel].endpoint
        assert (rdv.rank, rdv.world_size) == (1, 2) and rdv.secret and rdv.group
        assert rdv.root == ""
    assert by["c"].rendezvous.group.startswith("cpu-c-")  # pairwise: named after its replica
    assert len({by[r].rendezvous.secret for r in ("c", "i", "n", "x")}) == 4
    nixl = by["x"].rendezvous
    assert (nixl.agent, nixl.metadata, nixl.epoch) == ("trainer-0", b"\x00md", 4)
    assert by["n"].rendezvous.agent == "" and by["n"].rendezvous.metadata == b""

    volume = by["v"].rendezvous
    assert volume == Rendezvous(Channel.VOLUME, root="/ckpt")
    assert volume.endpoint is None and not volume.secret and volume.world_size == 0
    assert by["v"].reason.startswith("volume; skipped ipc: ") and by["v"].manifest_checksum == ""


def test_rendezvous_survives_the_json_hop() -> None:
    plans, _, _ = negotiation.negotiate(
        TRAINER, OFFERS, [gpu("x", nccl_domain="x", nixl=True)], DEFAULT_PREFERENCE, negotiation.GroupState()
    )
    rdv = plans[0].rendezvous
    assert Rendezvous.from_dict(rdv.to_dict()) == rdv


def test_nccl_takes_one_rank_per_gpu() -> None:
    """Two ranks of one NCCL communicator on one GPU are invalid usage: the second replica on a GPU (or one on the
    trainer's GPU) is planned on its next channel, with the reason."""
    shared = [gpu(r, gpu_uuids=(u,), nixl=True) for r, u in (("a", "GPU-7"), ("b", "GPU-7"), ("c", "GPU-0"))]
    plans, unplanned, _ = negotiation.negotiate(
        TRAINER, {c: o for c, o in OFFERS.items() if c is not Channel.IPC}, shared, ALL, negotiation.GroupState()
    )
    assert unplanned == []
    by_id = {p.replica_id: p for p in plans}
    assert by_id["a"].channel is Channel.NCCL
    assert by_id["b"].channel is Channel.NIXL and "GPU GPU-7 already has a rank in the NCCL group" in by_id["b"].reason
    assert by_id["c"].channel is Channel.NIXL and "GPU GPU-0 already has a rank" in by_id["c"].reason
