"""The sharded path end to end: a 2-rank FSDP2 trainer publishes through ``Publisher`` to a TP=2 vLLM CPU replica
driven by its agent, every rank sending only its own regions, every worker receiving only its own.

Each trainer rank runs on a host of its own (network namespaces; gloo between them over the bridge), the
coordinator serves real gRPC with TLS and a bearer token on the bridge, and the replica (a real vLLM CPU engine at
tensor-parallel size 2, ``OfflineEngine``, with its ``Agent`` on a thread) runs on the test's own host, beside a
second TP=2 replica whose engine cannot take regions (``WholeOnly``). The first version reaches both whole (no
engine layout is registered yet); the first replica's agent then records the layout of that table and registers
it, so the next version is planned on regions for it and on the gathered path for the other, in one publish: the
region group forms on trainer rank 0's CPU-stream store (the rendezvous the coordinator put in the plan), each
rank sends from its local shards, and the replica acks the combined digest its workers computed of what arrived
(each region's digest checked at the receiver); each of its workers then holds, bit for bit, what the gathered
replica's same worker holds (vLLM's own loader given the full tensors; ``held``, packed weights included).

``make sharded`` (WEIGHTSYNC_SHARDED=all) adds a TP=1 replica taking regions over NCCL and a TP=2 replica reading
them over NIXL in the same versions (a third and a fourth engine, so make test keeps two) and, on that fleet,
4 FSDP2 ranks publishing, a byte flipped on one rank's link (the version fails naming the tensor and the rank) and
a rank killed mid-send (the version fails; a region replica left torn reloads the previous version from the sharded
volume, the gathered replica that loaded the failed version goes back to the previous one, and the next version
moves as regions again).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from tests import netns, pki, support
from weightsync.coordinator import limits
from weightsync.vocabulary import Channel
from weightsync_trainer import tiny_models

pytestmark = pytest.mark.integration
ALL = os.environ.get("WEIGHTSYNC_SHARDED") == "all"
full = pytest.mark.skipif(
    not ALL, reason="make sharded (WEIGHTSYNC_SHARDED=all); make test publishes regions to the TP=2 replica"
)
ROOT = Path(__file__).resolve().parents[2]
JOB, REPLICA, WHOLE, TOKEN = "job", "replica-tp2", "replica-whole", "sharded-publish-token"
TP1 = "replica-tp1"
"""``make sharded`` only: a TP=1 replica taking regions too (a third engine; make test keeps two), over the NCCL
channel (its code over gloo, ``WEIGHTSYNC_NCCL_TRANSPORT=gloo``): its region group forms on rank 0's NCCL store,
apart from the gathered NCCL group."""
NIXL_TP2 = "replica-nixl"
"""``make sharded`` only: a TP=2 replica on NIXL (a fourth engine): its workers read their regions out of the
ranks' registered shards (``nixl_regions``; host memory, ``WEIGHTSYNC_NIXL_MEMORY=host``; UCX over TCP between
the hosts), the first version whole over the NIXL channel."""
CHANNELS = {REPLICA: Channel.CPU, WHOLE: Channel.CPU, TP1: Channel.NCCL, NIXL_TP2: Channel.NIXL}
"""The channel each replica declares (with the volume)."""
RANKS = 4 if ALL else 2
"""Hosts for trainer ranks: ``make sharded`` also publishes from 4 FSDP2 ranks."""
TIMEOUT_S = 60.0
DEEP = replace(tiny_models.PRESETS["tiny-qwen2"], num_layers=10)
"""The tiny Qwen2 with 10 layers: its layouts list more than an ordinary request list may hold (the table's 122
tensors, a TP=2 worker's 72 parameters; ``limits.MAX_ITEMS``), as every real model's do."""


@dataclass
class Fleet:
    hosts: netns.Hosts
    target: str
    ca: Path
    engine: Any
    agent: Any
    sharded: dict[str, tuple[Any, Any]]
    """Every replica that takes regions: id -> (engine, agent); the TP=2 one, and the TP=1 one in make sharded."""
    whole_engine: Any
    """The replica that cannot take regions (``WholeOnly``): it gets the gathered path in the same versions."""
    whole_agent: Any
    work: Path
    model: Path
    volume: Path
    """The job's checkpoint volume: every trainer rank writes its shards of each version there (format v2); a
    replica left torn reloads the newest durable READY version from it."""


class WholeOnly:
    """An engine without the sharded path's calls (``lifecycle.RegionControl``): its agent registers no engine
    layout, so the coordinator plans it on the gathered path, the plan saying why."""

    REGION_CALLS = frozenset({"last_table", "engine_layout", "receive_regions"})

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        if name in self.REGION_CALLS:
            raise AttributeError(name)
        return getattr(self.engine, name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mint(folder: Path, address: str) -> None:
    """A CA and the coordinator's certificate for ``address``."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    pki.write(folder / "ca", pki.cert("sharded-ca", ca_key, "sharded-ca", ca_key, ca=True))
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(address))]
    pki.write(folder / "server", pki.cert("coordinator", key, "sharded-ca", ca_key, sans=sans), key)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    sizes = (2, 2, 1, 2) if ALL else (2, 2)
    with running(tmp_path_factory.mktemp("sharded-publish"), support.tiny_model(DEEP), sizes) as f:
        yield f


@contextmanager
def running(work: Path, model: Path, sizes: tuple[int, ...]) -> Iterator[Fleet]:
    """The fleet for ``model``: a replica taking regions at TP ``sizes[0]``, the ``WholeOnly`` one at ``sizes[1]``,
    and more taking regions at ``sizes[2:]`` where given (make sharded's TP=1 replica on NCCL, TP=2 on NIXL)."""
    from prometheus_client import CollectorRegistry

    from weightsync.channels import nccl, nixl
    from weightsync.coordinator import jobs, server
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync.coordinator.tls import ServerTls, TlsConfig
    from weightsync_inference.agent import Agent, AgentConfig
    from weightsync_inference.offline import OfflineEngine

    netns.require()
    # two CPU workers on one NUMA node (as in test_tensor_parallel): no OpenMP binding per worker
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    mp.setenv("OMP_NUM_THREADS", "1")
    # the faults follow each other: a replica whose channel failed is kept off it for 30 s at first, which would
    # leave the next test's version without it (the backoff has tests of its own)
    mp.setattr(jobs, "FAILED_CHANNEL_RETRY_S", 0.5)
    with netns.Hosts([f"rank-{r}" for r in range(RANKS)]) as hosts:
        _mint(work, hosts.bridge_address)
        tls = ServerTls(str(work / "server.crt"), str(work / "server.key"))
        config = server.ServerConfig(host=hosts.bridge_address, port=0, token=TOKEN, tls=tls, metrics_port=0)
        coordinator = server.CoordinatorServer(config, registry=CollectorRegistry()).start()
        mp.setenv(nccl.TRANSPORT_ENV, "gloo")  # the NCCL channel's code on CPU tensors, here and in the ranks
        ids = (REPLICA, WHOLE, TP1, NIXL_TP2)[: len(sizes)]
        if NIXL_TP2 in ids:  # before the engines start: their workers read with these
            mp.setenv(nixl.MEMORY_ENV, "host")
            mp.setenv("UCX_TLS", "tcp")  # the hosts share this machine's memory, which separate hosts would not
            # this host reaches the ranks' over a Linux bridge, whose interfaces UCX's TCP transport skips by default
            mp.setenv("UCX_TCP_BRIDGE_ENABLE", "y")
        engines = [
            OfflineEngine(model, CHANNELS[rid], tensor_parallel_size=tp) for rid, tp in zip(ids, sizes, strict=True)
        ]
        replicas: list[tuple[str, Any]] = [(REPLICA, engines[0]), (WHOLE, WholeOnly(engines[1]))]
        replicas += list(zip(ids[2:], engines[2:], strict=True))
        volume = work / "volume"
        volume.mkdir()
        agents, threads = [], []
        for rid, control in replicas:
            client = CoordinatorClient(coordinator.target, token=TOKEN, tls=TlsConfig(ca_file=str(work / "ca.crt")))
            channels = (CHANNELS[rid], Channel.VOLUME)
            config = AgentConfig(
                JOB, rid, channels, host=f"node-{rid}", volume=volume, update_timeout_s=TIMEOUT_S, nccl_domain="sharded"
            )
            agents.append(Agent(control, client, config))
            threads.append(threading.Thread(target=agents[-1].run, name=f"agent-{rid}", daemon=True))
            threads[-1].start()
        try:
            deadline = time.monotonic() + 60
            while not all(_registered(a.client) for a in agents) and time.monotonic() < deadline:
                time.sleep(0.1)  # each watches from its registration on
            sharded = {rid: (e, a) for (rid, e), a in zip(replicas, agents, strict=True) if rid != WHOLE}
            yield Fleet(
                hosts,
                coordinator.target,
                work / "ca.crt",
                engines[0],
                agents[0],
                sharded,
                engines[1],
                agents[1],
                work,
                model,
                volume,
            )
        finally:
            for agent in agents:
                agent.stop()
            for thread in threads:
                thread.join(30)
            for engine in engines:
                engine.close()
            coordinator.stop(0.5)
            mp.undo()


def _registered(client: Any) -> bool:
    from weightsync.errors import PermanentError

    try:
        return bool(client.lease)
    except PermanentError:
        return False


def publish(
    fleet: Fleet, name: str, steps: list[int], *extra: str, ranks: int = 2, codes: dict[int, int] | None = None
) -> list[dict[str, Any]]:
    """Run ``ranks`` trainer ranks, each on its host, publishing ``steps``; rank 0's reports. ``codes``: the exit
    status of a rank that does not exit 0 (a killed rank: minus its signal)."""
    out = fleet.work / name
    out.mkdir()
    port = _free_port()
    procs = []
    for rank in range(ranks):
        cmd = [sys.executable, "-m", "tests.integration.sharded_publish_ranks", "--coordinator", fleet.target]
        cmd += ["--ca", str(fleet.ca), "--model", str(fleet.model), "--port", str(port)]
        cmd += ["--master", fleet.hosts.address("rank-0"), "--host", fleet.hosts.address(f"rank-{rank}")]
        cmd += ["--steps", *map(str, steps), "--timeout", str(TIMEOUT_S), "--out", str(out)]
        cmd += ["--checkpoint", str(fleet.volume), *extra]
        env = {**support.env_without_proxies(), "RANK": str(rank), "WORLD_SIZE": str(ranks), "WEIGHTSYNC_TOKEN": TOKEN}
        procs.append(fleet.hosts.popen(f"rank-{rank}", cmd, cwd=ROOT, env=env))
    try:
        expected = [(codes or {}).get(r, 0) for r in range(ranks)]
        assert [p.wait(timeout=600) for p in procs] == expected
    except subprocess.TimeoutExpired:
        pytest.fail(f"the trainer ranks did not finish publishing {steps} within 600s")
    finally:
        for p in procs:
            p.kill()
    reports: list[dict[str, Any]] = json.loads((out / "rank0.json").read_text())
    return reports


def test_a_fsdp2_trainer_sends_a_tp2_replica_only_its_regions_through_the_publisher_and_agent(fleet: Fleet) -> None:
    assert_the_versions_after_the_first_move_as_regions(fleet, "run")


def assert_the_versions_after_the_first_move_as_regions(fleet: Fleet, name: str) -> None:
    """Three versions from 2 FSDP2 ranks: the first whole (no engine layout yet), the second and third as regions
    to the replicas that take them and gathered to the other, each worker receiving only its regions and then
    holding what vLLM's loader makes of the full tensors; every replica generates what transformers does. The
    third has the second's plan: its regions cross none of the hops again (the coordinator's messages, rank 0's
    round, the agent's request to its workers), each end taking the ones it kept."""
    import transformers

    first, second, third = publish(fleet, name, [1, 2, 3])
    channels = {rid: CHANNELS[rid].value for rid in (WHOLE, *fleet.sharded)}
    assert first["state"] == "READY" and first["channels"] == channels, first
    assert "regions" not in first["seconds"], "no engine layout was registered yet: the first version goes whole"
    assert second["state"] == "READY" and second["channels"] == channels, second
    assert "regions" in second["seconds"] and "stream" in second["seconds"] and second["failed"] == {}, second
    assert third["state"] == "READY" and "regions" in third["seconds"] and third["failed"] == {}, third
    for _, agent in fleet.sharded.values():  # its workers parsed v2's plan; v3's request named it only
        assert agent._workers_plan.startswith("sha256:") and agent.last_regions.version == third["version"]
    # the replica that cannot take regions got the same version the gathered way, in the same publish
    assert fleet.whole_agent.engine_layout is None and fleet.whole_agent.last_regions is None
    assert [e for e in fleet.whole_agent.events if e[0] == "assign"][-3:] == [
        ("assign", first["version"], "ok"),
        ("assign", second["version"], "ok"),
        ("assign", third["version"], "ok"),
    ]
    assert_received_only_their_regions(fleet, third["version"])
    assert_hold_what_vllms_loader_makes(fleet)
    reference = fleet.work / name / "reference-3"
    trained = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    for engine in (fleet.whole_engine, *(e for e, _ in fleet.sharded.values())):
        support.assert_generates_like(engine, trained)


@full
def test_a_4_rank_fsdp2_trainer_sends_the_replicas_only_their_regions(fleet: Fleet) -> None:
    import transformers

    # a version reaches the replicas whole first when they have registered no layout yet (this test run alone)
    steps = [5] if fleet.agent.engine_layout is not None else [4, 5]
    report = publish(fleet, "four", steps, ranks=4)[-1]
    assert report["state"] == "READY" and "regions" in report["seconds"] and report["failed"] == {}, report
    assert_received_only_their_regions(fleet, report["version"])
    reference = fleet.work / "four" / f"reference-{steps[-1]}"
    trained = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    assert_hold_what_vllms_loader_makes(fleet)
    for engine in (fleet.whole_engine, *(e for e, _ in fleet.sharded.values())):
        support.assert_generates_like(engine, trained)


def assert_hold_what_vllms_loader_makes(fleet: Fleet) -> None:
    """Every worker of a TP=2 replica that took regions holds, bit for bit, what the same worker of the gathered
    replica holds, which vLLM's own loader made of the trainer's full tensors: each parameter it computes with,
    the linear weights the CPU backend packed into its kernels read back through them (``held``)."""
    loaded = fleet.whole_engine.parameter_digests()
    assert any(name.endswith("qkv_proj.weight") for name in loaded[0]), "the packed linear weights are compared"
    for rid, (engine, _) in fleet.sharded.items():
        landed = engine.parameter_digests()
        if len(landed) == len(loaded):  # the TP=1 replica's workers hold other shapes: its tokens and digests stand
            for worker, (mine, theirs) in enumerate(zip(landed, loaded, strict=True)):
                differ = sorted(n for n in theirs if mine.get(n) != theirs[n])
                assert differ == [] and mine.keys() == theirs.keys(), (rid, worker, differ)


def assert_received_only_their_regions(fleet: Fleet, version: str) -> None:
    """Each worker of each region-taking replica received exactly the bytes its layout needs of ``version``: less
    than the table at TP=2, every region of its layout (the table's bytes, less what vLLM never reads) at TP=1."""
    for rid, (engine, agent) in fleet.sharded.items():
        received = agent.last_regions
        assert received is not None and received.version == version, (rid, received)
        table = engine.last_table()  # the table the first version brought in band
        assert table is not None
        layout = engine.engine_layout(table)
        # the layouts the coordinator took are longer than an ordinary request list may be, as real models' are
        assert len(table) > limits.MAX_ITEMS and all(len(w.params) > limits.MAX_ITEMS for w in layout.workers)
        assert sorted(received.nbytes) == list(range(len(layout.workers))), (rid, received.nbytes)
        for worker, nbytes in received.nbytes.items():
            assert nbytes == layout.workers[worker].bytes_needed(table), (rid, worker, nbytes)
            if len(layout.workers) > 1:
                assert nbytes < table.total_bytes, (rid, worker, nbytes)


@full
def test_a_byte_flipped_on_one_ranks_link_fails_the_version_naming_tensor_and_rank(fleet: Fleet) -> None:
    # a version reaches the replica whole first when it has registered no layout yet (this test run alone)
    steps = [3] if fleet.agent.engine_layout is not None else [2, 3]
    report = publish(fleet, "flip", steps, "--flip", "1")[-1]
    assert "regions" in report["seconds"] and report["state"] == "FAILED", report
    assert "from trainer rank 1 arrived with digest" in report["reason"], report["reason"]
    assert "of tensor '" in report["reason"], report["reason"]


@full
def test_a_rank_that_dies_mid_send_fails_the_version_the_torn_replicas_recover_and_the_next_version_moves(
    fleet: Fleet,
) -> None:
    """Trainer rank 1 is killed inside its sends to the first region replica: the version fails; each region replica
    whose workers had landed regions of it is torn, refuses to serve, and reloads the newest durable READY version
    (the previous one, from the sharded volume) by itself; the gathered replica, which may have loaded the version
    whole before it failed, goes back to the previous one too (told by the coordinator: no replica serves a FAILED
    version); then the next version moves as regions again, READY."""
    import transformers

    engines = {rid: e for rid, (e, _) in fleet.sharded.items()}
    everyone = fleet.sharded | {WHOLE: (fleet.whole_engine, fleet.whole_agent)}
    if fleet.agent.engine_layout is None:  # this test run alone: a first version registers the layouts
        assert publish(fleet, "before", [6])[-1]["state"] == "READY"
    previous = {rid: e.weight_version() for rid, (e, _) in everyone.items()}
    events_before = len(fleet.whole_agent.events)
    results = publish(fleet, "die", [7], "--die", "1", codes={1: -9})
    assert len(results) == 1, results
    result = results[0]
    assert result.get("state", "FAILED") == "FAILED", result
    # every replica on its previous version, whole and serving again: those left torn reloaded it, and the gathered
    # replica, whose stream from rank 0 finishes (rank 1 dies once its part in the gather is done), went back to it
    assert_serving_again(everyone, previous)
    whole = fleet.whole_agent.events[events_before:]
    if any(e[0] == "assign" and e[2] == "ok" for e in whole):
        assert ("rollback", int(previous[WHOLE]), "ok") in whole, whole
    recovered = [rid for rid, (_, a) in fleet.sharded.items() if any(e[0] == "recover" for e in a.events)]
    assert recovered, "no region replica was left torn: the rank died before any region landed"
    for rid in recovered:  # from the sharded copy by region: each worker read about its share, not the version
        engine, agent = fleet.sharded[rid]
        read, table = agent.last_read, engine.last_table()
        assert read is not None and read.version == int(previous[rid]) and table is not None, (rid, read)
        layout = engine.engine_layout(table)
        assert read.landed == {w.rank: w.bytes_needed(table) for w in layout.workers}, (rid, read)
    # the fleet moves on: the next version as regions to the region replicas and gathered to the other, READY
    report = publish(fleet, "after", [8])[-1]
    assert report["state"] == "READY" and "regions" in report["seconds"] and report["failed"] == {}, report
    assert_received_only_their_regions(fleet, report["version"])
    assert_hold_what_vllms_loader_makes(fleet)
    trained = transformers.AutoModelForCausalLM.from_pretrained(
        fleet.work / "after" / "reference-8", dtype=torch.float32
    )
    for engine in (fleet.whole_engine, *engines.values()):
        support.assert_generates_like(engine, trained)


def assert_serving_again(replicas: dict[str, tuple[Any, Any]], previous: dict[str, str]) -> None:
    """Every replica (id -> (engine, agent)) serves its ``previous`` version again within 300 s: those a failed
    version left torn reloaded it by themselves."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        states = {rid: (a.replica.state.value, e.weight_version()) for rid, (e, a) in replicas.items()}
        if states == {rid: ("serving", v) for rid, v in previous.items()}:
            return
        time.sleep(1)
    assert states == {rid: ("serving", v) for rid, v in previous.items()}, states


@full
def test_a_rank_that_dies_inside_the_gather_fails_every_replicas_update_and_each_serves_again(
    fleet: Fleet,
) -> None:
    """Trainer rank 1 killed inside the gather (its first group gathered, so rank 0 is streaming it): rank 0's stream
    to the gathered replica breaks too. That TP=2 replica's update fails through vLLM's own ``update_weights``, whose
    failure each worker records in its receipt rather than raises (``WeightsyncEngine.receive_weights``: vLLM's
    executor kept the other worker's failure queued, so its next calls read a stale reply and every later version
    failed there, or a torn one never recovered); it is refused untouched (the tiny model is one bucket of the
    stream, which never arrived) or torn, and then reloaded. A region replica whose workers had landed regions is
    torn and reloads the previous version from the sharded volume by itself (or was refused untouched, when the
    rank died before its region group formed); every replica serves the previous version, and the next version is
    READY on all."""
    engines = {rid: e for rid, (e, _) in fleet.sharded.items()} | {WHOLE: fleet.whole_engine}
    agents = {rid: a for rid, (_, a) in fleet.sharded.items()} | {WHOLE: fleet.whole_agent}
    if fleet.agent.engine_layout is None:  # this test run alone: a first version registers the layouts
        assert publish(fleet, "before-gather", [9])[-1]["state"] == "READY"
    previous = {rid: e.weight_version() for rid, e in engines.items()}
    events_before = len(fleet.whole_agent.events)
    results = publish(fleet, "die-gather", [10], "--die-in-gather", "1", codes={1: -9})
    assert len(results) == 1 and results[0].get("state", "FAILED") == "FAILED", results
    assert_serving_again({rid: (e, agents[rid]) for rid, e in engines.items()}, previous)
    hit = [e for e in fleet.whole_agent.events[events_before:] if e[0] == "assign"]
    assert hit and hit[-1][2].startswith("failed"), hit  # the gathered replica's stream broke too
    report = publish(fleet, "after-gather", [11])[-1]
    assert report["state"] == "READY" and report["failed"] == {}, report
    assert_hold_what_vllms_loader_makes(fleet)
