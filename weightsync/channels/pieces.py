"""The sharded volume's geometry, without torch: pieces of tensors, cut in tiles, each tile with its sha256.

In a sharded version (manifest format ``weightsync.volume/v2``, ``manifests``) every
trainer rank writes the boxes of the tensors it holds (its local shards: a *piece* is
one rank's box of one tensor) into a file of its own. A reader that needs only a region
of a tensor (a tensor-parallel worker's rows or columns) must be able to verify what it
reads without reading the rest, so a piece is stored as *tiles*: the cells of a global
grid of ``tile`` elements along every dimension, intersected with the piece's box.
Each tile lies contiguously in the file, in row-major order of its own elements, and
the manifest lists its digest (the first 128 bits of the sha256 of its bytes). So:

- a region is read tile by tile, one read per tile, and every byte a reader uses is
  checked against the digest of the tile it lies in;
- a reader reads exactly its region when the region's edges fall on the grid
  (tensor-parallel cuts of power-of-two sizes do for tiles that divide them), and at
  most one tile more per edge otherwise;
- the grid is global (offsets in the whole tensor, not in the piece), so a tile never
  straddles two ranks' pieces, and a piece's tiles are its cells of the one grid.

The tile size trades the manifest's size (one digest per tile: Qwen3-8B at 256 has
about 126 k tiles, ~4.4 MB of manifest) against how much a reader reads beyond its region.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.errors import IntegrityError
from weightsync.sharding.boxes import Box

DEFAULT_TILE = 256
"""Elements per dimension of a tile (the grid's step)."""
TILE_DIGEST_HEX = 32
"""Hex digits of a tile's sha256 kept in the manifest (128 bits)."""


def tiles(box: Box, tile: int) -> Iterator[Box]:
    """The cells of the global grid of step ``tile`` that ``box`` covers, cut to it, in row-major grid order."""
    if box.numel == 0:
        return
    ranges = [
        [(max(o, g), min(o + n, g + tile)) for g in range((o // tile) * tile, o + n, tile)]
        for o, n in zip(box.offsets, box.lengths, strict=True)
    ]
    for cell in itertools.product(*ranges):
        yield Box(tuple(a for a, _ in cell), tuple(b - a for a, b in cell))


def slices(box: Box, origin: Sequence[int]) -> tuple[slice, ...]:
    """``box`` as slices of a block whose first element is at ``origin`` (a piece, a tile, a region)."""
    return tuple(slice(o - z, o - z + n) for o, z, n in zip(box.offsets, origin, box.lengths, strict=True))


@dataclass(frozen=True, slots=True)
class Piece:
    """Rank ``rank``'s box of table tensor ``tensor``, stored in ``file`` from byte ``offset`` on as its tiles (in
    ``tiles`` order, contiguous, each ``digests[i]`` long in the manifest's hex form)."""

    tensor: int
    rank: int
    file: str
    box: Box
    offset: int
    digests: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tensor": self.tensor,
            "rank": self.rank,
            "file": self.file,
            "box": [list(self.box.offsets), list(self.box.lengths)],
            "offset": self.offset,
            "tiles": list(self.digests),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Piece:
        offsets, lengths = d["box"]
        return cls(
            int(d["tensor"]),
            int(d["rank"]),
            str(d["file"]),
            Box(tuple(int(x) for x in offsets), tuple(int(x) for x in lengths)),
            int(d["offset"]),
            tuple(str(x) for x in d["tiles"]),
        )


def check_pieces(pieces: Sequence[Piece], shapes: Sequence[Sequence[int]], names: Sequence[str], tile: int) -> None:
    """Refuse a manifest whose pieces do not cover each tensor exactly once, inside its shape, one digest per
    tile, in a file named plainly (no path: a reader joins it to its own view of the version directory)."""
    covered = [0] * len(shapes)
    for p in pieces:
        where = f"piece of rank {p.rank} in {p.file!r}"
        if not 0 <= p.tensor < len(shapes):
            raise IntegrityError(f"{where}: names tensor #{p.tensor} of {len(shapes)}")
        name = names[p.tensor]
        if "/" in p.file or "\\" in p.file or p.file in ("", ".", ".."):
            raise IntegrityError(f"{where} of tensor {name!r}: the file must be a plain name in the version directory")
        if not p.box.within(shapes[p.tensor]):
            raise IntegrityError(f"{where}: box {p.box} lies outside tensor {name!r} of shape {list(shapes[p.tensor])}")
        count = sum(1 for _ in tiles(p.box, tile))
        if len(p.digests) != count:
            raise IntegrityError(f"{where} of tensor {name!r}: {len(p.digests)} tile digests, expected {count}")
        covered[p.tensor] += p.box.numel
    for t, shape in enumerate(shapes):
        whole = Box.whole(shape).numel
        if covered[t] != whole:
            raise IntegrityError(
                f"tensor {names[t]!r}: the pieces hold {covered[t]} of its {whole} elements; every element must be "
                "written by exactly one rank"
            )
