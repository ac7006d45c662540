"""The channel contract in one process: digests, the volume's integrity checks, the registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weightsync import channels
from weightsync.channels import digests
from weightsync.channels.base import UpdateTicket, dtype_name
from weightsync.channels.volume import Manifest, VolumeReceiver, VolumeSender, latest_version, list_versions
from weightsync.errors import IntegrityError, ModelMismatchError, PermanentError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.unit


def _groups(seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(64, 32, generator=g).bfloat16()],
        [torch.randn(33, 7, generator=g), torch.randint(0, 9, (5,), generator=g)],
        [torch.randn(3, generator=g).half()],
    ]


def _table(groups: list[list[torch.Tensor]]) -> TensorTable:
    return TensorTable.build(
        [[(f"g{i}.t{j}", dtype_name(t.dtype), tuple(t.shape)) for j, t in enumerate(g)] for i, g in enumerate(groups)]
    )


def test_digest_is_position_sensitive_and_length_aware() -> None:
    t = torch.arange(100, dtype=torch.int32)
    d = digests.digest(t)
    assert d == digests.digest(t.clone())
    swapped = t.clone()
    swapped[[3, 50]] = swapped[[50, 3]]
    assert digests.digest(swapped) != d
    assert digests.digest(t[:99]) != d
    flipped = t.clone().view(torch.uint8)
    flipped[399] ^= 1  # the last (tail) byte
    assert digests.digest(flipped) != digests.digest(t.view(torch.uint8))


def test_registry_is_lazy_and_names_valid_channels() -> None:
    assert channels.receiver_class("volume") is VolumeReceiver
    assert set(channels.implemented()) == set(Channel)
    with pytest.raises(ValueError, match="unknown channel 'tcp'; valid channels: ipc, nccl, nixl, cpu, volume"):
        channels.sender_class("tcp")


def _publish(root: Path, version: int, groups: list[list[torch.Tensor]], keep: int = 3) -> UpdateTicket:
    ticket = UpdateTicket(version, Channel.VOLUME, _table(groups), step=version * 10, params={"root": str(root)})
    VolumeSender(root, shard_bytes=3000, keep=keep).send(ticket, iter(groups))
    return ticket


def test_volume_round_trip_is_bit_exact(tmp_path: Path) -> None:
    groups = _groups()
    ticket = _publish(tmp_path, 1, groups)
    manifest = Manifest.load(tmp_path / "v00000001")
    assert len(manifest.shards) > 1, "small shard size should split the version"
    assert manifest.step == 10
    receiver = VolumeReceiver.from_init({"root": str(tmp_path)}, channels.base.WorkerContext())
    flat = [t for g in groups for t in g]
    got = [t.clone() for g in receiver.receive(ticket) for _, t in g]
    assert all(torch.equal(a, b) for a, b in zip(flat, got, strict=True))
    assert set(receiver.verified) == {s.name for s in ticket.table}


def test_volume_retention_and_atomic_visibility(tmp_path: Path) -> None:
    for v in range(1, 5):
        _publish(tmp_path, v, _groups(v), keep=2)
    assert list_versions(tmp_path) == [3, 4]
    assert latest_version(tmp_path) == 4
    (tmp_path / ".tmp-v00000005-1").mkdir()  # a writer that died: never visible
    assert latest_version(tmp_path) == 4
    with pytest.raises(PermanentError, match="version 4 was published before"):
        _publish(tmp_path, 4, _groups())


def test_truncated_shard_is_refused_naming_file_and_tensor(tmp_path: Path) -> None:
    ticket = _publish(tmp_path, 1, _groups())
    shard = tmp_path / "v00000001" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    receiver = VolumeReceiver(tmp_path)
    with pytest.raises(
        IntegrityError, match=r"shard-00000.safetensors of version 1: shard is truncated .* tensor 'g0.t0' is cut off"
    ):
        next(receiver.receive(ticket))


def test_corrupted_shard_is_refused_before_any_tensor(tmp_path: Path) -> None:
    ticket = _publish(tmp_path, 1, _groups())
    shard = tmp_path / "v00000001" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(
        IntegrityError,
        match=r"shard-00001.safetensors of version 1: sha256 .* does not match .* tensor 'g2.t0' has changed",
    ):
        next(VolumeReceiver(tmp_path).receive(ticket))


def test_manifest_mismatch_names_the_tensor(tmp_path: Path) -> None:
    groups = _groups()
    _publish(tmp_path, 1, groups)
    expected = TensorTable.build([[("g0.t0", "bfloat16", (64, 32))], [("g1.t0", "float32", (33, 8))]])
    ticket = UpdateTicket(1, Channel.VOLUME, expected)
    with pytest.raises(ModelMismatchError, match=r"tensor 'g1.t0': received dtype float32 shape \[33, 7\]"):
        next(VolumeReceiver(tmp_path).receive(ticket))


def test_sender_rejects_tensor_that_contradicts_the_table(tmp_path: Path) -> None:
    groups = _groups()
    ticket = UpdateTicket(1, Channel.VOLUME, _table(groups))
    groups[1][0] = groups[1][0].double()
    with pytest.raises(PermanentError, match=r"tensor 'g1.t0': got dtype float64"):
        VolumeSender(tmp_path).send(ticket, iter(groups))
    assert list_versions(tmp_path) == []


def test_update_info_round_trip_and_validation() -> None:
    ticket = UpdateTicket(3, Channel.CPU, _table(_groups()), step=7, params={"bucket_bytes": 1024})
    info = json.loads(json.dumps(ticket.to_update_info()))
    assert UpdateTicket.from_update_info(info) == ticket
    del info["table"]
    with pytest.raises(PermanentError, match="update_info lacks field 'table'"):
        UpdateTicket.from_update_info(info)
    with pytest.raises(PermanentError, match="version must be >= 1"):
        UpdateTicket(0, Channel.CPU, _table(_groups()))
