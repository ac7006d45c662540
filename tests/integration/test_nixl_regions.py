"""Regions over NIXL between hosts: every worker reads its regions straight out of each trainer rank's shards.

The job of ``test_region_stream`` (a 2-rank FSDP2 trainer, replicas at tensor-parallel size 2 and 1 whose workers
keep the tensors the ways vLLM does), every link by ``nixl_regions``: each process on a host of its own (network
namespaces), the store on the test's host, NIXL's UCX backend over TCP (``UCX_TLS=tcp``: the namespaces share this
machine's memory, and UCX would otherwise pick shared memory, which separate hosts do not have), host memory
(DRAM) on both ends. Checked: every worker's parameters equal the trainer's full tensors where its layout says, it
read exactly the bytes its layout needs, and the ranks' and the workers' per-region digests combine into the same
digest in plan order; a byte flipped in a bucket after the READ landed (corruption on the way, which TCP does not
let through for real) fails that worker naming tensor and rank; a rank that dies once its shards are placed fails
the workers waiting for its digest words, naming it.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests import netns, support
from tests.integration.region_ranks import REPLICAS, assert_exact, outcome

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None, reason="nixl is not installed (make venv installs it)"
    ),
]
ROOT = Path(__file__).resolve().parents[2]
RANKS = 2


def _run(tmp: Path, *fault: str) -> dict[str, dict[str, object]]:
    netns.require()
    roles = {f"rank-{r}": ["--role", "trainer", "--rank", str(r)] for r in range(RANKS)}
    roles |= {
        f"{rid}-w{w}": ["--role", "worker", "--replica", rid, "--worker", str(w)]
        for rid, n in REPLICAS.items()
        for w in range(n)
    }
    with netns.Hosts(list(roles)) as hosts:
        store = dist.TCPStore(
            hosts.bridge_address, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
        )
        base = [sys.executable, "-m", "tests.integration.region_ranks", "--transport", "nixl"]
        base += ["--store-host", hosts.bridge_address, "--port", str(store.port), "--out", str(tmp)]
        env = {**support.env_without_proxies(), "UCX_TLS": "tcp"}
        procs = [hosts.popen(h, [*base, *role, *fault], cwd=ROOT, env=env) for h, role in roles.items()]
        return outcome(tmp, procs)


def test_each_worker_reads_exactly_its_regions_from_every_ranks_shards(tmp_path: Path) -> None:
    out = _run(tmp_path)
    assert out["codes"]["codes"] == [0] * (RANKS + 3), out
    assert_exact(out, RANKS)


def test_a_byte_flipped_on_the_way_fails_the_worker_naming_tensor_and_rank(tmp_path: Path) -> None:
    out = _run(tmp_path, "--flip", "1")
    error = str(out["tp2-w0"].get("error", ""))
    assert "IntegrityError" in error and "from trainer rank 1 arrived with digest" in error, error
    assert "tensor 'layers." in error, error
    for other in ("tp2-w1", "tp1-w0"):  # the bytes they read are theirs: untouched
        assert "error" not in out[other] and out[other]["wrong"] == [], out[other]


@pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_SHARDED") != "all", reason="make sharded (WEIGHTSYNC_SHARDED=all): waits out a timeout"
)
def test_a_rank_dying_once_placed_fails_the_workers_waiting_for_it(tmp_path: Path) -> None:
    out = _run(tmp_path, "--die", "1")
    assert out["codes"]["codes"][1] == 3 and "rank1" not in out
    for w in range(2):
        error = str(out[f"tp2-w{w}"].get("error", ""))
        assert "trainer rank 1" in error and ("TransferTimeoutError" in error or "RetryableError" in error), error
