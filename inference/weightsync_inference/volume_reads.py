"""A live engine reads a sharded volume version by region: each worker only the boxes its engine layout keeps.

The volume is written in shards by every trainer rank (format ``weightsync.volume/v2``, ``docs/sharded.md``).
A replica that recorded its engine layout of the version's table (``Agent._layout``) loads such a version
from the volume (catch-up, recovery of a torn replica, a volume plan) by region: every worker

1. reads the manifest itself and checks it against the checksum the coordinator recorded;
2. in a first call to every worker (``phase`` "check"), reads and verifies every tile its fills touch
   (``RegionReader.check``): a damaged tile or a truncated rank file fails naming file, version,
   trainer rank, tile and tensor. The agent starts the second call only when every worker's check
   passed, so a damage one worker finds leaves every worker's weights untouched (fail-stop for the
   replica, not the worker: a worker whose tiles are intact must not land beside one that refused);
3. in the second call (``phase`` "land"), inside vLLM's layerwise reload, reads its fills again (each
   tile verified again as it is read, mostly from the page cache) and lands them (``landing.Landing``,
   as the sharded stream does), computing each fill's digest where it was read; a failure from here
   on leaves the worker torn, as any in-place update does.

Every other case reads whole, as before (``why_whole`` says why): a v1 version, no recorded layout, a
layout of another table, or one that could not be recorded, an engine without the call.

The ack. A worker holding a slice cannot compute the per-tensor digests a whole load's content digest is
made of, and nothing sent it regions to compare with. So a region read acks what its workers computed
of what they read: each fill's digest (``digests.digest`` of the region as read, after its tiles were
checked against the manifest), combined over the workers in worker and fill order (``combine``), with
``AckReport.regions_read`` set. The coordinator compares it only with other replicas that read the same
version with the same engine layout (``versions._content_mismatch``), never with whole loads or the
trainer's digest, and whole loads are never compared with it.

Worker calls answer errors (``{"error": ..., "torn": ...}``) rather than raising across vLLM's
``collective_rpc``: vLLM 0.32's multiprocess executor stops reading replies at the first failed worker,
and the next call would read the other's stale failure.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.channels import manifests
from weightsync.errors import IntegrityError, PermanentError
from weightsync.sharding.fills import EngineLayout, Fill, WorkerLayout
from weightsync.tensors import TensorTable


def why_whole(
    reads_regions: bool, recorded: tuple[TensorTable, EngineLayout] | None, sharded: bool, digest: str
) -> str:
    """Why a replica loads a volume version whole ("" when it reads by region).

    ``reads_regions``: its engine has the call (``VolumeRegionControl``); ``recorded``: the table and engine layout
    it registered; ``sharded``: the version's copy is format v2; ``digest``: the version's table layout digest."""
    if not sharded:
        return "the version's volume copy is not sharded (format v1)"
    if not reads_regions:
        return "the engine cannot read regions"
    if recorded is None:
        return "the replica recorded no engine layout"
    table, layout = recorded
    if table.layout_digest() != digest:
        return "its engine layout was recorded against another table"
    if layout.unsupported:
        return f"its engine layout could not be recorded: {layout.unsupported}"
    return ""


CHECK, LAND = "check", "land"
"""The two calls of a region read: every worker checks all its tiles, then (all passed) every worker lands."""


def request(
    root: str, version: int, checksum: str, table: TensorTable, layout: EngineLayout, phase: str = CHECK
) -> dict[str, Any]:
    """The JSON a replica's workers take (``WorkerExtension.weightsync_read_regions``) for ``phase``."""
    return {
        "phase": phase,
        "root": root,
        "version": version,
        "manifest_checksum": checksum,
        "layout_digest": table.layout_digest(),
        "layouts": [w.to_dict() for w in layout.workers],
    }


def from_request(engine: Any, d: Mapping[str, Any]) -> dict[str, Any]:
    """One worker's region read (``read``) from the request; its answer."""
    worker = engine.updater.ctx.rank
    mine = next((WorkerLayout.from_dict(w) for w in d["layouts"] if int(w["rank"]) == worker), None)
    if mine is None:
        raise PermanentError(f"the request gives no layout for worker {worker}")
    version = int(d["version"])
    directory = manifests.version_dir(Path(str(d["root"])), version)
    manifest = manifests.read(directory, version, str(d["manifest_checksum"]))
    if manifest.table.layout_digest() != d["layout_digest"]:
        raise IntegrityError(
            f"{directory}: version {version}'s table has layout digest {manifest.table.layout_digest()}; the "
            f"replica's layout was recorded against {d['layout_digest']}"
        )
    phase = str(d.get("phase", ""))
    if phase == CHECK:
        return check(engine, directory, manifest, mine)
    if phase == LAND:
        return read(engine, directory, manifest, mine)
    raise PermanentError(f"phase {phase!r} of a region read; expected {CHECK!r} or {LAND!r}")


def check(engine: Any, directory: Path, manifest: manifests.Manifest, layout: WorkerLayout) -> dict[str, Any]:
    """Verify every tile this worker's fills touch, changing nothing (the first call of a region read)."""
    from weightsync.channels.volume_regions import RegionReader

    worker, table = engine.updater.ctx.rank, manifest.table
    layout.check(table)
    engine.updater.model.check(table)  # refuses a table the model would not load, having changed nothing
    reader = RegionReader(directory, manifest)
    t0 = time.perf_counter()
    try:
        reader.check(layout.fills)
    finally:
        reader.close()
    return {"worker": worker, "bytes_checked": reader.bytes_checked, "seconds": time.perf_counter() - t0}


def read(engine: Any, directory: Path, manifest: manifests.Manifest, layout: WorkerLayout) -> dict[str, Any]:
    """Read this worker's fills of a sharded version and land them in its parameters (the second call, once
    every worker's ``check`` passed); what it read and landed."""
    from weightsync.channels import digests
    from weightsync.channels.volume_regions import RegionReader
    from weightsync.vocabulary import Channel, SyncPhase
    from weightsync_inference import sharded
    from weightsync_inference.receipts import Receipt

    worker, table = engine.updater.ctx.rank, manifest.table
    reader = RegionReader(directory, manifest)
    found: list[str] = []

    def digested() -> Iterator[tuple[Fill, Any]]:
        for fill, data in reader.fills(layout.fills):
            found.append(digests.digest(data))
            yield fill, data

    t0 = time.perf_counter()
    try:
        landed = sharded.land(engine, layout, table, lambda _: digested())
    finally:
        reader.close()
    seconds = {SyncPhase.LOAD: time.perf_counter() - t0}
    receipt = Receipt(manifest.version, Channel.VOLUME, layout_digest=table.layout_digest(), seconds=seconds)
    engine.updater.record(receipt)
    return {
        "worker": worker,
        "layout_digest": table.layout_digest(),
        "bytes_read": reader.bytes_read,
        "landed": landed,
        "digests": found,
        "seconds": seconds[SyncPhase.LOAD],
    }


def answer(engine: Any, request_json: Mapping[str, Any]) -> dict[str, Any]:
    """``from_request``, with a failure answered (``{"error", "torn"}``) rather than raised across vLLM's call.

    A failed land is the worker's last update (its receipt says so, torn); a failed check changed nothing and
    leaves the receipt of the update before (the workers whose check passed keep theirs: one version to merge)."""
    from weightsync.vocabulary import Channel
    from weightsync_inference.receipts import Receipt

    updater = engine.updater
    try:
        return from_request(engine, request_json)
    except Exception as e:  # noqa: BLE001 - answered: vLLM's executor keeps a raised failure queued
        error = f"worker {updater.ctx.rank}: {e}"
        if request_json.get("phase") == LAND:
            version = int(request_json.get("version", 0))
            updater.record(Receipt(version, Channel.VOLUME, ok=False, torn=bool(updater.torn), error=error))
        return {"error": error, "torn": bool(updater.torn)}


@dataclass(frozen=True)
class RegionsRead:
    """One version read by region from the volume, by the workers' own account."""

    version: int
    bytes_checked: dict[int, int]
    """Worker -> bytes it read from the rank files to check them before any landed (the tiles its fills touch)."""
    bytes_read: dict[int, int]
    """Worker -> bytes it read from the rank files to land (the same tiles, verified again)."""
    landed: dict[int, int]
    """Worker -> bytes it landed (exactly its layout's ``bytes_needed``)."""
    content_digest: str
    """The workers' fill digests combined (``combine``): what the replica acks, with ``regions_read``."""


def combine(layout: EngineLayout, lists: Mapping[int, Sequence[str]]) -> str:
    """One digest over every worker's fills, in worker and fill order, each with the digest its worker computed of
    what it read; ``IntegrityError`` when a worker reports another number of digests than its fills."""
    h = hashlib.sha256()
    for w in layout.workers:
        own = lists.get(w.rank, ())
        if len(own) != len(w.fills):
            raise IntegrityError(f"worker {w.rank} reported {len(own)} fill digests; its layout has {len(w.fills)}")
        for f, d in zip(w.fills, own, strict=True):
            h.update(f"{w.rank}:{f.tensor}:{f.source}:{d}\n".encode())
    return "sha256:" + h.hexdigest()


def _failures(answers: Sequence[Mapping[str, Any]]) -> None:
    """``IntegrityError`` naming every worker's failure, if any answered one."""
    errors = [str(a["error"]) for a in answers if a.get("error")]
    if errors:
        raise IntegrityError("; ".join(errors))


def checked(answers: Sequence[Mapping[str, Any]]) -> dict[int, int]:
    """The workers' answers to the check call: bytes each checked; ``IntegrityError`` naming every failure (then
    no worker lands a byte)."""
    _failures(answers)
    return {int(a["worker"]): int(a["bytes_checked"]) for a in answers}


def regions_read(
    version: int,
    table: TensorTable,
    layout: EngineLayout,
    answers: Sequence[Mapping[str, Any]],
    bytes_checked: Mapping[int, int],
) -> RegionsRead:
    """The workers' answers to the land call, checked: none failed (``IntegrityError`` naming each failure), each
    read the version's table and landed exactly what its layout needs; their digests combined."""
    _failures(answers)
    layouts = {str(a["layout_digest"]) for a in answers}
    if layouts != {table.layout_digest()}:
        raise IntegrityError(f"the workers read tables {sorted(layouts)}, not the version's")
    landed = {int(a["worker"]): int(a["landed"]) for a in answers}
    need = {w.rank: w.bytes_needed(table) for w in layout.workers}
    if landed != need:
        raise IntegrityError(f"the workers landed {landed} bytes; their layouts need {need}")
    digests = {int(a["worker"]): [str(d) for d in a["digests"]] for a in answers}
    read = {int(a["worker"]): int(a["bytes_read"]) for a in answers}
    return RegionsRead(version, dict(bytes_checked), read, landed, combine(layout, digests))


__all__ = [
    "CHECK",
    "LAND",
    "RegionsRead",
    "answer",
    "check",
    "checked",
    "combine",
    "from_request",
    "read",
    "regions_read",
    "request",
    "why_whole",
]
