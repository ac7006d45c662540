"""One process of a region transfer over real gloo groups: ``python -m tests.integration.region_ranks``.

Every process builds the same seeded job (``--seed``): a table of layer-like tensors, a trainer of ``--ranks``
ranks each holding its FSDP2 shard (``Shard(0)`` on a 1-D mesh), and replicas ``tp2`` (2 workers) and ``tp1``
whose workers keep the tensors the ways vLLM keeps them (column, row, fused rows, padded, whole to the loader,
experts: ``tests.unit.sharding_cases.random_replica``), and plans it. Groups: one per replica over the test's
store, the trainer's ranks first. ``--role trainer --rank R`` sends R's regions replica by replica from its
local shards only (``weightsync.channels.regions.send``); ``--role worker --replica ID --worker W`` receives
its regions and writes them where its layout says, into plain tensors, then compares each parameter with the
full tensors. Each writes JSON to ``--out/<name>.json`` (nothing pickled): bytes, digests, or the error.

``--transport nixl`` moves every link by NIXL instead (``weightsync.channels.nixl_regions``, no groups): each rank
registers its shards and publishes them per replica (a prefix of the store each), each worker reads its regions
out of every rank's shards.

Faults: ``--flip R`` makes rank R's link to ``tp2`` corrupt the first byte of its second bucket on the way (a region's
payload; the wire is wrapped: a flipped bit that TCP lets through cannot be caused for real; over NIXL, worker 0 of
``tp2`` flips the first byte of the first bucket it read from rank R, for the same reason); ``--die R`` makes rank R
exit hard after its third bucket (over NIXL: once its shards are placed for ``tp2``, before its digest words).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
from pathlib import Path
from typing import Any

REPLICAS = {"tp2": 2, "tp1": 1}
TIMEOUT_S = 30.0
BUCKET = 4096
"""Bytes per bucket here (``regions.BUCKET`` is 64 MiB): the job's regions (hundreds of bytes to 32 KiB) then take
many buckets and rounds per link, some alone, some packed together: the cuts the real size has."""


def job(seed: int, ranks: int) -> tuple[Any, Any, list[Any], list[Any]]:
    """(trainer layout, plan, members, full tensors): the same in every process."""
    import torch

    from tests.unit.sharding_cases import random_replica
    from weightsync.sharding.plans import Member, plan
    from weightsync.sharding.shards import Mesh, Placement, TrainerLayout
    from weightsync.tensors import TensorTable

    rng = random.Random(seed)
    shapes = [(96, 64), (64,), (160, 64), (64, 96), (7, 5), (256, 64)]
    table = TensorTable.build(
        [[(f"layers.{g}.t{i}", rng.choice(["bfloat16", "float32"]), s) for i, s in enumerate(shapes)] for g in range(3)]
    )
    trainer = TrainerLayout(
        table, ranks, (Mesh((ranks,), tuple(range(ranks))),), tuple(Placement(0, (0,)) for _ in table)
    )
    members = [Member(rid, random_replica(rng, table, n)) for rid, n in REPLICAS.items()]
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(s.shape, generator=gen).to(getattr(torch, s.dtype)) for s in table]
    return trainer, plan(trainer, members), members, full


def outcome(out: Path, procs: list[Any]) -> dict[str, Any]:
    """Wait for the job's processes (bounded; killed whatever happens), then what each wrote to ``out`` by name,
    and their exit statuses under ``codes``."""
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    got: dict[str, Any] = {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}
    got["codes"] = {"codes": codes}
    return got


def assert_exact(out: dict[str, Any], ranks: int) -> None:
    """What every run of the job without faults shows (``out``: each process's JSON by name): every worker's
    parameters equal the full tensors where its layout says, it got exactly its regions' bytes, the ranks' and the
    workers' per-region digests combine alike, and neither TP=2 worker got the whole table."""
    from weightsync.channels import regions

    trainer, result, _, _ = job(24, ranks)
    for rid, n in REPLICAS.items():
        rp = result.replica(rid)
        assert rp.sharded and rp.regions
        for w in range(n):
            got = out[f"{rid}-w{w}"]
            assert "error" not in got and got["wrong"] == [], got
            assert got["nbytes"] == got["needed"] == sum(r.nbytes for r in rp.receives(w))
        by_rank = {r: out[f"rank{r}"]["digests"][rid] for r in range(ranks)}
        by_worker = {w: out[f"{rid}-w{w}"]["digests"] for w in range(n)}
        sent = regions.combine(rp.regions, by_rank, regions.rank_of)
        assert sent == regions.combine(rp.regions, by_worker, regions.worker_of)
    tp2 = [out[f"tp2-w{w}"]["nbytes"] for w in range(2)]
    assert all(0 < n < trainer.table.total_bytes for n in tp2)


def colocated_targets(
    port: int,
    trainer: Any,
    engine: Any,
    ranks: tuple[str, ...],
    workers: tuple[str, ...],
    versions: int = 1,
    peers: tuple[str, ...] = (),
) -> list[Any]:
    """What a coordinator core plans for one replica of ``engine`` whose workers run on GPUs ``workers`` beside
    ``trainer``'s ranks on ``ranks`` (GPU UUIDs; one host, one NCCL domain, the replica receives IPC; its workers
    read the GPUs ``peers`` directly, ``Capabilities.peer_gpu_uuids``), the NCCL rendezvous on
    127.0.0.1:``port``: the ranks' ``region_sends.Target`` of each of ``versions`` versions, as the publisher takes
    them (the GPU tests and ``bench/ipc_regions_gpu.py``)."""
    import dataclasses

    from weightsync.channels.base import Endpoint, Offer
    from weightsync.coordinator.clock import ManualClock
    from weightsync.coordinator.core import Coordinator
    from weightsync.coordinator.models import Capabilities, EngineKind, Role, summarize
    from weightsync.coordinator.store import MemoryStore
    from weightsync.vocabulary import Channel
    from weightsync_trainer import region_sends

    on = Capabilities(host="h", nccl_domain="d", engine=EngineKind.GPU)
    caps = dataclasses.replace(on, gpu_uuids=ranks[:1], channels=(Channel.NCCL,), rank_gpu_uuids=ranks)
    replica = dataclasses.replace(
        on, gpu_uuids=workers, devices=len(workers), channels=(Channel.IPC, Channel.NCCL), peer_gpu_uuids=peers
    )
    core = Coordinator(lease_ttl_s=3600.0, store=MemoryStore(), clock=ManualClock())
    offer = Offer(Channel.NCCL, Endpoint("127.0.0.1", port))
    lease = core.register("job", Role.TRAINER, "t", "t1", caps, offers=(offer,), layout=trainer).lease_id
    core.register("job", Role.REPLICA, "replica-0", "i0", replica, layout=engine)
    out = []
    for v in range(1, versions + 1):
        (t,) = region_sends.targets(core.open_version(lease, "job", "t1", v, summarize(trainer.table, True)))
        out.append(t)
    return out


def main() -> None:
    import torch
    import torch.distributed as dist

    from weightsync.channels import nixl_regions, regions
    from weightsync.sharding.fills import WHOLE

    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["trainer", "worker"], required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--replica", default="")
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seed", type=int, default=24)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--flip", type=int, default=-1)
    p.add_argument("--die", type=int, default=-1)
    p.add_argument("--out", required=True)
    p.add_argument("--transport", choices=["gloo", "nixl"], default="gloo")
    p.add_argument("--store-host", default="127.0.0.1")
    args = p.parse_args()
    trainer, result, members, full = job(args.seed, args.ranks)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(args.store_host, args.port, is_master=False, timeout=timeout)
    nixl = args.transport == "nixl"

    def group(rid: str, rank: int) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(dist.PrefixStore(rid, store), rank, args.ranks + REPLICAS[rid], opts)

    report: dict[str, Any] = {}
    if args.role == "trainer":
        name = f"rank{args.rank}"
        local = []
        for t in range(len(trainer.table)):
            box = trainer.shard(t, args.rank)
            local.append(None if box is None else full[t][_slices(box)].clone())
        report = {"digests": {}, "nbytes": {}}
        if nixl:
            for rid, n in REPLICAS.items():
                exporter = nixl_regions.Exporter(dist.PrefixStore(rid, store), args.rank, TIMEOUT_S)
                exporter.publish(1, trainer, local)
                if args.rank == args.die and rid == "tp2":
                    os._exit(3)
                mine = [r for r in result.replica(rid).regions if r.rank == args.rank]
                tally = regions.send(
                    None, trainer, args.rank, local, mine, links={w: exporter.link(w) for w in range(n)}
                )
                exporter.release(2 * TIMEOUT_S)  # past the workers' own wait for a rank that died
                report["digests"][rid], report["nbytes"][rid] = tally.digests, tally.nbytes
            Path(args.out, f"rank{args.rank}.json").write_text(json.dumps(report))
            return
        groups = {rid: group(rid, args.rank) for rid in REPLICAS}  # every group formed before any sends
        for rid, pg in groups.items():
            mine = [r for r in result.replica(rid).regions if r.rank == args.rank]
            link = Faulty(pg, args.rank == args.flip and rid == "tp2", args.rank == args.die)
            try:
                tally = regions.send(link, trainer, args.rank, local, mine, bucket=BUCKET)
            except Exception as e:  # noqa: BLE001 - written for the test to read; a fault stays with its replica
                report.setdefault("errors", {})[rid] = f"{type(e).__name__}: {e}"
                continue
            report["digests"][rid], report["nbytes"][rid] = tally.digests, tally.nbytes
    else:
        name = f"{args.replica}-w{args.worker}"
        pg, links = None, None
        if nixl:
            importer = nixl_regions.Importer(dist.PrefixStore(args.replica, store), args.worker, "cpu", TIMEOUT_S)
            if args.flip >= 0 and args.replica == "tp2" and args.worker == 0:
                FlipFirstRead(importer.reader, args.flip)
            links = {r: importer.link(1, r, trainer.table) for r in range(args.ranks)}
        else:
            pg = group(args.replica, args.ranks + args.worker)
        layout = next(m.layout for m in members if m.replica_id == args.replica).workers[args.worker]
        table = trainer.table
        params = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in layout.params]
        wholes: dict[int, torch.Tensor] = {}
        tally = regions.Tally()
        try:
            for fill, data in regions.receive(
                pg,
                args.ranks,
                args.worker,
                table,
                result.replica(args.replica).regions,
                tally,
                bucket=BUCKET,
                links=links,
            ):
                if fill.param == WHOLE:
                    target = wholes.setdefault(
                        fill.tensor, torch.zeros(table.tensors[fill.tensor].shape, dtype=data.dtype)
                    )
                else:
                    target = params[fill.param]
                target[_slices(fill.dest)] = data.reshape(fill.dest.lengths)
        except Exception as e:  # noqa: BLE001 - written for the test to read
            report["error"] = f"{type(e).__name__}: {e}"
        wrong = []
        expected = [torch.zeros_like(t) for t in params]
        for f in layout.fills:
            src = full[f.tensor][_slices(f.source)]
            if f.param == WHOLE:
                if not torch.equal(wholes.get(f.tensor, torch.empty(0)), full[f.tensor]):
                    wrong.append(table.tensors[f.tensor].name)
            else:
                expected[f.param][_slices(f.dest)] = src.reshape(f.dest.lengths)
        wrong += [
            s.name for s, got, want in zip(layout.params, params, expected, strict=True) if not torch.equal(got, want)
        ]
        report.update(
            digests=tally.digests, nbytes=tally.nbytes, needed=layout.bytes_needed(table), wrong=wrong,
            regions=len(result.replica(args.replica).receives(args.worker)),
        )  # fmt: skip
    Path(args.out, f"{name}.json").write_text(json.dumps(report))


class FlipFirstRead:
    """A worker's NIXL reads as they land, the first byte of the first bucket read from ``rank`` flipped."""

    def __init__(self, reader: Any, rank: int) -> None:
        self.rank, self.first, self.flipped = rank, None, False
        self.read, self.wait = reader.read, reader.wait
        reader.read, reader.wait = self._read, self._wait

    def _read(self, rank: int, first: int, pieces: Any, shared: Any) -> None:
        if rank == self.rank and self.first is None:
            self.first = pieces[0][3]
        self.read(rank, first, pieces, shared)

    def _wait(self, rank: int, timeout_s: float) -> None:
        self.wait(rank, timeout_s)
        if rank == self.rank and self.first is not None and not self.flipped:
            self.first[0] ^= 0x10
            self.flipped = True


class Faulty:
    """The group as the rank sees it; for ``flip`` a link that corrupts the first byte of its second bucket (its
    first region's), for ``die`` a rank that exits hard after its third bucket."""

    def __init__(self, pg: Any, flip: bool, die: bool) -> None:
        self.pg, self.flip, self.die, self.sends = pg, flip, die, 0

    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        self.sends += 1
        if self.die and self.sends == 4:  # one send per bucket (its regions, then their digest words)
            os._exit(3)
        if self.flip and self.sends == 2:
            tensors = [tensors[0].clone()]
            tensors[0][0] ^= 0x10
        return self.pg.send(tensors, dst, tag)


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


if __name__ == "__main__":
    main()
