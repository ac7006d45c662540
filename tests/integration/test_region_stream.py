"""Regions point to point between real processes over gloo: each trainer rank sends only from its own shard,
each worker receives only its regions, and a wrong or missing region fails naming it.

A 2-rank trainer (FSDP2's ``Shard(0)``) and two replicas, tensor-parallel 2 and 1, whose workers keep the
tensors the ways vLLM does (column, row, fused rows, padding, experts, whole tensors for the loader); each
process is ``region_ranks`` (the plan is computed alike in each). Checked: every worker's parameters equal the
trainer's full tensors where its layout says, it received exactly the bytes its layout needs, and the senders'
and the workers' per-region digests combine into the same digest in plan order; a byte flipped on one rank's
link fails the worker naming tensor and rank; a rank that dies mid-send fails the workers waiting for it.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests import support
from tests.integration.region_ranks import REPLICAS, assert_exact, job, outcome

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
RANKS = 2
FAULTS = pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_SHARDED") != "all",
    reason="make sharded (WEIGHTSYNC_SHARDED=all); make test lands two ranks' regions in a TP=2 engine",
)


def _run(tmp: Path, *fault: str) -> dict[str, dict[str, object]]:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    base = [sys.executable, "-m", "tests.integration.region_ranks", "--port", str(store.port), "--out", str(tmp)]
    roles = [["--role", "trainer", "--rank", str(r)] for r in range(RANKS)]
    roles += [
        ["--role", "worker", "--replica", rid, "--worker", str(w)] for rid, n in REPLICAS.items() for w in range(n)
    ]
    procs = [subprocess.Popen([*base, *role, *fault], cwd=ROOT, env=support.env_without_proxies()) for role in roles]
    return outcome(tmp, procs)


@FAULTS
def test_each_rank_sends_its_shards_and_each_worker_gets_exactly_its_regions(tmp_path: Path) -> None:
    out = _run(tmp_path)
    assert out["codes"]["codes"] == [0] * (RANKS + 3)
    assert_exact(out, RANKS)
    _, result, _, _ = job(24, RANKS)
    sent_bytes = [sum(out[f"rank{r}"]["nbytes"].values()) for r in range(RANKS)]  # type: ignore[union-attr]
    assert all(n > 0 for n in sent_bytes) and sum(sent_bytes) == sum(result.bytes_sent().values())


@FAULTS
def test_a_byte_flipped_on_one_ranks_link_fails_the_worker_naming_tensor_and_rank(tmp_path: Path) -> None:
    out = _run(tmp_path, "--flip", "1")
    errors = [str(out[f"tp2-w{w}"].get("error", "")) for w in range(2)]
    flipped = [e for e in errors if "IntegrityError" in e]
    assert len(flipped) == 1, errors  # the worker the region went to; its neighbour may lose the version too
    assert "from trainer rank 1 arrived with digest" in flipped[0] and "tensor 'layers." in flipped[0], flipped[0]
    assert "error" not in out["tp1-w0"] and out["tp1-w0"]["wrong"] == []  # the other replica is unaffected


@FAULTS
def test_a_rank_dying_mid_send_fails_the_workers_waiting_for_it(tmp_path: Path) -> None:
    out = _run(tmp_path, "--die", "1")
    assert out["codes"]["codes"][1] == 3 and "rank1" not in out
    errors = {k: str(v.get("error", "")) for k, v in out.items() if k.startswith("tp")}
    assert all("TransferTimeoutError" in e and "trainer rank 1" in e for e in errors.values()), errors
