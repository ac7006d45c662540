"""Reading a sharded volume version (format v2) by region: a worker reads only the boxes its layout needs.

``RegionReader.region(tensor, box)`` assembles a box of a tensor from every rank's pieces
that intersect it, tile by tile (``pieces``): one read per tile, each tile checked against
the digest the manifest lists for it before a byte of it is used. ``fills`` does that for
a worker's engine layout and yields ``(Fill, tensor)`` pairs, what ``Landing`` writes into
the worker's parameters; ``check`` verifies every tile a worker will read before the
first byte lands (fail-stop). A truncated, altered or missing rank file fails naming the
file, the version, the trainer rank that wrote it, the tile and the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from weightsync.channels.manifests import Manifest
from weightsync.channels.pieces import Piece, slices, tiles
from weightsync.channels.sharded_volume import tile_digest
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import IntegrityError, PermanentError
from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import Fill
from weightsync.tensors import ITEMSIZE


class RegionReader:
    """Reads boxes of a sharded version's tensors, tile by tile, each tile checked against its digest.

    ``bytes_read`` counts the bytes read from the files (the tiles touched), which equals the bytes of the
    boxes asked for when their edges fall on the tile grid."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        if not manifest.sharded:
            raise PermanentError(f"{directory}: version {manifest.version} is not sharded (format v1)")
        self.directory, self.manifest = directory, manifest
        self.bytes_read = 0
        self.bytes_checked = 0
        self._pieces: dict[int, list[Piece]] = {}
        for p in manifest.pieces:
            self._pieces.setdefault(p.tensor, []).append(p)
        self._files: dict[str, Any] = {}
        self._tiles: dict[tuple[int, int, int], bytearray] = {}
        """Tiles of the tensor being read, by (tensor, rank, tile index): one fill's edge tile is the next's."""

    def region(self, tensor: int, box: Box) -> torch.Tensor:
        """Box ``box`` of table tensor ``tensor``, read and verified."""
        spec = self.manifest.table.tensors[tensor]
        if not box.within(spec.shape):
            raise PermanentError(f"box {box} lies outside tensor {spec.name!r} of shape {list(spec.shape)}")
        if self._tiles and next(iter(self._tiles))[0] != tensor:
            self._tiles.clear()
        dtype = TORCH_DTYPES[spec.dtype]
        out = torch.empty(box.lengths, dtype=dtype)
        for piece, index, cell, common, at in self._touching(tensor, box):
            data = self._tile(piece, index, cell, at, keep=common != cell)
            values = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(cell.lengths)
            out[slices(common, box.offsets)] = values[slices(common, cell.offsets)]
        return out

    def check(self, fills: Iterable[Fill]) -> None:
        """Read and verify every tile ``fills`` touch, keeping nothing: a worker checks all it will read before
        its first byte lands in a parameter (fail-stop: a damaged version is refused with the weights untouched),
        then reads again to land (from the page cache, mostly). Counted in ``bytes_checked``."""
        counted = self.bytes_read
        try:
            for f in fills:
                for piece, index, cell, _, at in self._touching(f.tensor, f.source):
                    self._tile(piece, index, cell, at, keep=False)
        finally:
            self.bytes_checked += self.bytes_read - counted
            self.bytes_read = counted

    def _touching(self, tensor: int, box: Box) -> Iterator[tuple[Piece, int, Box, Box, int]]:
        """(piece, tile index, tile, its part inside ``box``, byte offset) of every tile ``box`` touches."""
        item = ITEMSIZE[self.manifest.table.tensors[tensor].dtype]
        for piece in self._pieces.get(tensor, []):
            if piece.box.intersect(box) is None:
                continue
            at = piece.offset
            for index, cell in enumerate(tiles(piece.box, self.manifest.tile)):
                common = cell.intersect(box)
                if common is not None:
                    yield piece, index, cell, common, at
                at += cell.numel * item

    def fills(self, fills: Iterable[Fill]) -> Iterator[tuple[Fill, torch.Tensor]]:
        """Each fill with its source box, read (a worker's layout: ``WorkerLayout.fills``)."""
        for f in fills:
            yield f, self.region(f.tensor, f.source)

    def _tile(self, piece: Piece, index: int, cell: Box, at: int, keep: bool) -> bytearray:
        """The tile's bytes, verified; ``keep``: the region uses part of it, the next fill may use the rest."""
        key = (piece.tensor, piece.rank, index)
        cached = self._tiles.get(key)
        if cached is not None:
            return cached
        spec = self.manifest.table.tensors[piece.tensor]
        name, nbytes = spec.name, cell.numel * ITEMSIZE[spec.dtype]
        path = self.directory / piece.file
        what = (
            f"{path}: {piece.file} of version {self.manifest.version} (written by trainer rank {piece.rank}), "
            f"tile {cell} of tensor {name!r}"
        )
        f = self._files.get(piece.file)
        if f is None:
            try:
                f = self._files[piece.file] = path.open("rb")
            except FileNotFoundError:
                raise IntegrityError(f"{what}: the file is missing; the version is refused") from None
        data = bytearray(nbytes)
        got_bytes = os.preadv(f.fileno(), [data], at)
        self.bytes_read += got_bytes
        if got_bytes != nbytes:
            size = os.fstat(f.fileno()).st_size
            raise IntegrityError(
                f"{what}: the file is truncated ({size} bytes, the tile ends at byte {at + nbytes}); "
                "the version is refused"
            )
        got, want = tile_digest(data), piece.digests[index]
        if got != want:
            raise IntegrityError(
                f"{what}: sha256 {got}... does not match the manifest's {want}...: the file was altered or damaged; "
                "the version is refused"
            )
        if keep:
            self._tiles[key] = data
        return data

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._tiles.clear()


__all__ = ["RegionReader"]
