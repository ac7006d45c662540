"""The CPU stream between real processes: one group per replica, a dead replica costs only itself."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from weightsync.channels.base import UpdateTicket, dtype_name
from weightsync.channels.cpu import CpuSender
from weightsync.errors import TransferTimeoutError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _groups() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(512, 512, generator=g).bfloat16(), torch.randn(3, generator=g)] for _ in range(6)]


def _ticket(groups: list[list[torch.Tensor]]) -> UpdateTicket:
    table = TensorTable.build(
        [[(f"l{i}.t{j}", dtype_name(t.dtype), tuple(t.shape)) for j, t in enumerate(g)] for i, g in enumerate(groups)]
    )
    return UpdateTicket(1, Channel.CPU, table, params={"bucket_bytes": 1 << 19})


def _receiver(sender: CpuSender, gid: str, out: Path, die_after: int | None = None) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.procs",
        "receive",
        "--address",
        sender.address,
        "--group-id",
        gid,
        "--version",
        "1",
        "--bucket-bytes",
        str(1 << 19),
        "--out",
        str(out),
    ]
    if die_after is not None:
        cmd += ["--die-after", str(die_after)]
    return subprocess.Popen(cmd, cwd=ROOT)


def test_replica_dying_mid_stream_does_not_cost_the_other_its_version(tmp_path: Path) -> None:
    groups = _groups()
    sender = CpuSender(timeout_s=30)
    procs = {
        gid: _receiver(sender, gid, tmp_path / f"{gid}.json", die_after=2 if gid == "dies" else None)
        for gid in ("lives", "dies")
    }
    try:
        for gid in procs:
            sender.connect(2, gid)
        digests = sender.send(_ticket(groups), iter(groups))
        assert procs["lives"].wait(timeout=60) == 0 and procs["dies"].wait(timeout=60) == 17
    finally:
        for p in procs.values():
            p.kill()
    assert set(sender.failed) == {"dies"} and "failed" in sender.failed["dies"]
    assert json.loads((tmp_path / "lives.json").read_text()) == digests and len(digests) == 12
    sender.close()


def test_sender_fails_within_its_timeout_when_the_only_replica_dies(tmp_path: Path) -> None:
    groups = _groups()
    sender = CpuSender(timeout_s=10)
    proc = _receiver(sender, "only", tmp_path / "only.json", die_after=1)
    try:
        sender.connect(2, "only")
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError, match="every group failed"):
            sender.send(_ticket(groups), iter(groups))
        assert time.monotonic() - t0 < 15
    finally:
        proc.kill()
    sender.close()
