r"""Regions where trainer ranks and workers share GPUs: CUDA IPC (``weightsync.channels.ipc_regions``) on one GPU, IPC
beside NCCL links on two, against raw baselines of the same bytes.

    bash tools/gpu-host.sh python3 bench/ipc_regions_gpu.py --json out.json            # the test job and Qwen3-1.7B
    bash tools/gpu-host.sh python3 bench/ipc_regions_gpu.py --model qwen3-1.7b --reps 9
    bash tools/gpu-host.sh python3 bench/ipc_regions_gpu.py --gpus 2 --model qwen3-1.7b --model qwen3-8b \
        --reps 9 --json out.json

Four processes: 2 trainer ranks holding FSDP2 ``Shard(0)`` shards, then a TP=2 replica's 2 workers. ``--gpus 1``:
all on GPU 0, every link co-located. ``--gpus 2`` (issue 24's 2-GPU row): process ``i`` on GPU ``i % 2``, so trainer
rank ``i`` and worker ``i`` on GPU ``i``. The regions move through the product's ends as the coordinator plans them
(process 0 registers both ends with a coordinator core, the GPU UUIDs every process posts, ``channels.gpu.uuid``,
and opens a version; the others take its rendezvous and copied links from the store): ``region_sends.send_to`` on
the ranks, ``sharded.walk`` on the workers, their groups and IPC ends kept across the repetitions. With 2 GPUs every
process sees both, so the plan copies every link by CUDA IPC (``sharded``); for workers that report only their own
GPU (``wired``) it copies (0, 0) and (1, 1) and sends the crossing (0, 1) and (1, 0) over a group per trainer rank
(``region_groups.rank_groups``: here one 2-rank NCCL communicator each, the rank and the worker on the other GPU:
NCCL refuses two ranks of one communicator on one GPU, so there is no group of all four). The raw modes use 2-rank
groups of their own for the same pairs, bare NCCL backends (no default group holds them, so ``dist.*`` functions,
which look groups up in it, are not used): called by their own methods (``send``, ``recv``, ``broadcast``,
``_allgather_base``), as ``regions`` and ``channels/nccl.py`` call theirs. Jobs (``--model``): ``job`` (the test's
seeded job, a few hundred KB), ``qwen3-1.7b``, ``qwen3-8b`` (checkpoint tensors, seeded bf16 values, the TP=2 engine
layout vLLM's loaders recorded: ``bench/sharded_gpu.py``'s job). Per repetition, each mode is timed from a store
barrier of all four (each CUDA-synchronised) to the last process's CUDA-synchronised end, clock
``time.perf_counter`` (one monotonic clock on the host). The modes, with ``--gpus 1``:

- ``ipc``: each rank publishes its shards (exports reused after the first round) and its links' digest words
  (computed on the device), each worker walks its regions (``sharded.walk``: ``regions.receive`` with IPC links
  and the worker's parameters as its ``Places``, as the product's ``Landing`` gives them: each region copied from
  the rank's shard straight into its box of its parameter and digested there, checked on the device); the ranks
  wait for the workers' done (``release``, inside ``send_to``);
- ``buckets``: the same with every region copied into the walk's buckets (default bucket) and landed from there
  (one ``copy_`` each into its sliced parameter), as before the walk took places;
- ``walk``: the same without the landing copies (what the channel costs alone);
- ``raw``: each worker one flat device-to-device copy of as many bytes as its regions hold (the floor: the same
  bytes read and written once), the two workers at once (``bound`` with no crossing link).

With ``--gpus 2``:

- ``sharded``: ``ipc`` through the product's plan for workers that see both GPUs (each reports the GPUs it reads,
  ``gpu.peers``, as the agent does): every link copied by CUDA IPC, the crossing ones read from the other GPU by
  the copy engines (``peer_copies``), no group, landed likewise;
- ``wired``: the plan for workers that see only their own GPU: the co-located links by IPC, the crossing ones as
  buckets over their rank's group (one 2-rank NCCL group each), in the same walk of the same version, landed
  likewise (a membership of its own; checked bit-exact in round 0 too);
- ``buckets``: ``sharded`` with every region through the walk's buckets, landed from there;
- ``walk``: the same without the landing copies;
- ``gathered``: today's path before any overhead, raw NCCL: the ranks all-gather the table's bytes as one flat
  uint8 buffer, half from each (one ``_allgather_base`` on a 2-rank NCCL group of the ranks: one launch, where
  FSDP2 gathers per layer group), then rank 0 broadcasts all of them to worker 1 over their pair's group. Worker 0
  shares rank 0's GPU; its copy is not counted (optimistic for the baseline). The bytes are not the table's
  values and are not checked. The all-gather (to the ranks' CUDA-synchronised mark after it) and the broadcast
  (from that mark to the end) are reported apart;
- ``nixl`` (with ``--nixl``): the replica as the coordinator plans it on NIXL, every link, co-located or crossing,
  read by its worker (``send_to``/``walk`` with the NIXL rendezvous, ``nixl_regions``: each rank registers its
  shards once and packs strided regions into a staging buffer per link, each worker reads its regions out of both
  ranks' GPU memory, one READ per bucket), checked and landed as in ``sharded``; in round 0 the workers' parameters
  are zeroed before it and checked bit-exact after it;
- ``bound``: the link bound of the same run, raw: at once, each crossing link moves the bytes the plan puts on it
  (one NCCL ``send``/``recv`` over the same pair group, both crossing links at once) and each worker makes one flat
  device copy of as many bytes as its co-located link carries (its own buffers); the slowest link sets the time.
  Two processes' kernels on one GPU time-slice (no MPS): rank 0's send, worker 0's receive and its copy share GPU 0
  here as they do in ``wired``;
- ``pulled``: the link bound of ``sharded``'s plan, raw: each worker reads its crossing links' bytes from the other
  GPU (a buffer of its own there) by one copy-engine copy, beside one flat device copy of its co-located link's
  bytes.

Round 0 is a warm-up (each NCCL communicator is formed by its first call there), and in it each worker checks its
parameters after ``ipc``/``sharded`` bit-exact against the full tensors. Printed: the plan's bytes per link (near:
IPC, far: NCCL), per worker bytes received (the walk's tally, both kinds of link) / bytes its layout needs, the
median of each mode with its ratios to the baselines of the run (``raw``; ``bound``, ``pulled`` and ``gathered``),
and for ``sharded``, ``wired`` and ``walk`` when each process reached each step (the ranks: shared (their
``send_to`` returned, its reading workers done); the workers: first region yielded; all: end). ``--json`` writes the
summaries, every sample in; ``--mode`` runs some modes only; ``--trace DIR`` profiles each mode's last repetition (a
Chrome trace per process); ``--host-profile DIR`` profiles its Python (cProfile, per process).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import datetime
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightsync.channels import gpu, peer_copies, region_groups, regions, wire
from weightsync.channels.base import Endpoint, Rendezvous
from weightsync.channels.wire import TORCH_DTYPES, dist
from weightsync.sharding import links, plans
from weightsync.sharding.fills import WHOLE
from weightsync.vocabulary import Channel
from weightsync_inference import sharded as sharded_updates
from weightsync_inference.receipts import Identity, read_by_every
from weightsync_trainer import region_sends

ROOT = Path(__file__).resolve().parents[1]
RANKS, TP = 2, 2
MODELS = ("job", "qwen3-1.7b", "qwen3-8b")
MODES = {
    1: ("ipc", "buckets", "walk", "raw"),
    2: ("sharded", "wired", "buckets", "walk", "gathered", "bound", "pulled"),
}
NIXL = "nixl"
"""The mode ``--nixl`` adds to either."""
CHECKED = ("wired", NIXL)
"""Modes after the first whose landing round 0 checks too (the parameters zeroed before)."""
"""Each repetition's modes by ``--gpus``, in order; the first lands the regions and is checked in round 0."""
MARKS = ("shared", "first", "gathered")
TIMEOUT_S = 300.0


def _job(model: str, device: torch.device) -> tuple[Any, Any, list[Any], Callable[[int], torch.Tensor]]:
    """(trainer layout, the TP=2 engine layout, its replica's regions in plan order, t -> full tensor t on
    ``device``: the same values in every process)."""
    if model == "job":
        sys.path.insert(0, str(ROOT))
        from tests.integration.region_ranks import job

        trainer, result, members, full = job(24, RANKS)
        on = [t.to(device) for t in full]
        return trainer, members[0].layout, list(result.replica(members[0].replica_id).regions), lambda t: on[t]
    from sharded_gpu import job as sharded_job
    from sharded_gpu import tensor

    trainer, engine, result = sharded_job(model, RANKS, TP, 1)
    return trainer, engine, list(result.replica("replica-0").regions), lambda t: tensor(trainer.table, t, device, 7)


def _planned(store: Any, idx: int, device: torch.device, trainer: Any, engine: Any, rows: list[Any]) -> tuple[Any, Any]:
    """The product's plans for the replica (``region_sends.Target``, the same for every process): process 0 registers
    the trainer (each rank's GPU UUID) and the replica (each worker's, and the GPUs every worker reads directly:
    ``receipts.read_by_every`` of what each worker reports, as the agent does) with a coordinator core and opens a
    version, as the publisher does; the region membership's rendezvous and the copied links go to the others through
    the store, as JSON. Then the same replica reporting no peers (``wired``: pods that each see their own GPU): only
    the co-located links copied, the crossing ones over a group per rank, in a membership of its own."""
    sys.path.insert(0, str(ROOT))
    from tests.integration.region_ranks import colocated_targets

    if idx < RANKS:
        store.set(f"gpu/rank{idx}", gpu.uuid(device))
    else:  # what a worker of the engine reports (``WeightsyncEngine.identity``)
        me = Identity(idx - RANKS, TP, str(device), gpu.uuid(device), peers=gpu.peers(device))
        store.set(f"gpu/worker{idx - RANKS}", json.dumps(me.to_dict()))
    if idx == 0:
        store.wait([f"gpu/rank{r}" for r in range(RANKS)] + [f"gpu/worker{w}" for w in range(TP)])
        ranks = tuple(store.get(f"gpu/rank{r}").decode() for r in range(RANKS))
        reach = [Identity.from_dict(json.loads(store.get(f"gpu/worker{w}"))) for w in range(TP)]
        workers, peers = tuple(w.gpu_uuid for w in reach), read_by_every(reach)
        targets = {}
        for name, seen in (("plan", peers), ("wired", ())):
            (t,) = colocated_targets(store.port, trainer, engine, ranks, workers, peers=seen)
            if list(t.regions) != rows:
                raise SystemExit("the coordinator's plan differs from the bench's (the same layouts must plan alike)")
            rdv = t.rendezvous if name == "plan" else dataclasses.replace(t.rendezvous, group=f"{t.rendezvous.group}-w")
            targets[name] = {"rendezvous": rdv.to_dict(), "copied": plans.links_to(t.copied)}
        store.set("plan", json.dumps(targets))
    store.wait(["plan"])
    d = json.loads(store.get("plan"))
    return tuple(  # type: ignore[return-value]
        region_sends.Target(
            "replica-0", Rendezvous.from_dict(d[k]["rendezvous"]), tuple(rows), plans.links_from(d[k]["copied"])
        )
        for k in ("plan", "wired")
    )


def _nccl(store: Any, name: str, rank: int) -> Any:
    """A 2-rank NCCL group over the job's store; its communicators are formed by their first call (round 0)."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
    return dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, 2, opts)


class _Process:
    """One of the four: its GPU, the job, its links (IPC where co-located, a pair's NCCL group otherwise), the
    buffers of the raw modes; one method per mode, each returning the bytes this process moved."""

    def __init__(self, idx: int, model: str, port: int, gpus: int) -> None:
        self.idx, self.gpus = idx, gpus
        self.device = torch.device("cuda", idx % gpus)
        torch.cuda.set_device(self.device)
        self.store = (
            wire.serve_store("127.0.0.1", port, TIMEOUT_S)
            if idx == 0
            else wire.join_store(Endpoint("127.0.0.1", port), 60.0, TIMEOUT_S, Channel.IPC)
        )
        self.trainer, engine, self.rows, self.full = _job(model, self.device)
        self.table = self.trainer.table
        self.link_bytes: dict[links.Link, int] = collections.Counter()
        for r in self.rows:
            self.link_bytes[r.rank, r.worker] += r.nbytes
        self.target, self.wired = _planned(self.store, idx, self.device, self.trainer, engine, self.rows)
        self.near = self.wired.copied  # the co-located links: the raw modes' copies
        self.kept = region_groups.Kept()  # the product's groups and IPC ends, kept across the repetitions
        self.cuts: dict[int, regions.Cuts] = {}  # a rank's region views per target, as ``RegionSends`` keeps them
        self.wired_kept = region_groups.Kept()
        self.is_rank = idx < RANKS
        me, end = (idx, 0) if self.is_rank else (idx - RANKS, 1)  # end: 0 the trainer rank's, 1 the worker's
        self.pairs = {
            link: _nccl(self.store, f"pair{link[0]}-{link[1]}", end)
            for link in sorted(set(self.link_bytes) - self.near)
            if link[end] == me
        }
        self.trainers = _nccl(self.store, "trainers", idx) if gpus == 2 and self.is_rank else None
        self.marks: dict[str, float] = {}
        # the same replica planned on NIXL: its membership of its own, every link read (nothing copied)
        rdv = dataclasses.replace(self.target.rendezvous, channel=Channel.NIXL)
        self.nixl_target = dataclasses.replace(self.target, rendezvous=rdv, copied=frozenset())
        self.nixl_kept = region_groups.Kept()
        self._step = 0
        self.needed = 0
        self.copy: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pull: tuple[torch.Tensor, torch.Tensor] | None = None
        # gathered: half of the table's bytes from each rank; rank 0 broadcasts them whole to the workers of its pairs
        total = self.table.total_bytes
        self.half = self._bytes(-(-total // 2)) if self.trainers is not None else None
        self.flat = self._bytes(2 * -(-total // 2)) if self.trainers is not None or self._fanout() else None
        # bound (and raw): each crossing link's planned bytes; each worker's co-located links' bytes, copied once
        self.wires = {link: self._bytes(self.link_bytes[link]) for link in self.pairs}
        if self.is_rank:
            self.local = [
                None if (box := self.trainer.shard(t, idx)) is None else self.full(t)[_slices(box)].clone()
                for t in range(len(self.table))
            ]
            return
        self.worker = me
        self.layout = engine.workers[me]
        specs = self.table.tensors
        self.params = [
            torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype], device=self.device) for p in self.layout.params
        ]
        self.wholes = {
            f.tensor: torch.zeros(specs[f.tensor].shape, dtype=TORCH_DTYPES[specs[f.tensor].dtype], device=self.device)
            for f in self.layout.fills
            if f.param == WHOLE
        }
        self.needed = self.layout.bytes_needed(self.table)
        near = sum(n for (r, w), n in self.link_bytes.items() if w == me and (r, w) in self.near)
        self.copy = (self._bytes(near), self._bytes(near))
        far = sum(n for (r, w), n in self.link_bytes.items() if w == me and (r, w) not in self.near)
        if far:  # pulled: the crossing links' bytes read from the other GPU by the copy engines
            other = torch.device("cuda", (self.device.index + 1) % gpus)
            self.pull = (torch.empty(far, dtype=torch.uint8, device=other).random_(256), self._bytes(far))
            self.pull[1][:16].copy_(self.pull[0][:16])  # torch enables peer access on its first copy across them

    def _bytes(self, n: int) -> torch.Tensor:
        """A buffer of ``n`` random bytes on this process's GPU (for the raw modes: what the bytes are is moot)."""
        return torch.empty(n, dtype=torch.uint8, device=self.device).random_(256)

    def _fanout(self) -> list[Any]:
        """The pair groups of rank 0 and the workers it broadcasts to in ``gathered`` (those on another GPU)."""
        return [pg for (r, _), pg in self.pairs.items() if r == 0]

    def barrier(self) -> None:
        self._step += 1
        torch.cuda.synchronize(self.device)
        self.store.set(f"b{self._step}/{self.idx}", "1")
        self.store.wait([f"b{self._step}/{i}" for i in range(RANKS + TP)])

    def run(self, mode: str, version: int) -> int:
        if mode == "wired":
            return self._product(self.wired_kept, self.wired, version, land=True, direct=True)
        if mode in ("ipc", "sharded", "buckets", "walk"):
            return self.sharded(version, land=mode != "walk", direct=mode in ("ipc", "sharded"))
        if mode == NIXL:
            return self.nixl(version)
        if mode == "pulled":
            return self.pulled()
        return self.gathered() if mode == "gathered" else self.bound()

    def pulled(self) -> int:
        """``pulled``: the link bound where the crossing links are read by their workers (``sharded``'s plan): each
        worker one copy-engine read of its crossing links' bytes from the other GPU beside one flat device copy of
        its co-located link's."""
        if self.pull is None or self.copy is None:
            return 0
        peer_copies.copy([self.pull[1]], [self.pull[0]])
        self.copy[1].copy_(self.copy[0])
        return self.pull[0].numel() + self.copy[0].numel()

    def nixl(self, version: int) -> int:
        """Every link by NIXL, as the coordinator plans a replica on NIXL (``region_sends.send_to`` on the ranks,
        ``sharded.walk`` on the workers: ``nixl_regions``), landed as in ``sharded``."""
        return self._product(self.nixl_kept, self.nixl_target, version, land=True, direct=True)

    def clear(self) -> None:
        """Zero a worker's parameters (before a mode whose landing round 0 checks)."""
        for t in [*getattr(self, "params", []), *getattr(self, "wholes", {}).values()]:
            t.zero_()

    def sharded(self, version: int, land: bool, direct: bool) -> int:
        """``ipc``/``sharded`` (``land``, ``direct``), ``buckets`` (``land``) and ``walk``: one version through the
        product's ends, each link IPC or NCCL as the plan says (``region_sends.send_to`` on the ranks,
        ``sharded.walk`` on the workers)."""
        return self._product(self.kept, self.target, version, land, direct)

    def place(self, fill: Any) -> torch.Tensor | None:
        """``regions.Places`` over this worker's parameters, as the engine's ``Landing`` gives them: a fill's box as
        a view of the region's shape (whole tensors come as pieces)."""
        if fill.param == WHOLE or self.params[fill.param].dtype != TORCH_DTYPES[self.table.tensors[fill.tensor].dtype]:
            return None
        try:
            return self.params[fill.param][_slices(fill.dest)].view(fill.source.lengths)
        except RuntimeError:
            return None

    def landed(self, fill: Any) -> None: ...

    def _product(self, kept: region_groups.Kept, t: region_sends.Target, version: int, land: bool, direct: bool) -> int:
        if self.is_rank:
            cuts = self.cuts.setdefault(id(t), regions.Cuts())
            n = region_sends.send_to(kept, t, version, self.idx, self.trainer, self.local, self.device, cuts)
            self.marks["shared"] = time.perf_counter()
            return n.nbytes
        tally = regions.Tally()
        order = sharded_updates.Order(version, t.rendezvous, t.regions, t.copied)
        places = self if direct else None
        for fill, data in sharded_updates.walk(kept, order, self.worker, self.table, tally, self.device, places):
            if "first" not in self.marks:
                torch.cuda.synchronize(self.device)
                self.marks["first"] = time.perf_counter()
            if land:
                into = self.wholes[fill.tensor] if fill.param == WHOLE else self.params[fill.param]
                into[_slices(fill.dest)].copy_(data.reshape(fill.dest.lengths))
        return tally.nbytes

    def gathered(self) -> int:
        """The ranks' all-gather (each marks ``gathered`` once it finished on the device), then rank 0's broadcast
        to each worker on another GPU."""
        moved = 0
        if self.trainers is not None and self.half is not None and self.flat is not None:
            self.trainers._allgather_base(self.flat, self.half).wait()
            torch.cuda.synchronize(self.device)
            self.marks["gathered"] = time.perf_counter()
            moved += self.half.numel()
        if self.flat is not None:
            whole = self.flat[: self.table.total_bytes]
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            for pg in self._fanout():
                pg.broadcast([whole], opts).wait()
                moved += whole.numel()
        return moved

    def bound(self) -> int:
        """``bound`` and ``raw``: each crossing link's planned bytes as one send/recv, posted first so that the
        co-located links' flat copy (on the current stream) runs beside them."""
        works = [
            pg.send([self.wires[link]], 1, 0) if self.is_rank else pg.recv([self.wires[link]], 0, 0)
            for link, pg in self.pairs.items()
        ]
        if self.copy is not None:
            self.copy[1].copy_(self.copy[0])
        for work in works:
            work.wait()
        return sum(self.link_bytes[link] for link in self.pairs) + (0 if self.copy is None else self.copy[0].numel())

    def wrong(self) -> list[str]:
        """Parameters (and whole tensors) other than the layout's fills of the full tensors make them, in order (a
        later fill may overwrite an earlier one's box: compare whole parameters, not fill by fill)."""
        if self.is_rank:
            return []
        expected = [torch.zeros_like(p) for p in self.params]
        out = []
        for f in self.layout.fills:
            if f.param == WHOLE:
                if not torch.equal(self.wholes[f.tensor], self.full(f.tensor)):
                    out.append(self.table.tensors[f.tensor].name)
            else:
                expected[f.param][_slices(f.dest)] = self.full(f.tensor)[_slices(f.source)].reshape(f.dest.lengths)
        pairs = zip(self.layout.params, self.params, expected, strict=True)
        return out + [s.name for s, a, b in pairs if not torch.equal(a, b)]

    def close(self) -> None:
        self.kept.close()  # the workers unmap before the ranks exit: a rank keeps its memory while a worker maps it
        self.wired_kept.close()
        self.nixl_kept.close()
        self.barrier()
        for pg in [*self.pairs.values(), *([self.trainers] if self.trainers is not None else [])]:
            pg.abort()
        if self.idx == 0:
            time.sleep(1.0)  # the store lives here: let the others' last wait return


def child(
    idx: int, model: str, port: int, reps: int, gpus: int, modes: tuple[str, ...], out: str, trace: str, host: str
) -> None:
    proc = _Process(idx, model, port, gpus)
    torch.cuda.synchronize(proc.device)
    samples: list[dict[str, Any]] = []
    moved: dict[str, int] = {}
    mismatches: list[str] = []
    version = 0
    for rep in range(reps + 1):
        for mode in modes:
            version += 1
            proc.marks.clear()
            if rep == 0 and mode in CHECKED:
                proc.clear()
            proc.barrier()
            # the repetition before the last too, unsaved: a profiler's first run in a process costs it ~0.8 s
            profiler = _profiler() if trace and rep >= reps - 1 else contextlib.nullcontext()
            python = cProfile.Profile() if host and rep == reps else None
            with profiler:
                start = time.perf_counter()
                if python is not None:
                    python.enable()
                n = proc.run(mode, version)
                torch.cuda.synchronize(proc.device)
                if python is not None:
                    python.disable()
                end = time.perf_counter()
            if python is not None:
                _host_profile(python, Path(host, f"{model}-{mode}-{idx}.txt"))
            if isinstance(profiler, torch.profiler.profile) and rep == reps:
                profiler.export_chrome_trace(str(Path(trace, f"{model}-{mode}-{idx}.json")))
            if rep == 0:
                moved[mode] = n
                if mode == modes[0]:
                    mismatches = proc.wrong()
                elif mode in CHECKED:
                    mismatches += [f"{mode}: {name}" for name in proc.wrong()]
            else:
                samples.append({"mode": mode, "start": start, "end": end, **proc.marks})
    report = {
        "idx": idx, "needed": proc.needed, "moved": moved, "wrong": mismatches, "samples": samples,
        "table_bytes": proc.table.total_bytes, "near": sorted(proc.near),
        "links": {f"{r}->{w}": n for (r, w), n in sorted(proc.link_bytes.items())},
    }  # fmt: skip
    Path(out, f"{idx}.json").write_text(json.dumps(report))
    proc.close()


def _host_profile(python: cProfile.Profile, path: Path) -> None:
    """The host's time by function (its own time, then with what it calls), the 40 largest of each."""
    text = io.StringIO()
    stats = pstats.Stats(python, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    path.write_text(text.getvalue())


def _profiler() -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    return torch.profiler.profile(activities=activities)


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths, strict=True))


def run_one(
    model: str, reps: int, port: int, gpus: int, modes: tuple[str, ...], trace: str = "", host: str = ""
) -> dict[str, Any]:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        args = (model, port, reps, gpus, modes, out, trace, host)
        procs = [ctx.Process(target=child, args=(i, *args)) for i in range(RANKS + TP)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
        for p in procs:
            if p.is_alive():
                p.kill()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"{model}: a process failed: exit codes {[p.exitcode for p in procs]}")
        reports = [json.loads(Path(out, f"{i}.json").read_text()) for i in range(RANKS + TP)]
    return summarise(model, gpus, reports, modes)


def summarise(model: str, gpus: int, reports: list[dict[str, Any]], modes: tuple[str, ...]) -> dict[str, Any]:
    """Each mode's times (from the first start to the last end), the marks as ms from the first start, and the
    ratios; printed and returned."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    phases: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
    split: dict[str, list[float]] = {"all_gather": [], "broadcast": []}
    for k in range(len(reports[0]["samples"])):
        rows = [r["samples"][k] for r in reports]
        mode, t0, t1 = rows[0]["mode"], min(r["start"] for r in rows), max(r["end"] for r in rows)
        times[mode].append(t1 - t0)
        for i, r in enumerate(rows):
            for mark in (*MARKS, "end"):
                if mark in r:
                    phases[mode].setdefault(f"{i}:{mark}", []).append((r[mark] - t0) * 1e3)
        if mode == "gathered":
            gathered = max(r["gathered"] for r in rows if "gathered" in r)
            split["all_gather"].append(gathered - t0)
            split["broadcast"].append(t1 - gathered)
    workers = reports[RANKS:]
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    needed = sum(w["needed"] for w in workers)
    near = {f"{r}->{w}" for r, w in reports[0]["near"]}
    land = modes[0]
    summary: dict[str, Any] = {
        "model": model,
        "gpus": gpus,
        "table_bytes": reports[0]["table_bytes"],
        "bytes": needed,
        "links": {k: {"bytes": n, "near": k in near} for k, n in reports[0]["links"].items()},
        "per_worker": [f"{w['moved'][land]}/{w['needed']}" for w in workers],
        "exact": all(
            w["wrong"] == [] and all(w["moved"][m] == w["needed"] for m in (land, *CHECKED) if m in modes)
            for w in workers
        ),
        "moved": [r["moved"] for r in reports],
        "median_ms": med,
        "samples_ms": {m: [x * 1e3 for x in v] for m, v in times.items()},
        "phases_ms": {m: {k: statistics.median(v) for k, v in sorted(p.items())} for m, p in phases.items()},
    }
    print(
        f"{model} on {gpus} GPU(s): {needed / 1e9:.4f} GB to 2 workers ({', '.join(summary['per_worker'])} bytes), "
        f"bit-exact {summary['exact']}",
        flush=True,
    )
    where = (
        f"{k} {'near, IPC' if v['near'] else 'far, NCCL'} {v['bytes'] / 1e6:.1f} MB"
        for k, v in summary["links"].items()
    )
    print(f"  the plan's bytes per link (rank->worker): {'; '.join(where)}", flush=True)
    print("  " + ", ".join(f"{m} {v:.3f} ms" for m, v in med.items()), flush=True)
    base = [b for b in ("raw", "bound", "pulled", "gathered") if b in med]
    summary["ratios"] = {f"{m} / {b}": med[m] / med[b] for m in med if m not in base for b in base}
    if "gathered" in med:
        summary["gathered_ms"] = g = {k: statistics.median(v) * 1e3 for k, v in split.items()}
        print(f"  gathered: all-gather {g['all_gather']:.3f} + broadcast {g['broadcast']:.3f} ms", flush=True)
    print("  " + ", ".join(f"{k} {v:.2f}" for k, v in summary["ratios"].items()), flush=True)
    for m in ("sharded", "wired", "walk"):
        if m in phases:
            marks = {k: round(v, 2) for k, v in summary["phases_ms"][m].items()}
            print(f"  {m}, ms from the barrier (process 0-1 ranks, 2-3 workers):", marks, flush=True)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(
        description="\n\n".join(__doc__.split("\n\n")[:2]) + "\n\nThe module docstring says what each mode times.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", action="append", choices=MODELS, help="repeatable (default: job and qwen3-1.7b)")
    p.add_argument(
        "--gpus",
        type=int,
        choices=sorted(MODES),
        default=1,
        help="1: all four processes on GPU 0, every link by IPC; modes ipc, buckets, walk, raw. 2: trainer rank i and "
        "worker i on GPU i, the crossing links over NCCL; modes sharded, buckets, walk, gathered, bound "
        "(default 1)",
    )
    p.add_argument("--reps", type=int, default=7, help="timed repetitions after the warm-up round (default 7)")
    p.add_argument(
        "--port", type=int, default=29660, help="the first model's store port, + 1 per model (default 29660)"
    )
    p.add_argument("--json", default="", help="write the summaries (every sample) to this file")
    p.add_argument(
        "--trace",
        default="",
        help="profile each mode's last repetition (torch.profiler, CPU and CUDA): a Chrome trace per process, "
        "<model>-<mode>-<process>.json, in this folder (the profiler's cost is in that repetition's time)",
    )
    p.add_argument(
        "--host-profile",
        default="",
        help="profile each mode's last repetition's Python (cProfile, which slows it): the 40 functions with the "
        "most time of their own and with their callees, per process, <model>-<mode>-<process>.txt in this folder",
    )
    p.add_argument("--mode", action="append", help="only these modes (repeatable; default: every mode of --gpus)")
    p.add_argument("--nixl", action="store_true", help="add the nixl mode (every link by NIXL; needs nixl importable)")
    args = p.parse_args()
    modes = MODES[args.gpus] + ((NIXL,) if args.nixl else ())
    if args.mode:
        unknown = sorted(set(args.mode) - set(modes))
        if unknown:
            raise SystemExit(f"--mode {', '.join(unknown)}: not a mode of --gpus {args.gpus} (its modes: {modes})")
        modes = tuple(m for m in modes if m in args.mode)
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: this host has {torch.cuda.device_count()} GPU(s)")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(args.gpus))
    print(f"devices: {names}, torch {torch.__version__}", flush=True)
    models = args.model or ["job", "qwen3-1.7b"]
    for folder in (args.trace, args.host_profile):
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
    got = [
        run_one(m, args.reps, args.port + i, args.gpus, modes, args.trace, args.host_profile)
        for i, m in enumerate(models)
    ]
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
