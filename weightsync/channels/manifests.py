"""The checkpoint volume's layout and manifests, without torch: what the coordinator reads and prunes.

Layout under the volume root::

    v00000007/manifest.json           version, step, tensors (shard, dtype, shape, digest), shards (sha256)
    v00000007/shard-00000.safetensors

That is format ``weightsync.volume/v1``, written by one process holding every tensor whole.
A sharded trainer writes ``weightsync.volume/v2`` (``SHARDED``): each rank writes the boxes
it holds into ``rank-NNNNN.safetensors`` and the manifest lists every rank's *pieces* and
their tiles' digests (``pieces``) instead of a shard per tensor. Readers take both
formats: versions written before the sharded writer stay loadable (catch-up).

A version directory appears whole or not at all (written under a temporary name,
fsync'ed, renamed; ``weightsync.channels.volume``). Its manifest is trusted only when
its bytes match the manifest checksum the coordinator recorded when the version became
durable (``read``): a manifest replaced by another, even a self-consistent one, is
refused. The coordinator, which owns the volume's retention, deletes versions from its
own record of them (``delete``), never from a directory listing alone.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.channels.pieces import Piece, check_pieces
from weightsync.errors import IntegrityError, PermanentError
from weightsync.tensors import TensorTable, manifest_checksum

FORMAT = "weightsync.volume/v1"
SHARDED = "weightsync.volume/v2"
FORMATS = (FORMAT, SHARDED)
MANIFEST = "manifest.json"
TEMPORARY_PREFIX = ".tmp-"
STALE_TEMPORARY_S = 3600.0


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def manifest_path(root: Path, version: int) -> Path:
    return version_dir(root, version) / MANIFEST


@dataclass(frozen=True)
class Manifest:
    version: int
    step: int
    table: TensorTable
    shard_of: dict[str, str]
    shards: dict[str, tuple[int, str]]  # file -> (bytes, sha256 hex)
    created: float
    pieces: tuple[Piece, ...] = ()
    """A sharded version's pieces (format v2; ``shard_of`` is empty then), in table order, then rank order."""
    tile: int = 0
    """A sharded version's tile size (``pieces``)."""

    @property
    def sharded(self) -> bool:
        return bool(self.pieces)

    def to_json(self) -> str:
        if self.sharded:
            tensors = [s.to_dict() for s in self.table]
            extra: dict[str, Any] = {"tile": self.tile, "pieces": [p.to_dict() for p in self.pieces]}
        else:
            tensors = [dict(s.to_dict(), shard=self.shard_of[s.name]) for s in self.table]
            extra = {}
        return json.dumps(
            {
                "format": SHARDED if self.sharded else FORMAT,
                "version": self.version,
                "step": self.step,
                "created": self.created,
                "total_bytes": self.table.total_bytes,
                "group_starts": list(self.table.group_starts),
                "tensors": tensors,
                "shards": [{"file": f, "bytes": b, "sha256": h} for f, (b, h) in self.shards.items()],
                **extra,
            },
            indent=None if self.sharded else 1,  # a sharded manifest lists a digest per tile: keep it compact
        )

    @classmethod
    def parse(cls, data: bytes, where: Path) -> Manifest:
        try:
            raw: dict[str, Any] = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IntegrityError(f"{where}: manifest is not valid JSON ({e})") from None
        form = raw.get("format")
        if form not in FORMATS:
            raise PermanentError(
                f"{where}: format {form!r}, expected one of {list(FORMATS)}; a newer weightsync wrote it: "
                "upgrade the reader"
            )
        try:
            table = TensorTable.from_dict({"tensors": raw["tensors"], "group_starts": raw.get("group_starts", [0])})
            sharded = form == SHARDED
            manifest = cls(
                version=int(raw["version"]),
                step=int(raw["step"]),
                table=table,
                shard_of={} if sharded else {t["name"]: t["shard"] for t in raw["tensors"]},
                shards={s["file"]: (int(s["bytes"]), s["sha256"]) for s in raw["shards"]},
                created=float(raw.get("created", 0.0)),
                pieces=tuple(Piece.from_dict(p) for p in raw["pieces"]) if sharded else (),
                tile=int(raw["tile"]) if sharded else 0,
            )
        except (KeyError, TypeError, ValueError, PermanentError) as e:
            raise IntegrityError(f"{where}: manifest is malformed ({type(e).__name__}: {e})") from None
        if sharded:
            if manifest.tile <= 0:
                raise IntegrityError(f"{where}: tile {manifest.tile} must be positive")
            names = [s.name for s in table]
            check_pieces(manifest.pieces, [s.shape for s in table], names, manifest.tile)
            unlisted = sorted({p.file for p in manifest.pieces} - manifest.shards.keys())
            if unlisted:
                raise IntegrityError(f"{where}: pieces lie in files {unlisted[:3]!r} that the manifest does not list")
        return manifest

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        """The manifest in ``directory``, trusted as it is (recovery, tools); loads use ``read``."""
        return cls.parse(_read(directory / MANIFEST), directory / MANIFEST)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{path}: no manifest; the version was never completed") from None


def read(directory: Path, version: int, checksum: str) -> Manifest:
    """The manifest of ``version``, refused unless its bytes match ``checksum`` (when one is given).

    Raises ``IntegrityError`` naming the file, what its checksum is and what was recorded.
    """
    path = directory / MANIFEST
    data = _read(path)
    if checksum:
        actual = manifest_checksum(data)
        if actual != checksum:
            raise IntegrityError(
                f"{path}: manifest checksum {actual} is not the {checksum} the coordinator recorded for "
                f"version {version}; the manifest was replaced or altered, the version is refused"
            )
    manifest = Manifest.parse(data, path)
    if manifest.version != version:
        raise IntegrityError(f"{path}: manifest says version {manifest.version}, expected {version}")
    return manifest


def list_versions(root: Path) -> list[int]:
    """Complete versions on the volume (those with a manifest), oldest first."""
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("v") and p.name[1:].isdigit() and (p / MANIFEST).is_file():
            out.append(int(p.name[1:]))
    return sorted(out)


def latest_version(root: Path) -> int | None:
    versions = list_versions(root)
    return versions[-1] if versions else None


def delete(root: Path, versions: list[int]) -> None:
    """Remove these versions' directories (and temporaries older than an hour, from writers that died)."""
    for v in versions:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
    if root.is_dir():
        for tmp in root.glob(TEMPORARY_PREFIX + "*"):
            if time.time() - tmp.stat().st_mtime > STALE_TEMPORARY_S:
                shutil.rmtree(tmp, ignore_errors=True)
