"""The publisher does not wait out the transfer timeout for a replica that died before joining.

A replica planned for a version and killed (SIGKILL, a real process) before it joins is
dropped by the coordinator when its lease runs out; it will never join. The publisher learns
that from the join wait and gives that channel's group the short ready wait, so ``publish``
returns after about one lease TTL, not after the transfer timeout (120 s by default in an RLJob:
before the fix the whole fleet stalled that long).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from tests import simulation
from weightsync.coordinator import server
from weightsync.coordinator.client import CoordinatorClient
from weightsync.vocabulary import Channel, VersionState
from weightsync_trainer.publisher import Publisher
from weightsync_trainer.sources import ModuleSource

pytestmark = pytest.mark.integration
TRANSFER_TIMEOUT_S = 30.0
LEASE_TTL_S = 2.0


def test_a_replica_gone_before_joining_does_not_stall_the_publisher() -> None:
    srv = server.CoordinatorServer(server.ServerConfig(insecure=True, port=0, lease_ttl_s=LEASE_TTL_S)).start()
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    replica = ctx.Process(
        target=simulation.replica_main, args=(simulation.Member(srv.target, "job", "r0"), events), daemon=True
    )
    try:
        with CoordinatorClient(srv.target, insecure=True) as client:
            replica.start()
            assert events.get(timeout=60)[0] == "registered"
            model = torch.nn.Sequential(torch.nn.Linear(8, 8))
            pub = Publisher(
                ModuleSource(model),
                client,
                job="job",
                channels_=(Channel.CPU,),
                node="node-a",  # the simulated replica's: a loopback endpoint reaches only its own host
                timeout_s=TRANSFER_TIMEOUT_S,
            )
            replica.kill()
            replica.join()
            t0 = time.monotonic()
            report = pub.publish(1)
            took = time.monotonic() - t0
            pub.close()
        assert report is not None and report.state is VersionState.FAILED, report
        assert "r0" in report.failed, report
        assert took < TRANSFER_TIMEOUT_S / 2, f"publish took {took:.1f}s: it waited for a replica that was dropped"
    finally:
        if replica.is_alive():
            replica.kill()
        srv.stop(1)
