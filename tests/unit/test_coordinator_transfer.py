"""The coordinator plans the sharded path: layouts registered, each replica's part in its plan.

On the core (no gRPC) with a ``ManualClock``: a 2-rank trainer that registered its layout and three replicas:
one on the CPU stream with its engine layout (sharded), one that registered none, one whose only channel is the
volume (both gathered in the same version, the plan saying why). Each trainer rank's sends are exactly its
regions; the plan comes from the job's cache while nothing changes; the wire form round-trips, and carries a part's
regions once per plan key to each end.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import Any

import pytest

from tests.unit.sharding_cases import random_replica
from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import faults, limits, serde
from weightsync.coordinator.clock import ManualClock
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import (
    AckReport,
    Assignment,
    Capabilities,
    EngineKind,
    EventKind,
    JobPolicy,
    Role,
    SentReport,
    summarize,
)
from weightsync.coordinator.store import MemoryStore
from weightsync.sharding import plans as sharding_plans
from weightsync.sharding.plans import Region
from weightsync.sharding.shards import Mesh, Placement, TrainerLayout
from weightsync.tensors import DIGEST_PREFIX, TensorTable
from weightsync.vocabulary import Channel, ReplicaState

pytestmark = pytest.mark.unit

TABLE = TensorTable.build(
    [[("a.weight", "bfloat16", (8, 6)), ("a.bias", "float32", (8,))], [("b", "bfloat16", (5, 4))]]
)
TRAINER = TrainerLayout(TABLE, 2, (Mesh((2,), (0, 1)),), tuple(Placement(0, (0,)) for _ in TABLE))
ENGINE = random_replica(random.Random(3), TABLE, 2)
CPU = Capabilities(host="n", channels=(Channel.CPU, Channel.VOLUME), volume_id="vol", volume_mount="/ckpt")
VOLUME_ONLY = Capabilities(host="n", channels=(Channel.VOLUME,), volume_id="vol", volume_mount="/ckpt")
OFFERS = (Offer(Channel.CPU, Endpoint("127.0.0.1", 29500)), Offer(Channel.VOLUME))


def _fleet(trainer: TrainerLayout | None = TRAINER) -> tuple[Coordinator, str]:
    core, lease, _ = _fleet_with_replicas(trainer)
    return core, lease


def _fleet_with_replicas(trainer: TrainerLayout | None = TRAINER) -> tuple[Coordinator, str, dict[str, str]]:
    """The core, the trainer's lease and each replica's."""
    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    lease = core.register("job", Role.TRAINER, "t", "t1", CPU, offers=OFFERS, layout=trainer).lease_id
    replicas = {
        "r-sharded": core.register("job", Role.REPLICA, "r-sharded", "i0", CPU, layout=ENGINE).lease_id,
        "r-none": core.register("job", Role.REPLICA, "r-none", "i1", CPU).lease_id,
        "r-volume": core.register("job", Role.REPLICA, "r-volume", "i2", VOLUME_ONLY, layout=ENGINE).lease_id,
    }
    return core, lease, replicas


def test_each_replica_gets_its_part_and_each_rank_its_sends_in_one_version() -> None:
    core, lease = _fleet()
    opened = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    parts = {p.replica_id: p.transfer for p in opened.plans}
    assert all(part is not None for part in parts.values())
    sharded = parts["r-sharded"].replica("r-sharded")  # type: ignore[union-attr]
    assert sharded.sharded and {r.worker for r in sharded.regions} == {0, 1}
    assert "no engine layout" in parts["r-none"].replica("r-none").gathered  # type: ignore[union-attr]
    volume = parts["r-volume"].replica("r-volume")  # type: ignore[union-attr]
    assert "'volume' carries whole tensors only" in volume.gathered and not volume.regions
    whole = parts["r-sharded"]
    sends = [[r for _, r in whole.sends(rank)] for rank in range(2)]  # type: ignore[union-attr]
    assert all(mine and {r.rank for r in mine} == {rank} for rank, mine in enumerate(sends))
    assert sorted(sends[0] + sends[1], key=sharded.regions.index) == list(sharded.regions)
    again = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))  # a retried open: the same parts
    assert again.reused and again.plans == opened.plans


def test_the_plan_comes_from_the_jobs_cache_until_something_changes() -> None:
    core, lease = _fleet()
    first = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    second = core.open_version(lease, "job", "t1", 2, summarize(TABLE, True))
    cache = core._state.job("job").transfer_plans
    parts = [{p.replica_id: p.transfer for p in o.plans} for o in (first, second)]
    assert cache.computed == 1 and parts[0] == parts[1]
    core.register("job", Role.REPLICA, "r-none", "i1", CPU, layout=ENGINE)  # it records its layout now
    third = core.open_version(lease, "job", "t1", 3, summarize(TABLE, True))
    assert (
        cache.computed == 2
        and next(p for p in third.plans if p.replica_id == "r-none")
        .transfer.replica(  # type: ignore[union-attr]
            "r-none"
        )
        .sharded
    )


def test_no_plan_without_a_trainer_layout_or_for_another_table() -> None:
    core, lease = _fleet(trainer=None)
    opened = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    assert all(p.transfer is None for p in opened.plans)
    other = TensorTable.build([[("a.weight", "bfloat16", (8, 6))]])
    core, lease = _fleet()
    opened = core.open_version(lease, "job", "t1", 1, summarize(other, True))
    assert all(p.transfer is None for p in opened.plans)


def test_the_wire_carries_layouts_and_parts_and_refuses_the_wrong_layout_for_a_role() -> None:
    core, lease = _fleet()
    opened = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    assert serde.opened(serde.opened_to(opened)) == opened
    assert serde.opened(serde.opened_to(opened), serde.HeldRegions()) == opened
    trainer = serde.register_request("job", Role.TRAINER, "t", "t1", CPU, None, OFFERS, 0, TRAINER)
    replica = serde.register_request("job", Role.REPLICA, "r", "i", CPU, None, (), 0, ENGINE)
    assert serde.registered_layout(trainer, Role.TRAINER) == TRAINER
    assert serde.registered_layout(replica, Role.REPLICA) == ENGINE
    with pytest.raises(faults.InvalidArgument, match="trainer_layout is not a replica's layout"):
        serde.registered_layout(trainer, Role.REPLICA)


REGIONS = DIGEST_PREFIX + "a" * 64
"""What the trainer's ranks sent r-sharded, combined."""
WHOLE = DIGEST_PREFIX + "b" * 64
"""What the gathered path sent (per-tensor digests, combined)."""


def _ack(digest: str) -> AckReport:
    return AckReport(1, TABLE.layout_digest(), ok=True, content_digest=digest)


def test_a_replica_sent_regions_joins_a_region_group_of_the_ranks_and_its_workers() -> None:
    core, lease = _fleet()
    plans = {p.replica_id: p for p in core.open_version(lease, "job", "t1", 1, summarize(TABLE, True)).plans}
    regions, whole = plans["r-sharded"].rendezvous, plans["r-none"].rendezvous
    assert (regions.rank, regions.world_size) == (2, 2 + len(ENGINE.workers))  # ranks 0..1, then the workers
    assert regions.endpoint == whole.endpoint == OFFERS[0].endpoint  # rank 0's CPU-stream store
    assert "-regions-" in regions.group and regions.secret  # a membership of its own
    again = {p.replica_id: p for p in core.open_version(lease, "job", "t1", 2, summarize(TABLE, True)).plans}
    assert again["r-sharded"].rendezvous == regions  # kept by both ends while the membership holds
    assert (whole.rank, whole.world_size) != (regions.rank, regions.world_size)  # the CPU stream's, as before


def test_a_replica_sent_regions_must_ack_the_ranks_combined_digest_whatever_the_order() -> None:
    core, lease, replicas = _fleet_with_replicas()
    core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    # an ack before the trainer's report is checked when the report arrives, against the region digest alone
    core.ack(replicas["r-sharded"], _ack(DIGEST_PREFIX + "f" * 64))
    core.ack(replicas["r-none"], _ack(WHOLE))  # not compared with r-sharded's: another kind of digest
    info = core.report_sent(lease, 1, SentReport(WHOLE, {}, region_digests={"r-sharded": REGIONS}))
    states = {r.replica_id: r.state for r in info.replicas}
    assert states["r-sharded"] is ReplicaState.FAILED and states["r-none"] is ReplicaState.LOADED
    errors = core._state.job("job").versions[1].errors
    assert "is not the " + REGIONS + " combined region digest" in errors["r-sharded"], errors


def test_after_the_report_a_regions_ack_passes_only_with_the_ranks_combined_digest() -> None:
    core, lease, replicas = _fleet_with_replicas()
    core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    core.report_sent(lease, 1, SentReport(WHOLE, {}, region_digests={"r-sharded": REGIONS}))
    core.ack(replicas["r-sharded"], _ack(WHOLE))  # the gathered digest is not what its workers were sent
    core.ack(replicas["r-none"], _ack(WHOLE))
    rec = core._state.job("job").versions[1]
    assert rec.status["r-sharded"] is ReplicaState.FAILED and rec.status["r-none"] is ReplicaState.LOADED
    core2, lease2, replicas2 = _fleet_with_replicas()
    core2.open_version(lease2, "job", "t1", 1, summarize(TABLE, True))
    core2.report_sent(lease2, 1, SentReport(WHOLE, {}, region_digests={"r-sharded": REGIONS}))
    core2.ack(replicas2["r-sharded"], _ack(REGIONS))
    assert core2._state.job("job").versions[1].status["r-sharded"] is ReplicaState.LOADED


def test_region_digests_cross_the_wire_and_its_field_limits() -> None:
    sent = SentReport(WHOLE, {"r-none": "cpu: gone"}, region_digests={"r-sharded": REGIONS, "r-2": WHOLE})
    request = serde.report_sent_to("lease", 1, sent)
    limits.check_fields(request)
    assert serde.report_sent(request) == sent
    request.region_digests.add(replica_id="r-3", content_digest="not-a-digest")
    with pytest.raises(faults.InvalidArgument, match=r"region_digests\[2\].content_digest"):
        serde.report_sent(request)


def test_an_all_or_nothing_job_plans_every_replica_on_the_gathered_path_saying_why() -> None:
    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    policy = JobPolicy(all_or_nothing=True)
    lease = core.register("job", Role.TRAINER, "t", "t1", CPU, offers=OFFERS, layout=TRAINER, policy=policy).lease_id
    core.register("job", Role.REPLICA, "r-sharded", "i0", CPU, layout=ENGINE)
    (plan,) = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True)).plans
    assert plan.transfer is not None
    assert "all-or-nothing: the replica stages the version" in plan.transfer.replica("r-sharded").gathered
    assert plan.rendezvous.rank == 1  # the CPU stream's, as before


def test_a_replica_back_on_the_gathered_path_gets_a_new_cpu_stream_group() -> None:
    """The publisher released its CPU-stream group while it took regions; a gathered plan must not name the old one
    (its agent would keep the receiver it joined then, which no sender serves any more)."""
    core, lease = _fleet()
    before = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    whole = next(p for p in before.plans if p.replica_id == "r-none").rendezvous
    core.register("job", Role.REPLICA, "r-sharded", "i0", CPU)  # its engine layout gone: the gathered path
    after = {p.replica_id: p for p in core.open_version(lease, "job", "t1", 2, summarize(TABLE, True)).plans}
    assert after["r-sharded"].transfer.replica("r-sharded").gathered  # type: ignore[union-attr]
    regions = next(p for p in before.plans if p.replica_id == "r-sharded").rendezvous
    assert after["r-sharded"].rendezvous.generation > regions.generation
    assert after["r-none"].rendezvous.same_membership(whole)  # the others' groups stay as they were


NCCL_TRAINER = Capabilities(
    host="t", gpu_uuids=("g0",), channels=(Channel.NCCL, Channel.VOLUME), nccl_domain="d", volume_id="vol",
    volume_mount="/ckpt", engine=EngineKind.GPU, rank_gpu_uuids=("g0", "g1"),
)  # fmt: skip
NCCL_OFFERS = (Offer(Channel.NCCL, Endpoint("10.0.0.1", 29600)), Offer(Channel.VOLUME))


def _gpus(*uuids: str) -> Capabilities:
    return Capabilities(
        host="r", gpu_uuids=uuids, devices=len(uuids), channels=(Channel.NCCL, Channel.VOLUME), nccl_domain="d",
        volume_id="vol", volume_mount="/ckpt", engine=EngineKind.GPU,
    )  # fmt: skip


def test_regions_over_nccl_go_in_a_group_of_their_own_apart_from_the_gathered_nccl_group() -> None:
    """A replica on GPUs of its own takes regions over NCCL, in its own group (the ranks and its workers); the
    gathered NCCL group holds only the replicas it serves, and neither changes from one version to the next; a
    replica on a trainer rank's GPU takes the gathered path over NCCL, the plan saying which rank holds it."""
    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    lease = core.register("job", Role.TRAINER, "t", "t1", NCCL_TRAINER, offers=NCCL_OFFERS, layout=TRAINER).lease_id
    core.register("job", Role.REPLICA, "r-apart", "i0", _gpus("g2", "g3"), layout=ENGINE)
    core.register("job", Role.REPLICA, "r-none", "i1", _gpus("g4"))
    core.register("job", Role.REPLICA, "r-shared", "i2", _gpus("g1", "g5"), layout=ENGINE)
    opened = [core.open_version(lease, "job", "t1", step, summarize(TABLE, True)) for step in (1, 2)]
    first, second = ({p.replica_id: p for p in o.plans} for o in opened)
    assert {p.channel for p in first.values()} == {Channel.NCCL}
    apart = first["r-apart"].rendezvous
    assert first["r-apart"].transfer.replica("r-apart").sharded  # type: ignore[union-attr]
    assert (apart.channel, apart.endpoint, apart.rank, apart.world_size) == (
        Channel.NCCL,
        NCCL_OFFERS[0].endpoint,
        2,
        4,
    )
    shared = first["r-shared"].transfer.replica("r-shared")  # type: ignore[union-attr]
    assert "its GPU g1 holds trainer rank 1" in shared.gathered
    gathered = {rid: first[rid].rendezvous for rid in ("r-none", "r-shared")}
    assert gathered["r-none"].same_membership(gathered["r-shared"])  # one NCCL group, without r-apart:
    assert gathered["r-none"].world_size == 1 + 1 + 2 and not gathered["r-none"].same_membership(apart)
    assert sorted(r.rank for r in gathered.values()) == [1, 2]
    assert second["r-apart"].rendezvous == apart  # the same group of its own, kept by both ends
    assert all(second[rid].rendezvous.same_membership(gathered[rid]) for rid in gathered)


def test_rank_gpus_cross_the_wire_within_their_limit() -> None:
    assert serde.capabilities(serde.capabilities_to(NCCL_TRAINER)) == NCCL_TRAINER
    many = serde.capabilities_to(dataclasses.replace(NCCL_TRAINER, rank_gpu_uuids=tuple(map(str, range(1025)))))
    with pytest.raises(faults.InvalidArgument, match="rank_gpu_uuids has 1025 entries, over the limit of 1024"):
        limits.check_fields(many)


def test_layouts_are_bounded_by_their_own_limits_not_an_ordinary_lists() -> None:
    """A layout lists an entry per tensor, parameter and fill and a mesh one per rank (real models: hundreds to tens
    of thousands); those lists have their own bounds, past which a registration is refused naming the list."""
    ranks = limits.MAX_RANKS + 1
    layout = TrainerLayout(TABLE, ranks, (Mesh((ranks,), tuple(range(ranks))),), TRAINER.placements)
    caps = Capabilities(host="n", channels=(Channel.CPU,))
    request = serde.register_request("job", Role.TRAINER, "t", "t1", caps, None, (), 0, layout)
    with pytest.raises(
        faults.InvalidArgument, match=r"trainer_layout.meshes\[0\].ranks has 1025 entries, over the limit "
    ):
        limits.check_fields(request)
    request.trainer_layout.meshes[0].ranks.pop()
    limits.check_fields(request)  # up to the bound: passes
    engine = serde.register_request("job", Role.REPLICA, "r", "r1", caps, None, (), 0, ENGINE)
    del engine.engine_layout.workers[0].fills[:]
    engine.engine_layout.workers[0].fills.extend([engine.engine_layout.workers[1].fills[0]] * (limits.MAX_TENSORS + 1))
    with pytest.raises(faults.InvalidArgument, match=r"engine_layout.workers\[0\].fills has 1048577 entries"):
        limits.check_fields(engine)


def test_a_region_group_that_failed_on_either_end_gets_a_new_name_for_the_next_version() -> None:
    """Both ends keep a region group while its name holds and form each name once (``region_groups.Kept``): after a
    failure on the replica's end (its live channel failed) or the trainer's (its report names the replica lost),
    the next version names a new group; the other replicas' groups stay as they were."""
    core, lease, replicas = _fleet_with_replicas()
    watching = [core.subscribe(held) for held in replicas.values()]  # each watches, so each stays planned
    names = []
    for step, fail in ((1, "ack"), (2, "report"), (3, "")):
        opened = {p.replica_id: p for p in core.open_version(lease, "job", "t1", step, summarize(TABLE, True)).plans}
        names.append((opened["r-sharded"].rendezvous.group, opened["r-none"].rendezvous.group))
        version = opened["r-sharded"].transfer and step  # versions are numbered as the steps here
        if fail == "ack":
            report = AckReport(version, TABLE.layout_digest(), ok=False, error="regions: gone", channel_failed=True)
            core.ack(replicas["r-sharded"], report)
        elif fail == "report":
            core.report_sent(lease, version, SentReport(WHOLE, {"r-sharded": "regions: trainer rank 1: gone"}))
        for _ in range(7):  # past the failed channel's backoff (30 s, then 60 s), the leases renewed
            core.clock.advance(10.0)  # type: ignore[attr-defined]
            for held in (lease, *replicas.values()):
                core.renew(held)
    (first, whole1), (second, whole2), (third, whole3) = names
    assert "-regions-" in first and first != second != third, names
    assert whole1 == whole2 == whole3 and watching, names


def test_a_replica_on_the_trainers_gpus_copies_its_colocated_links_by_ipc_and_takes_the_rest_over_nccl() -> None:
    """A colocated replica (one host, its workers on the trainer ranks' GPUs, it receives IPC) is planned on NCCL
    regions though its GPUs hold trainer ranks: the links whose ends share a GPU are copied (``ReplicaPlan.copied``,
    across the wire too), the others go over groups per rank (``region_groups.rank_groups``). Without IPC, or on
    another host, it takes the gathered path saying why; either way the gathered NCCL group never names it."""
    from weightsync.channels import region_groups
    from weightsync.sharding import links

    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    lease = core.register("job", Role.TRAINER, "t", "t1", NCCL_TRAINER, offers=NCCL_OFFERS, layout=TRAINER).lease_id
    near = dataclasses.replace(_gpus("g0", "g1"), host="t", channels=(Channel.IPC, Channel.NCCL, Channel.VOLUME))
    core.register("job", Role.REPLICA, "r-colocated", "i0", near, layout=ENGINE)
    core.register("job", Role.REPLICA, "r-no-ipc", "i1", dataclasses.replace(_gpus("g1"), host="t"), layout=ENGINE)
    core.register("job", Role.REPLICA, "r-none", "i2", _gpus("g4"))
    opened = {p.replica_id: p for p in core.open_version(lease, "job", "t1", 1, summarize(TABLE, True)).plans}

    colocated = opened["r-colocated"]
    part = colocated.regions_part()
    assert colocated.channel is Channel.NCCL and part is not None
    assert part.copied == links.copied(part.regions, {0: "g0", 1: "g1"}, {0: "g0", 1: "g1"}) == {(0, 0), (1, 1)}
    assert (colocated.rendezvous.rank, colocated.rendezvous.world_size) == (2, 4)
    groups = region_groups.rank_groups(colocated.rendezvous, part.regions, part.copied)
    assert {r: (g.world_size, ws) for r, (g, ws) in groups.items()} == {0: (2, (1,)), 1: (2, (0,))}
    assert len({g.prefix for g, _ in groups.values()} | {colocated.rendezvous.prefix}) == 3
    wire = serde.transfer_part(serde.transfer_part_to(colocated.transfer))  # type: ignore[arg-type]
    assert wire.replica("r-colocated").copied == part.copied

    no_ipc = opened["r-no-ipc"].transfer.replica("r-no-ipc")  # type: ignore[union-attr]
    assert "its GPU g1 holds trainer rank 1" in no_ipc.gathered and "does not receive ipc" in no_ipc.gathered
    gathered = opened["r-none"].rendezvous
    assert gathered.same_membership(opened["r-no-ipc"].rendezvous) and gathered.world_size == 1 + 1 + 1
    assert not gathered.same_membership(colocated.rendezvous)
    with pytest.raises(Exception, match=r"copies links \[\(0, 7\)\]"):
        region_groups.rank_groups(colocated.rendezvous, part.regions, frozenset({(0, 7)}))


def test_a_replica_whose_workers_reach_the_trainers_gpus_peer_to_peer_copies_every_link_it_can() -> None:
    """A replica whose workers all read the trainer ranks' GPUs directly (``peer_gpu_uuids``: one host, NVLink or
    PCIe P2P) copies every link from a rank on one of them, its own GPUs' too, and forms no group for those: a
    copy engine's read waits for no process's time slice. Peers count only where the replica can copy (one host,
    it receives IPC): the same report from another host leaves its links on the wire. The report survives the
    wire (``serde``)."""
    from weightsync.channels import region_groups

    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    lease = core.register("job", Role.TRAINER, "t", "t1", NCCL_TRAINER, offers=NCCL_OFFERS, layout=TRAINER).lease_id
    reach = ("g0", "g1", "g2", "g3")
    peer = dataclasses.replace(_gpus("g2", "g3"), host="t", channels=(Channel.IPC, Channel.NCCL), peer_gpu_uuids=reach)
    assert serde.capabilities(serde.capabilities_to(peer)) == peer
    core.register("job", Role.REPLICA, "r-peer", "i0", peer, layout=ENGINE)
    core.register("job", Role.REPLICA, "r-far", "i1", dataclasses.replace(peer, host="other"), layout=ENGINE)
    core.register("job", Role.REPLICA, "r-on", "i2", dataclasses.replace(peer, gpu_uuids=("g0", "g1")), layout=ENGINE)
    opened = {p.replica_id: p for p in core.open_version(lease, "job", "t1", 1, summarize(TABLE, True)).plans}

    for name in ("r-peer", "r-on"):  # beside the ranks' GPUs, or on them: every link copied, no group per rank
        part = opened[name].regions_part()
        assert opened[name].channel is Channel.NCCL and part is not None
        assert part.copied == {(r.rank, r.worker) for r in part.regions} == {(r, w) for r in (0, 1) for w in (0, 1)}
        assert region_groups.rank_groups(opened[name].rendezvous, part.regions, part.copied) == {}
    far = opened["r-far"].regions_part()
    assert far is not None and far.copied == frozenset()  # another host: its report cannot hold, the wire carries


def test_a_replica_on_nixl_reads_every_link_itself_on_the_trainers_gpus_too() -> None:
    """NIXL carries regions: a replica planned on it gets a membership of its own on the NIXL offer's store (the
    trainer's ranks and its workers), and no copied links even where its workers share the ranks' GPUs (each worker
    reads every link out of the ranks' registered shards, ``nixl_regions``); the trainer's ranks get their parts.
    A replica whose only NIXL-capable peer is IPC keeps the gathered path, the plan saying why."""
    trainer = dataclasses.replace(NCCL_TRAINER, channels=(Channel.IPC, Channel.NIXL, Channel.VOLUME), nixl=True)
    offers = (
        Offer(Channel.IPC, Endpoint("10.0.0.1", 29601), devices=("g0",)),
        Offer(Channel.NIXL, Endpoint("10.0.0.1", 29602), agent="trainer-agent", metadata="bWQ="),
        Offer(Channel.VOLUME),
    )
    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    lease = core.register("job", Role.TRAINER, "t", "t1", trainer, offers=offers, layout=TRAINER).lease_id
    on_nixl = dataclasses.replace(_gpus("g0", "g1"), host="t", channels=(Channel.NIXL, Channel.VOLUME), nixl=True)
    core.register("job", Role.REPLICA, "r-nixl", "i0", on_nixl, layout=ENGINE)
    on_ipc = dataclasses.replace(_gpus("g0"), host="t", channels=(Channel.IPC, Channel.VOLUME))
    core.register("job", Role.REPLICA, "r-ipc", "i1", on_ipc, layout=random_replica(random.Random(4), TABLE, 1))
    opened = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    plans = {p.replica_id: p for p in opened.plans}

    nixl = plans["r-nixl"]
    part = nixl.regions_part()
    assert nixl.channel is Channel.NIXL and part is not None and part.copied == frozenset()
    assert {(r.rank, r.worker) for r in part.regions} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    rdv = nixl.rendezvous
    assert (rdv.endpoint, rdv.rank, rdv.world_size) == (offers[1].endpoint, 2, 4) and "nixl-regions" in rdv.group
    ipc = plans["r-ipc"].transfer.replica("r-ipc")  # type: ignore[union-attr]
    assert plans["r-ipc"].channel is Channel.IPC and "'ipc' carries whole tensors only" in ipc.gathered


def test_a_plans_regions_go_once_per_key_to_each_end_and_its_links_every_time() -> None:
    core, lease = _fleet()
    v1, v2 = (core.open_version(lease, "job", "t1", s, summarize(TABLE, True)) for s in (1, 2))
    p1, p2 = (next(p for p in o.plans if p.replica_id == "r-sharded") for o in (v1, v2))
    assert p1.transfer is not None and p2.transfer is not None and p1.transfer.key == p2.transfer.key
    events = [Assignment(EventKind.ASSIGN, "job", v, plan=p) for v, p in ((1, p1), (2, p2))]

    # a watch stream sends a part's regions the first time only; the agent's client fills them back in
    stream = serde.HeldRegions()
    first, second = (serde.event_to(e, stream) for e in events)
    assert len(first.plan.transfer.replicas[0].regions) == len(p1.transfer.replica("r-sharded").regions) > 0
    assert second.plan.transfer.replicas[0].held and not second.plan.transfer.replicas[0].regions
    agent = serde.HeldRegions()
    assert [serde.event(first, agent), serde.event(second, agent)] == events
    # an end that did not see the first (a new stream starts empty: it sends them again) refuses, naming the replica
    with pytest.raises(serde.NotHeld, match="replica 'r-sharded'"):
        serde.event(second, serde.HeldRegions())
    with pytest.raises(serde.NotHeld, match="keeps no regions"):
        serde.event(second)
    assert serde.event_to(events[1], serde.HeldRegions()).plan.transfer.replicas[0].regions  # a new stream: in full

    # what is not the key's travels every time: links copied now, under the same key
    (rp,) = p2.transfer.replicas
    copied = dataclasses.replace(
        p2, transfer=dataclasses.replace(p2.transfer, replicas=(dataclasses.replace(rp, copied=frozenset({(0, 1)})),))
    )
    again = serde.event_to(Assignment(EventKind.ASSIGN, "job", 3, plan=copied), stream)
    assert again.plan.transfer.replicas[0].held
    assert serde.event(again, agent).plan == copied

    # OpenVersion: the trainer names the key it holds; every replica's regions of that plan stay home
    trainer = serde.HeldRegions()
    assert serde.opened(serde.opened_to(v1), trainer) == v1 and trainer.newest == p1.transfer.key
    wire = serde.opened_to(v2, trainer.newest)
    assert all(r.held and not r.regions for p in wire.plans if p.HasField("transfer") for r in p.transfer.replicas)
    assert serde.opened(wire, trainer) == v2
    other = serde.opened_to(v2, "sha256:" + "0" * 64)  # another key: in full
    assert any(r.regions for p in other.plans if p.HasField("transfer") for r in p.transfer.replicas)

    # the newest keys only, on both ends alike: a key the client let go comes in full again
    sender, receiver = serde.HeldRegions(), serde.HeldRegions()
    for key in ("k1", "k2", "k3", "k1"):
        part = dataclasses.replace(p1.transfer, key=key)
        wire = serde.transfer_part_to(part, sender)
        assert not wire.replicas[0].held
        assert serde.transfer_part(wire, held=receiver) == part
    assert receiver.newest == "k1" and serde.transfer_part_to(part, sender).replicas[0].held
    with pytest.raises(serde.NotHeld):
        receiver.regions("k2", "r-sharded", "plan")


def test_a_part_past_the_messages_room_is_left_out_and_read_in_chunks() -> None:
    """Regions take at most a message's room (half its limit); a part past it is left out (``held``), and its end,
    holding none, reads it (``GetPlanRegions``: chunks within the room, checked to be every region)."""
    core, lease, replicas = _fleet_with_replicas()
    opened = core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))
    plan = next(p for p in opened.plans if p.replica_id == "r-sharded")
    assert plan.transfer is not None
    regions = plan.transfer.replica("r-sharded").regions
    size = sum(
        r.ByteSize()
        for r in serde.event_to(Assignment(EventKind.ASSIGN, "job", 1, plan=plan)).plan.transfer.replicas[0].regions
    )

    fits, short = serde.Room(size), serde.Room(size - 1)
    assert (
        serde.event_to(Assignment(EventKind.ASSIGN, "job", 1, plan=plan), room=fits).plan.transfer.replicas[0].regions
    )
    assert fits.left == 0
    wire = serde.event_to(Assignment(EventKind.ASSIGN, "job", 1, plan=plan), serde.HeldRegions(), short)
    assert wire.plan.transfer.replicas[0].held and not wire.plan.transfer.replicas[0].regions
    read: list[tuple[str, str]] = []

    def fetch(key: str, replica_id: str) -> tuple[Region, ...]:
        read.append((key, replica_id))
        found = core.plan_regions(replicas[replica_id], key, replica_id)
        return serde.chunked_regions(serde.region_chunks(found, 64), "regions")

    agent = serde.HeldRegions(fetch=fetch)
    assert serde.event(wire, agent).plan == plan and read == [(plan.transfer.key, "r-sharded")]
    assert serde.event(wire, agent).plan == plan and len(read) == 1  # kept once read

    chunks = list(serde.region_chunks(regions, 64))
    assert len(chunks) > 1 and all(c.total == len(regions) for c in chunks)
    with pytest.raises(
        faults.InvalidArgument,
        match=f"{len(regions) - len(chunks[-1].regions)} regions arrived of the part's {len(regions)}",
    ):
        serde.chunked_regions(chunks[:-1], "regions")
    assert serde.chunked_regions(serde.region_chunks((), 64), "regions") == ()
    # who may read: the trainer any replica's part, a replica its own; a key the job no longer holds is not found
    assert core.plan_regions(lease, plan.transfer.key, "r-sharded") == regions
    with pytest.raises(faults.PermissionDenied, match="a replica reads its own only"):
        core.plan_regions(replicas["r-none"], plan.transfer.key, "r-sharded")
    with pytest.raises(faults.NotFound, match="has no replica 'r-gone'"):
        core.plan_regions(lease, plan.transfer.key, "r-gone")


def test_a_new_plan_is_computed_off_the_coordinators_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning a big model takes seconds (Qwen3-235B to 8 replicas); the coordinator's other calls, the leases'
    renewals above all, go on meanwhile. The computation is held at a gate here (a stand-in for its length) while
    another thread renews a lease and reads the job; the open then completes with the plan, cached once."""
    core, lease, replicas = _fleet_with_replicas()
    computing, go = threading.Event(), threading.Event()
    real = sharding_plans.plan

    def slow(*args: Any) -> Any:
        computing.set()
        assert go.wait(30)
        return real(*args)

    monkeypatch.setattr(sharding_plans, "plan", slow)
    opened: list[Any] = []
    opener = threading.Thread(
        target=lambda: opened.append(core.open_version(lease, "job", "t1", 1, summarize(TABLE, True)))
    )
    opener.start()
    assert computing.wait(30)
    others: list[Any] = []
    side = threading.Thread(target=lambda: others.extend([core.renew(replicas["r-sharded"]), core.get_job("job")]))
    side.start()
    side.join(10)
    assert len(others) == 2, "a call waited for the plan's computation"
    go.set()
    opener.join(30)
    (version,) = opened
    assert next(p for p in version.plans if p.replica_id == "r-sharded").transfer.replica("r-sharded").regions  # type: ignore[union-attr]
    assert core._state.job("job").transfer_plans.computed == 1
    core.open_version(lease, "job", "t1", 2, summarize(TABLE, True))
    assert core._state.job("job").transfer_plans.computed == 1  # the next version finds it
