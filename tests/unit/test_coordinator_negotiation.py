"""Negotiation rules: preference order, overrides, failure fallback, group ids and ranks."""

from __future__ import annotations

import pytest

from weightsync.coordinator import negotiation
from weightsync.coordinator.models import DEFAULT_PREFERENCE, Capabilities, EngineKind, SenderOffer
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit

ALL = tuple(Channel)
TRAINER = Capabilities(
    host="n1",
    gpu_uuids=("GPU-0", "GPU-1"),
    channels=ALL,
    nccl_domain="rack1",
    nixl=True,
    volume_id="vol",
    engine=EngineKind.GPU,
)
OFFERS = {
    Channel.IPC: SenderOffer(Channel.IPC, ipc_handles={"GPU-0": b"h0", "GPU-1": b"h1"}),
    Channel.NCCL: SenderOffer(Channel.NCCL, "10.0.0.1", 29500),
    Channel.CPU: SenderOffer(Channel.CPU, "10.0.0.1", 29600),
}


def gpu(rid: str, **kw: object) -> negotiation.Candidate:
    caps = dict(
        host="n2", channels=ALL, nccl_domain="rack1", volume_id="vol", volume_mount="/ckpt", engine=EngineKind.GPU
    )
    failed = kw.pop("failed", frozenset())
    caps.update(kw)
    return negotiation.Candidate(rid, "inc-" + rid, Capabilities(**caps), failed)  # type: ignore[arg-type]


def pick(
    c: negotiation.Candidate,
    preference: tuple[Channel, ...] = DEFAULT_PREFERENCE,
    offers: dict[Channel, SenderOffer] = OFFERS,
) -> Channel | None:
    return negotiation.choose(TRAINER, offers, c, preference)[0]


def test_default_preference_order() -> None:
    assert pick(gpu("a", host="n1", gpu_uuids=("GPU-1",))) is Channel.IPC
    assert pick(gpu("b")) is Channel.NCCL
    assert pick(gpu("c", nccl_domain="rack2", nixl=True)) is Channel.NIXL
    assert pick(gpu("d", nccl_domain="rack2", engine=EngineKind.CPU)) is Channel.CPU
    assert pick(gpu("e", nccl_domain="rack2")) is Channel.VOLUME
    assert pick(gpu("f", nccl_domain="", volume_id="other")) is None


def test_ipc_needs_the_trainers_gpu_and_a_handle() -> None:
    assert pick(gpu("a", host="n1", gpu_uuids=("GPU-9",))) is Channel.NCCL
    no_handle = {**OFFERS, Channel.IPC: SenderOffer(Channel.IPC, ipc_handles={"GPU-0": b"h0"})}
    channel, reason = negotiation.choose(
        TRAINER, no_handle, gpu("a", host="n1", gpu_uuids=("GPU-1",)), DEFAULT_PREFERENCE
    )
    assert channel is Channel.NCCL and "no IPC handle offered for GPU GPU-1" in reason


def test_job_override_narrows_and_reorders() -> None:
    assert pick(gpu("b"), preference=(Channel.VOLUME, Channel.NCCL)) is Channel.VOLUME
    assert pick(gpu("b", volume_id=""), preference=(Channel.VOLUME,)) is None


def test_a_failed_channel_falls_back_to_the_volume() -> None:
    assert pick(gpu("b", failed=frozenset({Channel.NCCL}))) is Channel.VOLUME


def test_no_rendezvous_offered_this_round_means_volume() -> None:
    offers = {k: v for k, v in OFFERS.items() if k is not Channel.NCCL}
    channel, reason = negotiation.choose(TRAINER, offers, gpu("b"), DEFAULT_PREFERENCE)
    assert channel is Channel.VOLUME and "offered no NCCL rendezvous" in reason


def test_reason_names_what_was_skipped() -> None:
    _, reason = negotiation.choose(TRAINER, OFFERS, gpu("f", nccl_domain="", volume_id="other"), DEFAULT_PREFERENCE)
    assert reason.startswith("no shared channel:")
    assert "ipc: different hosts" in reason and "volume: no shared" in reason


def test_groups_ranks_and_ids() -> None:
    a, b = gpu("a", devices=2), gpu("b")
    plans, unplanned, groups = negotiation.negotiate(
        TRAINER, OFFERS, [b, a], DEFAULT_PREFERENCE, negotiation.GroupState()
    )
    by = {p.replica_id: p for p in plans}
    assert unplanned == []
    assert (by["a"].rendezvous.rank_offset, by["b"].rendezvous.rank_offset) == (1, 3)
    assert by["a"].rendezvous.world_size == by["b"].rendezvous.world_size == 4
    assert by["a"].rendezvous.address == "10.0.0.1:29500"
    first = by["a"].rendezvous.group_id
    # same members, same rendezvous: the group is kept
    plans2, _, groups2 = negotiation.negotiate(TRAINER, OFFERS, [a, b], DEFAULT_PREFERENCE, groups)
    assert {p.rendezvous.group_id for p in plans2} == {first}
    # a member leaves: new id, new world size
    plans3, _, groups3 = negotiation.negotiate(TRAINER, OFFERS, [a], DEFAULT_PREFERENCE, groups2)
    assert plans3[0].rendezvous.group_id != first and plans3[0].rendezvous.world_size == 3
    # a member restarts (new incarnation): new id too
    restarted = negotiation.Candidate("a", "inc-a2", a.capabilities)
    plans4, _, _ = negotiation.negotiate(TRAINER, OFFERS, [restarted], DEFAULT_PREFERENCE, groups3)
    assert plans4[0].rendezvous.group_id != plans3[0].rendezvous.group_id


def test_volume_plan_carries_the_replicas_mount_and_ipc_its_handles() -> None:
    plans, _, _ = negotiation.negotiate(
        TRAINER,
        OFFERS,
        [gpu("v", nccl_domain="x"), gpu("i", host="n1", gpu_uuids=("GPU-1",))],
        DEFAULT_PREFERENCE,
        negotiation.GroupState(),
    )
    by = {p.replica_id: p for p in plans}
    assert by["v"].channel is Channel.VOLUME and by["v"].rendezvous.volume_path == "/ckpt"
    assert by["i"].channel is Channel.IPC and dict(by["i"].rendezvous.ipc_handles) == {"GPU-1": b"h1"}
