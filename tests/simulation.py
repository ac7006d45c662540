"""Simulated trainers and replicas: real clients speaking real gRPC, without tensors.

The integration tests start these as separate processes (multiprocessing spawn),
so the coordinator is exercised exactly as the publisher and the agents will use
it - one process per member, leases renewed by the client's thread - only the
bytes are left out. A replica reports what it sees on a queue, so a test can wait
for "acked v3" instead of sleeping. Give a process the test will SIGKILL a queue of
its own: killed while its queue's feeder thread holds the queue's write lock, it
would block every other writer of a shared queue for good.

A simulated replica refuses (acks as failed, event ``refused``) a volume plan that
carries no manifest checksum: the coordinator sends a volume plan (an ASSIGN or a
CATCH_UP) only once the version is durable, with the checksum it recorded, so an
empty one means the plan went out too early.
"""

from __future__ import annotations

import dataclasses
import time
from multiprocessing.queues import Queue
from typing import Any

from weightsync.channels.base import Endpoint, Offer
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import AckReport, Capabilities, EngineKind, EventKind, JobPolicy, TableSummary
from weightsync.coordinator.tls import TlsConfig
from weightsync.tensors import DIGEST_PREFIX
from weightsync.vocabulary import Channel, SyncPhase

LAYOUT = DIGEST_PREFIX + "5" * 64
"""The layout digest of the simulated trainer's (tensor-less) table."""


@dataclasses.dataclass(frozen=True)
class Member:
    target: str
    job: str
    member_id: str
    channels: tuple[str, ...] = ("cpu",)
    engine: str = "cpu"
    host: str = "node-a"
    volume_id: str = ""
    volume_mount: str = ""
    nccl_domain: str = ""
    current_version: int = 0
    token: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    hang_after_joined: bool = False
    """Report joined, then never ack (a replica that will be killed mid-transfer)."""
    work_s: float = 0.0
    """Pretend the transfer takes this long before acking."""

    def client(self) -> CoordinatorClient:
        if self.ca_file:
            tls = TlsConfig(
                ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file, server_name="localhost"
            )
            return CoordinatorClient(self.target, token=self.token, tls=tls, timeout_s=10.0)
        return CoordinatorClient(self.target, token=self.token, insecure=True, timeout_s=10.0)

    def capabilities(self) -> Capabilities:
        return Capabilities(
            host=self.host,
            channels=tuple(Channel(c) for c in self.channels),
            engine=EngineKind(self.engine),
            volume_id=self.volume_id,
            volume_mount=self.volume_mount,
            nccl_domain=self.nccl_domain,
        )


def replica_main(member: Member, events: Queue[Any]) -> None:
    """Register, watch, and ack every assignment (catch-ups included) until killed."""
    client = member.client()
    client.register_replica(member.job, member.member_id, member.capabilities(), current_version=member.current_version)
    events.put(("registered", member.member_id, 0, ""))
    for a in client.watch():
        channel = a.plan.channel.value if a.plan else ""
        events.put((a.kind.value, member.member_id, a.version, channel))
        if a.kind is EventKind.ABORT or a.table is None:
            continue
        started = time.perf_counter()
        if a.kind is EventKind.ASSIGN:
            client.report_joined(a.version)
        if a.plan is not None and a.plan.channel is Channel.VOLUME and not a.plan.manifest_checksum:
            error = f"volume plan for v{a.version} carries no manifest checksum: sent before the version was durable"
            state = client.ack(AckReport(a.version, a.table.layout_digest, ok=False, error=error))
            events.put(("refused", member.member_id, a.version, state.value))
            continue
        if member.hang_after_joined:
            events.put(("hanging", member.member_id, a.version, channel))
            time.sleep(3600)
        if member.work_s:
            time.sleep(member.work_s)
        total = time.perf_counter() - started
        phases = {
            SyncPhase.TRANSFER: total * 0.6,
            SyncPhase.LOAD: total * 0.3,
            SyncPhase.VERIFY: total * 0.1,
            SyncPhase.TOTAL: total,
        }
        state = client.ack(AckReport(a.version, a.table.layout_digest, ok=True, phases=phases))
        events.put(("acked", member.member_id, a.version, state.value))


def trainer_main(
    member: Member,
    events: Queue[Any],
    step: int,
    offers: tuple[tuple[str, str, int], ...] = (),
    policy: JobPolicy | None = None,
) -> None:
    """Register with ``offers`` ((channel, host, port); no host for the volume), open one version at ``step``,
    report it, then hang (a test kills us mid-publish)."""
    client = member.client()
    sent = [Offer(Channel(c), Endpoint(h, p) if h else None) for c, h, p in offers]
    client.register_trainer(member.job, member.member_id, member.capabilities(), policy=policy, offers=sent)
    opened = client.open_version(step, TableSummary(2, 1024, LAYOUT))
    events.put(("opened", member.member_id, opened.version, ",".join(p.channel.value for p in opened.plans)))
    time.sleep(3600)
