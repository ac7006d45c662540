"""The channel contract in one process: digests, typed rendezvous, the volume's integrity checks, the registry."""

from __future__ import annotations

import datetime
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from weightsync import channels
from weightsync.channels import digests, manifests, wire
from weightsync.channels.base import Endpoint, Offer, Rendezvous, UpdateTicket, WorkerContext, direct_rendezvous
from weightsync.channels.manifests import Manifest, latest_version, list_versions
from weightsync.channels.volume import VolumeReceiver, VolumeSender
from weightsync.channels.wire import dtype_name, table_groups
from weightsync.errors import IntegrityError, ModelMismatchError, PermanentError, TransferTimeoutError
from weightsync.tensors import TensorTable, manifest_checksum
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


def _publish(root: Path, version: int, groups: list[list[torch.Tensor]]) -> UpdateTicket:
    """Write ``version``; the ticket a replica gets for it: no table (the manifest carries it), the checksum."""
    table = _table(groups)
    ticket = UpdateTicket(version, Channel.VOLUME, table, step=version * 10)
    VolumeSender(root, shard_bytes=3000).send(ticket, iter(groups))
    checksum = manifest_checksum(manifests.manifest_path(root, version).read_bytes())
    return UpdateTicket(version, Channel.VOLUME, layout_digest=table.layout_digest(), manifest_checksum=checksum)


def test_volume_round_trip_is_bit_exact(tmp_path: Path) -> None:
    groups = _groups()
    ticket = _publish(tmp_path, 1, groups)
    manifest = Manifest.load(tmp_path / "v00000001")
    assert len(manifest.shards) > 1, "small shard size should split the version"
    assert manifest.step == 10
    receiver = VolumeReceiver.start(Rendezvous(Channel.VOLUME, root=str(tmp_path)), WorkerContext())
    flat = [t for g in groups for t in g]
    got = [t.clone() for g in receiver.receive(ticket) for _, t in g]
    assert all(torch.equal(a, b) for a, b in zip(flat, got, strict=True))
    assert receiver.table == _table(groups).with_digests(receiver.verified)
    assert set(receiver.verified) == {s.name for s in _table(groups)}


def test_volume_versions_appear_atomically_and_once(tmp_path: Path) -> None:
    for v in range(1, 5):
        _publish(tmp_path, v, _groups(v))
    assert list_versions(tmp_path) == [1, 2, 3, 4], "the writer never prunes: the coordinator owns retention"
    (tmp_path / ".tmp-v00000005-1").mkdir()  # a writer that died: never visible
    assert latest_version(tmp_path) == 4
    with pytest.raises(PermanentError, match="version 4 was published before"):
        _publish(tmp_path, 4, _groups())
    manifests.delete(tmp_path, [1, 3])
    assert list_versions(tmp_path) == [2, 4]


def test_replaced_manifest_is_refused_even_when_self_consistent(tmp_path: Path) -> None:
    """v2's bytes and manifest put in v1's place: whole and consistent, but not what the coordinator recorded."""
    ticket = _publish(tmp_path, 1, _groups(1))
    _publish(tmp_path, 2, _groups(2))
    v1, v2 = tmp_path / "v00000001", tmp_path / "v00000002"
    for f in v2.iterdir():
        (v1 / f.name).write_bytes(f.read_bytes().replace(b'"version": 2', b'"version": 1'))
    recorded = r"manifest checksum sha256:.* is not the sha256:.* the coordinator recorded"
    with pytest.raises(IntegrityError, match=recorded):
        next(VolumeReceiver(tmp_path).receive(ticket))
    unchecked = UpdateTicket(1, Channel.VOLUME)  # without the recorded checksum the same files would load
    assert sum(len(g) for g in VolumeReceiver(tmp_path).receive(unchecked)) == 4


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


def test_a_table_with_another_layout_digest_is_refused(tmp_path: Path) -> None:
    ticket = _publish(tmp_path, 1, _groups())
    other = _table([[torch.zeros(2)]]).layout_digest()
    wrong = UpdateTicket(1, Channel.VOLUME, layout_digest=other, manifest_checksum=ticket.manifest_checksum)
    with pytest.raises(IntegrityError, match=r"layout digest .* the coordinator recorded"):
        next(VolumeReceiver(tmp_path).receive(wrong))


def test_sender_rejects_tensor_that_contradicts_the_table(tmp_path: Path) -> None:
    groups = _groups()
    ticket = UpdateTicket(1, Channel.VOLUME, _table(groups))
    groups[1][0] = groups[1][0].double()
    with pytest.raises(PermanentError, match=r"tensor 'g1.t0': got dtype float64"):
        VolumeSender(tmp_path).send(ticket, iter(groups))
    assert list_versions(tmp_path) == []


def test_senders_refuse_groups_that_do_not_match_the_table() -> None:
    groups = _groups()
    table = _table(groups)
    assert [len(ts) for _, _, ts in table_groups(table, groups)] == [1, 2, 1]
    with pytest.raises(PermanentError, match=r"group 1 \(starting at 'g1.t0'\): got 1 tensors, expected 2"):
        list(table_groups(table, [groups[0], groups[1][:1], groups[2]]))
    with pytest.raises(PermanentError, match=r"group 2 .*got nothing"):
        list(table_groups(table, groups[:2]))
    with pytest.raises(PermanentError, match="more groups than the table lists"):
        list(table_groups(table, [*groups, groups[2]]))


def test_update_info_round_trip_and_validation() -> None:
    table = _table(_groups())
    ticket = UpdateTicket(3, Channel.CPU, table, table.layout_digest(), step=7, bucket_bytes=1024)
    info = json.loads(json.dumps(ticket.to_update_info()))
    assert UpdateTicket.from_update_info(info) == ticket
    del info["version"]
    with pytest.raises(PermanentError, match="update_info lacks field 'version'"):
        UpdateTicket.from_update_info(info)
    with pytest.raises(PermanentError, match="version must be >= 1"):
        UpdateTicket(0, Channel.CPU, table)
    with pytest.raises(PermanentError, match="the table is empty; leave it out"):
        UpdateTicket(1, Channel.CPU, TensorTable(()))


def test_ticket_fields_are_typed_and_checked_for_their_channel() -> None:
    volume = UpdateTicket(2, Channel.VOLUME, root="/mnt/v", shard_name="adapter.safetensors", files={"a.json": "{}"})
    assert UpdateTicket.from_update_info(json.loads(json.dumps(volume.to_update_info()))) == volume
    staged = UpdateTicket(2, Channel.CPU, staged=True)
    assert UpdateTicket.from_update_info(staged.to_update_info()).staged
    with pytest.raises(PermanentError, match="root are for the volume only"):
        UpdateTicket(2, Channel.CPU, root="/mnt/v")
    with pytest.raises(PermanentError, match="bucket_bytes is for the cpu stream only"):
        UpdateTicket(2, Channel.NCCL, bucket_bytes=1 << 20)
    with pytest.raises(PermanentError, match="bucket_bytes must be >= 0"):
        UpdateTicket(2, Channel.CPU, bucket_bytes=-1)
    with pytest.raises(PermanentError, match=r"volume file name '\.\./x' must be a plain file name"):
        UpdateTicket(2, Channel.VOLUME, files={"../x": ""})
    with pytest.raises(PermanentError, match=r"unknown fields \['params'\]"):
        UpdateTicket.from_update_info({**volume.to_update_info(), "params": {}})
    with pytest.raises(PermanentError, match="files must be an object"):
        UpdateTicket.from_update_info({**volume.to_update_info(), "files": ["a"]})


def test_rendezvous_travels_as_json_and_names_what_a_channel_lacks() -> None:
    offer = Offer(Channel.NIXL, Endpoint("198.18.0.2", 4000), agent="a", metadata=b"\x00md\xff", epoch=2)
    rdv = direct_rendezvous(offer, devices=2)
    assert (rdv.rank, rdv.world_size, rdv.generation, len(rdv.secret)) == (1, 3, 1, 32)
    assert Rendezvous.from_dict(json.loads(json.dumps(rdv.to_dict()))) == rdv
    with pytest.raises(PermanentError, match="nccl rendezvous lacks endpoint, group, secret"):
        channels.receiver_class(Channel.NCCL).start(Rendezvous(Channel.NCCL), WorkerContext())
    with pytest.raises(PermanentError, match="a cpu rendezvous cannot start a volume receiver"):
        VolumeReceiver.start(Rendezvous(Channel.CPU), WorkerContext())
    with pytest.raises(PermanentError, match="unknown fields \\['address'\\]"):
        Rendezvous.from_dict({"channel": "cpu", "address": "h:1"})
    with pytest.raises(PermanentError, match="not one address of this host"):
        Endpoint("0.0.0.0", 1)
    with pytest.raises(PermanentError, match=r"rank 3 is outside 1\.\.2"):
        Rendezvous(Channel.CPU, rank=3, world_size=3)


class _Unanswered:
    """A store client whose peer stopped answering: each operation blocks (as torch's does on a refused route)
    until the test lets it go."""

    def __init__(self) -> None:
        self.answering = True
        self.released = threading.Event()
        self.keys: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        if not self.answering:
            self.released.wait()
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()


def test_a_store_that_stops_answering_fails_each_wait_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "GRACE_S", 0.1)
    raw = _Unanswered()
    store = wire.BoundedStore(raw, 0.2, "group 'g'", Channel.NCCL)
    store.set("attempt", "1")
    assert store.check(["attempt"]) and store.get("attempt") == b"1"
    with pytest.raises(RuntimeError, match=r"not set within 0\.3s"):  # answered, but the key never came
        store.wait(["roster/1"], datetime.timedelta(seconds=0.3))
    raw.answering = False
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=r"group 'g': checking \['abandoned'\] on the sender's store"):
        store.check(["abandoned"])
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="abandoned"):  # the client is held: later ones fail at once
        store.get("attempt")
    assert time.monotonic() - t0 < 0.05
    raw.released.set()
