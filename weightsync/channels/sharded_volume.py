"""The sharded checkpoint volume: every trainer rank writes its own shards, every reader reads only its regions.

Writing (``ShardedVolumeWriter.write``, collective over the trainer's ranks)::

    rank 0 broadcasts (version, step, nonce)        # the other ranks do not talk to the coordinator
    every rank writes rank-NNNNN.safetensors         # its pieces, tile by tile, into .tmp-vNNNNNNNN-<nonce>/
    every rank fsyncs it and reports (JSON)          # file, bytes, sha256, pieces with their tiles' digests
    rank 0 checks every reported file at ITS path    # the volume must be shared: a rank's own disk is refused
    rank 0 writes manifest.json last, renames       # atomic: a reader sees the whole version or none
    rank 0 broadcasts the outcome                    # every rank returns the same result, or raises the same error

A rank writes a box only when it is the lowest rank holding it (a box replicated over
tensor parallelism is written once). The reports travel as JSON bytes in tensors over a
gloo group of the writer's own, created with the writer's timeout, so a rank that died
or hangs fails the version at every other rank after ``timeout_s`` rather than never;
nothing is pickled. Each rank names its volume root itself: the same volume may be
mounted at different paths on different hosts (each rank writes under its own root,
rank 0 finds the files under its own).

A rank file is a valid safetensors file whose entries are the tiles
(``<tensor>@<offsets>``), so ordinary tools open it; readers use the manifest's byte
offsets instead of its header. Reading is by tile (``volume_regions``, ``pieces``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from weightsync.channels import exchanges
from weightsync.channels.manifests import MANIFEST, SHARDED, TEMPORARY_PREFIX, Manifest, version_dir
from weightsync.channels.pieces import DEFAULT_TILE, TILE_DIGEST_HEX, Piece, slices, tiles
from weightsync.channels.volume import fsync
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import PermanentError
from weightsync.sharding.boxes import Box
from weightsync.sharding.shards import TrainerLayout
from weightsync.tensors import ITEMSIZE, TensorTable

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "bool": "BOOL",
}


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def tile_digest(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()[:TILE_DIGEST_HEX]


def writes(layout: TrainerLayout, rank: int) -> list[tuple[int, Box]]:
    """(tensor index, box) this rank writes, in table order: its box of each tensor, where it is the lowest rank
    holding that box."""
    out = []
    for t in range(len(layout.table)):
        box = layout.shard(t, rank)
        if box is not None and any(b == box and min(ranks) == rank for b, ranks in layout.holders(t)):
            out.append((t, box))
    return out


# ---- one rank's file ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReport:
    """What one rank wrote (or why it could not): the JSON that travels to rank 0."""

    rank: int
    file: str = ""
    nbytes: int = 0
    sha256: str = ""
    pieces: tuple[Piece, ...] = ()
    error: str = ""

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "rank": self.rank,
                "file": self.file,
                "bytes": self.nbytes,
                "sha256": self.sha256,
                "pieces": [p.to_dict() for p in self.pieces],
                "error": self.error,
            }
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RankReport:
        d = json.loads(data)
        pieces = tuple(Piece.from_dict(p) for p in d["pieces"])
        return cls(int(d["rank"]), str(d["file"]), int(d["bytes"]), str(d["sha256"]), pieces, str(d["error"]))


def write_rank(
    directory: Path,
    rank: int,
    table: TensorTable,
    boxes: list[tuple[int, Box]],
    shards: Mapping[int, torch.Tensor],
    tile: int,
) -> RankReport:
    """Write this rank's boxes (``shards[t]`` holds box ``boxes[i]`` of tensor ``t``) as one safetensors file of
    tiles under ``directory``, fsync it, and report it. Nothing to write: no file."""
    if not boxes:
        return RankReport(rank)
    header: dict[str, Any] = {"__metadata__": {"format": SHARDED, "rank": str(rank)}}
    start = 0
    for t, box in boxes:
        spec = table.tensors[t]
        local = shards.get(t)
        if local is None or tuple(local.shape) != box.lengths or local.dtype != TORCH_DTYPES[spec.dtype]:
            got = "nothing" if local is None else f"{local.dtype} {list(local.shape)}"
            raise PermanentError(
                f"rank {rank}, tensor {spec.name!r}: the layout gives this rank box {box} ({spec.dtype}), its shard "
                f"is {got}; pass each rank's local shard cast to the table's dtype"
            )
        for cell in tiles(box, tile):
            end = start + cell.numel * ITEMSIZE[spec.dtype]
            key = f"{spec.name}@{','.join(map(str, cell.offsets))}"
            header[key] = {
                "dtype": SAFETENSORS_DTYPES[spec.dtype],
                "shape": list(cell.lengths),
                "data_offsets": [start, end],
            }
            start = end
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors aligns the data to 8 bytes
    base = 8 + len(head)
    name = rank_file(rank)
    path = directory / name
    sha = hashlib.sha256()
    pieces = []
    with path.open("wb") as f:
        for chunk in (len(head).to_bytes(8, "little"), head):
            f.write(chunk)
            sha.update(chunk)
        at = base
        for t, box in boxes:
            local = shards[t].detach()
            found = []
            offset = at
            for cell in tiles(box, tile):
                data = local[slices(cell, box.offsets)].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                f.write(data)
                sha.update(data)
                found.append(tile_digest(data))
                at += len(data)
            pieces.append(Piece(t, rank, name, box, offset, tuple(found)))
        f.flush()
        os.fsync(f.fileno())
    return RankReport(rank, name, at, sha.hexdigest(), tuple(pieces))


# ---- the collective write ------------------------------------------------------------------------------------------


class ShardedVolumeWriter:
    """Writes versions of a sharded trainer to the volume: one per rank, all ranks call ``write`` together.

    Build it on every rank at once (it creates its own gloo group, a collective) after
    ``torch.distributed`` is initialised. ``root`` is this rank's path of the shared volume.
    """

    def __init__(self, root: str | os.PathLike[str], *, timeout_s: float = 300.0, tile: int = DEFAULT_TILE) -> None:
        import torch.distributed as dist

        if tile <= 0:
            raise PermanentError(f"tile {tile} must be positive (elements per dimension)")
        self.root, self.timeout_s, self.tile = Path(root), timeout_s, tile
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def write(
        self, version: int, step: int, layout: TrainerLayout, shards: Mapping[int, torch.Tensor]
    ) -> Manifest | None:
        """Write ``version`` (rank 0's value counts; 0 on rank 0: nothing to write, every rank returns None).

        ``shards``: this rank's local shard of each tensor it holds, by table index, in the table's dtype.
        Returns the manifest on every rank once the version is visible; raises ``PermanentError`` on every
        rank, naming the rank and why, when any rank failed (the temporary directory is removed)."""
        if layout.unsupported:
            raise PermanentError(f"the sharded volume cannot describe this trainer: {layout.unsupported}")
        if layout.world_size != self.world:
            raise PermanentError(f"the layout is for {layout.world_size} ranks, this trainer has {self.world}")
        nonce = secrets.randbits(62) if self.rank == 0 else 0
        tmp: Path | None = None
        try:
            version, step, nonce = exchanges.broadcast_ints(self.group, [version, step, nonce])
            if version <= 0:
                return None
            tmp = self.root / f"{TEMPORARY_PREFIX}v{version:08d}-{nonce:016x}"
            manifest = self._write(tmp, version, step, layout, shards)
        except RuntimeError as e:  # gloo: a rank died, or did not arrive within the group's timeout
            if self.rank == 0 and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise PermanentError(
                f"version {version} was not written to the sharded volume: not every trainer rank took part within "
                f"{self.timeout_s:.0f}s ({e}); a rank that died or hangs fails the copy at every rank"
            ) from None
        if isinstance(manifest, str):
            raise PermanentError(f"version {version} was not written to the sharded volume: {manifest}")
        return manifest if manifest is not None else Manifest.load(version_dir(self.root, version))

    def _write(
        self, tmp: Path, version: int, step: int, layout: TrainerLayout, shards: Mapping[int, torch.Tensor]
    ) -> Manifest | str | None:
        """Every rank's file, the reports to rank 0, rank 0's landing, its outcome to all: the manifest (rank 0),
        None (the others, on success) or why it failed (every rank)."""
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            report = write_rank(tmp, self.rank, layout.table, writes(layout, self.rank), shards, self.tile)
        except (OSError, PermanentError) as e:
            log.error("rank %d: writing version %d to the volume failed: %s", self.rank, version, e)
            report = RankReport(self.rank, error=f"{type(e).__name__}: {e}")
        reports = [
            RankReport.from_json(b) for b in exchanges.all_gather_bytes(self.group, self.world, report.to_json())
        ]
        error, manifest = "", None
        if self.rank == 0:
            try:
                manifest = land(self.root, tmp, version, step, layout.table, reports, self.tile)
            except (OSError, PermanentError) as e:
                error = str(e)
                shutil.rmtree(tmp, ignore_errors=True)
        error = exchanges.broadcast_bytes(self.group, self.rank, error.encode()).decode()
        return error or manifest

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group(self.group)


def land(
    root: Path, tmp: Path, version: int, step: int, table: TensorTable, reports: list[RankReport], tile: int
) -> Manifest:
    """Rank 0: check every rank's file at this rank's path (``tmp`` under ``root``), then write the manifest last
    and make the version visible."""
    failed = [f"rank {r.rank}: {r.error}" for r in reports if r.error]
    if failed:
        raise PermanentError("; ".join(failed))
    for r in reports:
        if not r.file:
            continue
        path = tmp / r.file
        size = path.stat().st_size if path.is_file() else -1
        if size != r.nbytes:
            seen = "no such file" if size < 0 else f"{size} bytes"
            raise PermanentError(
                f"rank {r.rank} wrote {r.file} ({r.nbytes} bytes) but rank 0 sees {seen} at {path}: the "
                "checkpoint volume must be one shared file system mounted on every trainer rank "
                "(WEIGHTSYNC_CHECKPOINT_DIR on each names its own mount point)"
            )
    pieces = sorted((p for r in reports for p in r.pieces), key=lambda p: (p.tensor, p.rank))
    shards = {r.file: (r.nbytes, r.sha256) for r in reports if r.file}
    manifest = Manifest(version, step, table, {}, shards, time.time(), tuple(pieces), tile)
    text = manifest.to_json()
    Manifest.parse(text.encode(), tmp / MANIFEST)  # every element covered once, before it becomes visible
    final = version_dir(root, version)
    if final.exists():
        raise PermanentError(f"{final} already exists: version {version} was published before")
    with (tmp / MANIFEST).open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync(tmp)
    os.rename(tmp, final)
    fsync(root)
    return manifest


__all__ = ["RankReport", "ShardedVolumeWriter", "land", "rank_file", "tile_digest", "write_rank", "writes"]
