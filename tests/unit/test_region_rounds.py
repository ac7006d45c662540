"""The sharded path's bookkeeping on both ends, without processes: what rank 0 tells its ranks, how it combines
their reports, and how an agent checks its workers' answers before it acks.

The plan comes from the coordinator's core (a 2-rank trainer, a TP=2 replica that registered its engine layout,
one that did not); the digests are the ones ``regions`` would report, made up per region.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from tests import vllm_stub
from tests.unit.sharding_cases import random_replica
from weightsync.channels import regions
from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator import serde
from weightsync.coordinator.clock import ManualClock
from weightsync.coordinator.core import Coordinator
from weightsync.coordinator.models import Capabilities, OpenedVersion, Role, summarize
from weightsync.coordinator.store import MemoryStore
from weightsync.errors import IntegrityError, PermanentError
from weightsync.sharding.plans import Region
from weightsync.sharding.shards import Mesh, Placement, TrainerLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel
from weightsync_inference.agent import regions_received
from weightsync_trainer import region_sends
from weightsync_trainer.region_sends import Round, _account

pytestmark = pytest.mark.unit

TABLE = TensorTable.build([[("a.weight", "bfloat16", (8, 6)), ("a.bias", "float32", (8,))], [("b", "float32", (5, 4))]])
TRAINER = TrainerLayout(TABLE, 2, (Mesh((2,), (0, 1)),), tuple(Placement(0, (0,)) for _ in TABLE))
ENGINE = random_replica(random.Random(5), TABLE, 2)
CPU = Capabilities(host="n", channels=(Channel.CPU,))


def _opened() -> OpenedVersion:
    core = Coordinator(lease_ttl_s=30.0, store=MemoryStore(), clock=ManualClock())
    offers = (Offer(Channel.CPU, Endpoint("10.0.0.1", 29500)),)
    lease = core.register("job", Role.TRAINER, "t", "t1", CPU, offers=offers, layout=TRAINER).lease_id
    core.register("job", Role.REPLICA, "r-regions", "i0", CPU, layout=ENGINE)
    core.register("job", Role.REPLICA, "r-whole", "i1", CPU)
    return core.open_version(lease, "job", "t1", 1, summarize(TABLE, True))


def _word(r: Region) -> str:
    """A stand-in for the digest both ends compute of a region."""
    return f"{r.nbytes}:{hash((r.tensor, r.source, r.worker)) & 0xFFFF:016x}"


def test_the_round_names_only_the_replicas_sent_regions_and_survives_json() -> None:
    opened = _opened()
    (target,) = region_sends.targets(opened)
    assert target.replica_id == "r-regions" and target.rendezvous.rank == 2 and target.regions
    assert target.plan_key == next(p for p in opened.plans if p.replica_id == "r-regions").transfer.key  # type: ignore[union-attr]
    told = Round(opened.version, gather=True, targets=(target,))
    rank = serde.HeldRegions()  # what a rank decoded
    assert Round.from_json(told.to_json(), rank) == told
    colocated = Round(opened.version, gather=False, targets=(dataclasses.replace(target, copied={(0, 0), (1, 1)}),))
    # once every rank holds the target's regions under its key, rank 0 leaves them out; the links still travel
    held = {(target.plan_key, target.replica_id)}
    assert b'"regions"' in colocated.to_json() and b'"regions"' not in colocated.to_json(held)
    assert Round.from_json(colocated.to_json(held), rank) == colocated  # the copied links reach every rank
    with pytest.raises(serde.NotHeld, match="'r-regions'"):  # a rank that did not parse them fails naming it
        Round.from_json(told.to_json(held), serde.HeldRegions())
    with pytest.raises(PermanentError, match="rank 0's round is malformed"):
        Round.from_json(b'{"version": 1}', rank)


def test_rank_0_combines_every_ranks_digests_in_plan_order_and_names_a_rank_that_failed() -> None:
    (target,) = region_sends.targets(_opened())
    told = Round(1, gather=False, targets=(target,))
    reports = [
        {"r-regions": {"digests": [_word(r) for r in target.regions if r.rank == rank], "nbytes": 10 * (rank + 1)}}
        for rank in (0, 1)
    ]
    sent = _account(told, reports, 0.5)
    by_worker = {w: [_word(r) for r in target.regions if r.worker == w] for w in (0, 1)}
    assert sent.digests == {"r-regions": regions.combine(target.regions, by_worker, regions.worker_of)}
    assert sent.failed == {} and sent.bytes_sent == {0: 10, 1: 20}

    reports[1] = {"r-regions": {"error": "trainer rank 1: the group did not form"}}
    failed = _account(told, reports, 0.5)
    assert failed.digests == {} and "trainer rank 1: the group did not form" in failed.failed["r-regions"]

    reports[1] = {"r-regions": {"digests": [], "nbytes": 0}}  # a rank that reports fewer regions than planned
    short = _account(told, reports, 0.5)
    assert "do not match the plan" in short.failed["r-regions"]


def test_an_agent_acks_its_workers_combined_digest_only_when_each_received_exactly_its_regions() -> None:
    opened = _opened()
    plan = next(p for p in opened.plans if p.replica_id == "r-regions")
    part = plan.regions_part()
    assert part is not None and next(p for p in opened.plans if p.replica_id == "r-whole").regions_part() is None
    answers = [
        {
            "worker": w,
            "layout_digest": TABLE.layout_digest(),
            "nbytes": sum(r.nbytes for r in part.regions if r.worker == w),
            "digests": [_word(r) for r in part.regions if r.worker == w],
        }
        for w in (0, 1)
    ]
    received = regions_received(3, TABLE, part, answers)
    by_rank = {k: [_word(r) for r in part.regions if r.rank == k] for k in (0, 1)}
    assert received.content_digest == regions.combine(part.regions, by_rank, regions.rank_of)  # the ranks' digest
    assert received.version == 3 and set(received.nbytes) == {0, 1}

    short = [{**answers[0], "nbytes": answers[0]["nbytes"] - 1}, answers[1]]
    with pytest.raises(IntegrityError, match="their regions hold"):
        regions_received(3, TABLE, part, short)
    other = [{**answers[0], "layout_digest": "sha256:" + "0" * 64}, answers[1]]
    with pytest.raises(IntegrityError, match="not the version's"):
        regions_received(3, TABLE, part, other)
    missing = [{**answers[0], "digests": answers[0]["digests"][:-1]}, answers[1]]
    with pytest.raises(IntegrityError, match="the plan gives it more"):
        regions_received(3, TABLE, part, missing)


def test_a_served_engine_takes_the_sharded_calls_through_collective_rpc_with_the_rendezvous_bounds() -> None:
    """``HttpEngine``'s region calls against a stand-in for vLLM's ``/collective_rpc`` (one answer per worker)."""
    from typing import Any

    from weightsync_inference.http_engine import HttpEngine

    calls: list[dict[str, Any]] = []
    answers = {
        "weightsync_table": [{"table": TABLE.to_dict()}, {"table": TABLE.to_dict()}],
        "weightsync_receive_regions": [{"worker": 0}, {"worker": 1}],
    }

    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        calls.append(body)
        return 200, {"results": answers[body["method"]]}

    with vllm_stub.serving(answer) as url:
        engine = HttpEngine(url)
        table = engine.last_table()
        assert table is not None and table.layout_digest() == TABLE.layout_digest()
        request = {"rendezvous": {"join_timeout_s": 10.0, "timeout_s": 50.0}, "regions": []}
        assert engine.receive_regions(request) == answers["weightsync_receive_regions"]
        engine.close()
    assert [c["method"] for c in calls] == ["weightsync_table", "weightsync_receive_regions"]
    assert calls[1]["timeout"] == 60.0 and json.loads(calls[1]["args"][0]) == request  # the workers' own bounds


def test_workers_answer_a_failed_sharded_update_and_the_engine_raises_naming_each() -> None:
    """A worker's failure comes back as its answer (``{"worker", "error"}``: vLLM's executor would leave the other
    workers' replies queued after one raised); the engine's call raises naming every worker that failed."""
    from weightsync.errors import WeightsyncError
    from weightsync_inference.receipts import regions_answers

    ok = [{"worker": 0, "nbytes": 4}, {"worker": 1, "nbytes": 4}]
    assert regions_answers(ok) == ok
    died = [
        {"worker": 0, "error": "RuntimeError: Connection closed by peer [10.0.0.2]:1234"},
        {"worker": 1, "error": "IntegrityError: region 3 from trainer rank 1 arrived with digest 1, sent 2"},
    ]
    with pytest.raises(WeightsyncError, match=r"worker 0: RuntimeError: Connection closed.*; worker 1: Integrity"):
        regions_answers(died)
    with pytest.raises(WeightsyncError, match="worker 1: ") as failed:
        regions_answers([ok[0], died[1]])
    assert "worker 0" not in str(failed.value)


def test_a_worker_keeps_the_plans_it_parsed_and_takes_a_later_request_that_names_one_only() -> None:
    from weightsync_inference import sharded

    opened = _opened()
    plan = next(p for p in opened.plans if p.replica_id == "r-regions")
    part = plan.regions_part()
    assert part is not None and plan.transfer is not None
    key = plan.transfer.key
    order = sharded.Order(1, plan.rendezvous, part.regions, part.copied)
    full = json.loads(json.dumps(sharded.request(order, TABLE, ENGINE.workers, key)))
    named = json.loads(json.dumps(sharded.request(order, TABLE, ENGINE.workers, key, held=True)))
    assert "regions" in full and not {"regions", "table", "layouts"} & set(named)
    parts: dict[str, sharded.Part] = {}
    first = sharded.parse(full, 1, parts)
    assert first[0] == order and first[1].layout == ENGINE.workers[1] and first[1].table == TABLE
    assert sharded.parse(named, 1, parts) == first and list(parts) == [key]
    # a worker that did not parse it (restarted under its agent) refuses, naming the plan: the agent sends it next
    with pytest.raises(PermanentError, match=r"leaves out the regions of plan sha256:.* which this worker has not"):
        sharded.parse(named, 1, {})
    for other in ("k1", "k2"):  # the newest plans only
        sharded.parse({**full, "plan_key": other}, 1, parts)
    assert list(parts) == ["k1", "k2"]
    with pytest.raises(PermanentError, match="no layout for worker 5"):
        sharded.parse(full, 5, parts)
