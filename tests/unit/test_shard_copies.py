"""The publisher's sharded copy rounds without ranks: every publish submits exactly one job per rank, in order,
whatever rank 0 decided, so the collective writes match across ranks (the real collective is tested with gloo
ranks in ``tests/integration/test_sharded_volume.py``). The writer here records its calls: a stand-in for the
one thing a unit test cannot run, the collective itself."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from weightsync.channels import manifests
from weightsync.errors import PermanentError
from weightsync.sharding.shards import TrainerLayout
from weightsync_trainer.shard_copies import ShardedCopies
from weightsync_trainer.sources import ModuleSource

pytestmark = pytest.mark.unit


class Writer:
    """Records (version, step, tensors it was given); fails versions listed in ``failing``."""

    def __init__(self, rank: int, root: Path) -> None:
        self.rank, self.root, self.timeout_s = rank, root, 5.0
        self.calls: list[tuple[int, int, int]] = []
        self.failing: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()

    def write(self, version: int, step: int, layout: Any, shards: dict[int, torch.Tensor]) -> Any:
        self.gate.wait(5)
        self.calls.append((version, step, len(shards)))
        if version in self.failing:
            raise PermanentError(f"version {version} was not written to the sharded volume: rank 1: disk full")
        if version <= 0 or self.rank != 0:
            return None
        directory = manifests.version_dir(self.root, version)
        directory.mkdir(parents=True)
        (directory / manifests.MANIFEST).write_text("{}")
        return type("M", (), {"version": version})()


class Client:
    def __init__(self) -> None:
        self.durable: list[tuple[int, str]] = []

    def mark_durable(self, version: int, path: str, checksum: str, digest: str) -> None:
        self.durable.append((version, digest))


def _copies(rank: int, tmp_path: Path) -> tuple[ShardedCopies, Writer, Client]:
    source = ModuleSource(torch.nn.Linear(4, 2, bias=False))
    layout = TrainerLayout.single(source.table())
    writer, client = Writer(rank, tmp_path), Client()
    copies = ShardedCopies(writer, source, layout, client if rank == 0 else None, verify=True)  # type: ignore[arg-type]
    return copies, writer, client


def test_rank_0_submits_one_job_per_publish_and_nothing_is_version_0(tmp_path: Path) -> None:
    copies, writer, client = _copies(0, tmp_path)
    with copies.round():
        copies.write_later(1, 10, [])
        copies.write_later(1, 10, [])  # a second call in the same round (a retry) adds no collective
    with copies.round():
        pass  # the version was not opened: the other ranks still get their round's write, of nothing
    with copies.round():
        assert copies.write(3, 30, []) == ""  # a replica waits for it: written now
    copies.wait(5)
    copies.close()
    assert writer.calls == [(1, 10, 1), (0, 0, 0), (3, 30, 1)]  # rank 0 holds the plain module's one tensor
    assert client.durable == [(1, ""), (3, "")]  # no content digest: the manifest lists tile digests


def test_the_other_ranks_submit_their_snapshot_when_the_publish_ends(tmp_path: Path) -> None:
    copies, writer, _ = _copies(1, tmp_path)
    writer.gate.clear()  # the writer thread is busy: the publish itself does not wait for the copy
    for _ in range(2):
        with copies.round():
            pass
    assert writer.calls == []
    writer.gate.set()
    copies.wait(5)
    copies.close()
    assert writer.calls == [(0, 0, 0), (0, 0, 0)]  # rank 1 of a single-rank layout holds nothing to write


def test_a_failed_copy_is_reported_to_the_caller_and_kept(tmp_path: Path) -> None:
    copies, writer, client = _copies(0, tmp_path)
    writer.failing.add(2)
    with copies.round():
        error = copies.write(2, 20, [])
    copies.close()
    assert "rank 1: disk full" in error and copies.errors == [f"version 2: {error}"]
    assert client.durable == []
