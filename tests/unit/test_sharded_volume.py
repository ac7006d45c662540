"""The sharded volume's format without processes: every rank's file written here in turn, the manifest landed as
rank 0 lands it, then read by region (a worker's fills) and whole (the gathered way), and broken on purpose.

The collective around it (gloo ranks, timeouts) is tested with real ranks in
``tests/integration/test_sharded_volume.py``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.unit import sharding_cases as cases
from weightsync.channels import manifests, sharded_volume, volume_regions
from weightsync.channels.base import UpdateTicket
from weightsync.channels.manifests import Manifest
from weightsync.channels.pieces import tiles
from weightsync.channels.volume import VolumeReceiver, VolumeSender, verify_version
from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import IntegrityError, PermanentError
from weightsync.sharding.boxes import Box
from weightsync.sharding.fills import Fill
from weightsync.sharding.shards import REPLICATE, Mesh, Placement, TrainerLayout
from weightsync.tensors import ITEMSIZE, TensorTable, content_digest, manifest_checksum
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit


def _full(table: TensorTable, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(spec.shape, generator=g).to(TORCH_DTYPES[spec.dtype]) for spec in table]


def _write(root: Path, layout: TrainerLayout, full: list[torch.Tensor], version: int = 1, tile: int = 4) -> Manifest:
    """Every rank's file, then the manifest: what ``ShardedVolumeWriter.write`` does across ranks."""
    tmp = root / f".tmp-v{version:08d}-test"
    tmp.mkdir(parents=True)
    reports = []
    for rank in range(layout.world_size):
        boxes = sharded_volume.writes(layout, rank)
        shards = {t: full[t][cases.slices(box)].clone() for t, box in boxes}
        reports.append(sharded_volume.write_rank(tmp, rank, layout.table, boxes, shards, tile))
    return sharded_volume.land(root, tmp, version, 3, layout.table, reports, tile)


def _fsdp(table: TensorTable, world: int) -> TrainerLayout:
    """FSDP2 on ``world`` ranks (``Shard(0)``), the last tensor plain (rank 0's)."""
    meshes = (Mesh((world,), tuple(range(world))), Mesh((1,), (0,)))
    placements = (*(Placement(0, (0,)) for _ in table.tensors[:-1]), Placement(1, (REPLICATE,)))
    return TrainerLayout(table, world, meshes, placements)


TABLE = TensorTable.build(
    [[("q.weight", "bfloat16", (16, 8)), ("o.weight", "bfloat16", (8, 16)), ("norm.weight", "float32", (8,))]]
)


def test_tiles_are_cells_of_one_global_grid_cut_to_the_box() -> None:
    box = Box((3, 0), (6, 5))
    cells = list(tiles(box, 4))
    assert cells == [
        Box((3, 0), (1, 4)),
        Box((3, 4), (1, 1)),
        Box((4, 0), (4, 4)),
        Box((4, 4), (4, 1)),
        Box((8, 0), (1, 4)),
        Box((8, 4), (1, 1)),
    ]
    assert sum(c.numel for c in cells) == box.numel
    assert list(tiles(Box((), ()), 4)) == [Box((), ())]  # a scalar is one tile


def test_every_rank_writes_its_pieces_and_the_manifest_names_them(tmp_path: Path) -> None:
    layout, full = _fsdp(TABLE, 2), _full(TABLE)
    manifest = _write(tmp_path, layout, full)
    directory = manifests.version_dir(tmp_path, 1)
    assert sorted(p.name for p in directory.iterdir()) == [
        "manifest.json",
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    raw = json.loads((directory / "manifest.json").read_text())
    assert raw["format"] == manifests.SHARDED and raw["tile"] == 4
    assert [(p["tensor"], p["rank"], p["box"]) for p in raw["pieces"]] == [
        (0, 0, [[0, 0], [8, 8]]),
        (0, 1, [[8, 0], [8, 8]]),
        (1, 0, [[0, 0], [4, 16]]),
        (1, 1, [[4, 0], [4, 16]]),
        (2, 0, [[0], [8]]),  # the plain tensor: rank 0's alone
    ]
    # parsed back from the file it is the manifest the writer landed, checked by the same checksum rule
    read = manifests.read(directory, 1, manifest_checksum((directory / "manifest.json").read_bytes()))
    assert read == Manifest.parse(manifest.to_json().encode(), directory) and read.sharded
    verify_version(directory, read)  # every rank file's size and sha256, as for a v1 version
    # a rank file is a safetensors file of tiles: ordinary tools open it
    with safe_open(str(directory / "rank-00001.safetensors"), framework="pt") as st:
        assert torch.equal(st.get_tensor("q.weight@12,4"), full[0][12:16, 4:8])
        assert len(list(st.keys())) == 4 + 4  # q: 2 x 2 tiles, o: 1 x 4 tiles


def test_a_replicated_box_is_written_once_by_its_lowest_rank(tmp_path: Path) -> None:
    mesh = Mesh((2, 2), (0, 1, 2, 3))  # (dp, tp): Shard(0) on dp, replicated on tp
    layout = TrainerLayout(TABLE, 4, (mesh,), tuple(Placement(0, (0, REPLICATE)) for _ in TABLE))
    manifest = _write(tmp_path, layout, _full(TABLE))
    assert sorted({p.rank for p in manifest.pieces}) == [0, 2]
    assert sorted(manifest.shards) == ["rank-00000.safetensors", "rank-00002.safetensors"]


@pytest.mark.parametrize("seed", range(12))
def test_random_trainers_and_replicas_read_back_exactly_their_regions(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    table = cases.random_table(rng, 9)
    trainer = cases.random_trainer(rng, table)
    full = _full(table, seed)
    tile = rng.choice([1, 2, 3, 5])
    manifest = _write(tmp_path, trainer, full, tile=tile)
    directory = manifests.version_dir(tmp_path, 1)
    replica = cases.random_replica(rng, table, rng.choice([1, 2, 3]))
    for worker in replica.workers:
        reader = volume_regions.RegionReader(directory, manifest)
        for fill, got in reader.fills(worker.fills):
            assert torch.equal(got, full[fill.tensor][cases.slices(fill.source)]), (seed, worker.rank, fill)
        needed = worker.bytes_needed(table)
        if tile == 1:  # every edge on the grid: not a byte more than the regions
            assert reader.bytes_read == needed
        else:
            assert reader.bytes_read >= needed
        reader.close()
    whole = volume_regions.RegionReader(directory, manifest)
    for t, spec in enumerate(table):
        assert torch.equal(whole.region(t, Box.whole(spec.shape)), full[t])
    assert whole.bytes_read == table.total_bytes


def test_a_tensor_parallel_workers_regions_on_the_grid_read_only_their_bytes(tmp_path: Path) -> None:
    layout, full = _fsdp(TABLE, 2), _full(TABLE)
    manifest = _write(tmp_path, layout, full)
    reader = volume_regions.RegionReader(manifests.version_dir(tmp_path, 1), manifest)
    rows = reader.region(0, Box((4, 0), (8, 8)))  # column-parallel rows across both ranks' pieces
    cols = reader.region(1, Box((0, 8), (8, 8)))  # row-parallel columns: a block of every row
    assert torch.equal(rows, full[0][4:12]) and torch.equal(cols, full[1][:, 8:16])
    assert reader.bytes_read == (8 * 8 + 8 * 8) * 2
    reader.region(2, Box((1,), (2,)))  # off the grid: the tile it lies in, whole
    assert reader.bytes_read == (8 * 8 + 8 * 8) * 2 + 4 * 4


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupted_or_truncated_rank_file_fails_naming_file_tensor_and_rank(tmp_path: Path) -> None:
    layout, full = _fsdp(TABLE, 2), _full(TABLE)
    manifest = _write(tmp_path, layout, full)
    directory = manifests.version_dir(tmp_path, 1)
    o_rank1 = next(p for p in manifest.pieces if p.tensor == 1 and p.rank == 1)
    _flip(directory / "rank-00001.safetensors", o_rank1.offset + 3)
    reader = volume_regions.RegionReader(directory, manifest)
    assert torch.equal(reader.region(1, Box((0, 0), (4, 16))), full[1][:4])  # rank 0's piece is whole
    with pytest.raises(
        IntegrityError,
        match=r"rank-00001.safetensors of version 1 \(written by trainer rank 1\), "
        r"tile \[4:8, 0:4\] of tensor 'o.weight': sha256 \w+\.\.\. does not match",
    ):
        reader.region(1, Box((0, 0), (8, 8)))
    with pytest.raises(
        IntegrityError, match=r"rank-00001.safetensors of version 1: sha256 .* holds tensors \['q.weight'"
    ):
        verify_version(directory, manifest)  # the whole-file check names what the file holds
    path = directory / "rank-00000.safetensors"
    path.write_bytes(path.read_bytes()[: o_rank1.offset])  # rank 0's file cut inside its o.weight piece
    with pytest.raises(
        IntegrityError,
        match=r"written by trainer rank 0\), tile \[\d+:\d+, \d+:\d+\] of tensor "
        r"'o.weight': the file is truncated",
    ):
        volume_regions.RegionReader(directory, manifest).region(1, Box.whole((8, 16)))
    (directory / "rank-00001.safetensors").unlink()
    with pytest.raises(
        IntegrityError,
        match=r"written by trainer rank 1\), tile .* of tensor 'q.weight': the file "
        r"is missing",
    ):
        volume_regions.RegionReader(directory, manifest).region(0, Box((8, 0), (8, 8)))


def test_the_gathered_reader_loads_a_sharded_version_whole_and_acks_the_trainers_digests(tmp_path: Path) -> None:
    layout, full = _fsdp(TABLE, 2), _full(TABLE)
    _write(tmp_path, layout, full, version=2)
    checksum = manifest_checksum(manifests.manifest_path(tmp_path, 2).read_bytes())
    receiver = VolumeReceiver(tmp_path)
    got = {
        spec.name: t
        for group in receiver.receive(UpdateTicket(2, Channel.VOLUME, manifest_checksum=checksum))
        for spec, t in group
    }
    assert all(torch.equal(got[spec.name], full[i]) for i, spec in enumerate(TABLE))
    # what a live stream's sender would have digested: the same content digest whichever way the bytes came
    sent = VolumeSender(tmp_path / "v1").send(UpdateTicket(7, Channel.VOLUME, TABLE), [full]).digests
    assert content_digest(receiver.verified) == content_digest(sent)


def test_versions_written_before_the_sharded_format_still_load(tmp_path: Path) -> None:
    full = _full(TABLE)
    VolumeSender(tmp_path).send(UpdateTicket(1, Channel.VOLUME, TABLE, verify=True), [full])
    _write(tmp_path, _fsdp(TABLE, 2), full, version=2)
    for version in (1, 2):
        checksum = manifest_checksum(manifests.manifest_path(tmp_path, version).read_bytes())
        ticket = UpdateTicket(version, Channel.VOLUME, verify=True, manifest_checksum=checksum)
        groups = list(VolumeReceiver(tmp_path).receive(ticket))
        assert [torch.equal(t, full[i]) for i, (_, t) in enumerate(groups[0])] == [True] * 3
    assert not manifests.Manifest.load(manifests.version_dir(tmp_path, 1)).sharded


def test_rank_0_refuses_a_version_a_rank_failed_or_wrote_where_it_cannot_see(tmp_path: Path) -> None:
    layout, full = _fsdp(TABLE, 2), _full(TABLE)
    tmp = tmp_path / ".tmp-v00000001-x"
    tmp.mkdir()
    mine = sharded_volume.writes(layout, 0)
    ok = sharded_volume.write_rank(tmp, 0, TABLE, mine, {t: full[t][cases.slices(b)] for t, b in mine}, 4)
    failed = sharded_volume.RankReport(1, error="OSError: [Errno 28] No space left on device")
    with pytest.raises(PermanentError, match=r"rank 1: OSError: .*No space left on device"):
        sharded_volume.land(tmp_path, tmp, 1, 0, TABLE, [ok, failed], 4)
    elsewhere = tmp_path / "rank1-own-disk"
    elsewhere.mkdir()
    boxes = sharded_volume.writes(layout, 1)
    own = sharded_volume.write_rank(elsewhere, 1, TABLE, boxes, {t: full[t][cases.slices(b)] for t, b in boxes}, 4)
    with pytest.raises(
        PermanentError,
        match=r"rank 1 wrote rank-00001.safetensors .* but rank 0 sees no such file .*"
        r"must be one shared file system",
    ):
        sharded_volume.land(tmp_path, tmp, 1, 0, TABLE, [ok, own], 4)
    with pytest.raises(PermanentError, match=r"'q.weight': the pieces hold 64 of its 128 elements"):
        sharded_volume.land(tmp_path, tmp, 1, 0, TABLE, [ok], 4)
    assert manifests.list_versions(tmp_path) == []


def test_a_rank_whose_shard_is_not_its_box_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    layout, full = _fsdp(TABLE, 2), _full(TABLE)
    boxes = sharded_volume.writes(layout, 1)
    shards = {t: full[t][cases.slices(b)] for t, b in boxes}
    shards[0] = full[0]  # the gathered tensor instead of the local shard
    with pytest.raises(
        PermanentError,
        match=r"rank 1, tensor 'q.weight': the layout gives this rank box "
        r"\[8:16, 0:8\] \(bfloat16\), its shard is torch.bfloat16 \[16, 8\]",
    ):
        sharded_volume.write_rank(tmp_path, 1, TABLE, boxes, shards, 4)


def test_a_manifest_of_an_unknown_format_or_with_pieces_missing_is_refused(tmp_path: Path) -> None:
    manifest = _write(tmp_path, _fsdp(TABLE, 2), _full(TABLE))
    raw = json.loads(manifest.to_json())
    with pytest.raises(PermanentError, match=r"format 'weightsync.volume/v3', expected one of"):
        Manifest.parse(json.dumps({**raw, "format": "weightsync.volume/v3"}).encode(), tmp_path)
    with pytest.raises(IntegrityError, match=r"tensor 'o.weight': the pieces hold 64 of its 128 elements"):
        Manifest.parse(
            json.dumps({**raw, "pieces": [p for p in raw["pieces"] if p != raw["pieces"][3]]}).encode(), tmp_path
        )
    bad = dict(raw["pieces"][0], file="../../etc/passwd")
    with pytest.raises(IntegrityError, match="must be a plain name"):
        Manifest.parse(json.dumps({**raw, "pieces": [bad, *raw["pieces"][1:]]}).encode(), tmp_path)
    few = dict(raw["pieces"][0], tiles=raw["pieces"][0]["tiles"][:-1])
    with pytest.raises(IntegrityError, match="3 tile digests, expected 4"):
        Manifest.parse(json.dumps({**raw, "pieces": [few, *raw["pieces"][1:]]}).encode(), tmp_path)
    assert math.prod(TABLE.tensors[0].shape) * ITEMSIZE["bfloat16"] == 256


def test_damage_is_found_before_a_byte_is_handed_over_by_either_reader(tmp_path: Path) -> None:
    layout, full = _fsdp(TABLE, 2), _full(TABLE)
    manifest = _write(tmp_path, layout, full)
    directory = manifests.version_dir(tmp_path, 1)
    norm = next(p for p in manifest.pieces if p.tensor == 2)  # the last tensor read: everything before it is fine
    _flip(directory / norm.file, norm.offset)
    fills = [Fill(t, Box.whole(spec.shape), 0, Box.whole(spec.shape)) for t, spec in enumerate(TABLE)]
    reader = volume_regions.RegionReader(directory, manifest)
    with pytest.raises(IntegrityError, match=r"rank 0\), tile \[0:4\] of tensor 'norm.weight'"):
        reader.check(fills)  # a worker checks every tile it will read, then lands
    assert reader.bytes_read == 0 and reader.bytes_checked > 0
    checksum = manifest_checksum(manifests.manifest_path(tmp_path, 1).read_bytes())
    groups = VolumeReceiver(tmp_path).receive(UpdateTicket(1, Channel.VOLUME, manifest_checksum=checksum))
    with pytest.raises(IntegrityError, match=r"rank-00000.safetensors of version 1: sha256"):
        next(groups)  # the gathered reader: every rank file's sha256 before the first group
