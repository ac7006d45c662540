"""Publishing a version: one collective call on every trainer rank, every planned channel from one gather.

From a trainer pod, everything comes from the environment the operator injects::

    publisher = Publisher.from_env(ModuleSource(model))    # coordinator, token, CA, job, rank, checkpoint dir
    for step in range(steps):
        train_step()
        if step % publisher.every_steps == 0:
            report = publisher.publish(step)               # on every rank: FSDP2 gathers are collective
    publisher.close()

``publish(step)`` on the sending rank (rank 0; the other ranks only take part in the
gather) runs the phases of ``phases``, each returning what it did:

1. opens the version at the coordinator, which plans every live replica on the best
   channel both ends share, among the channels this publisher offered;
2. hands each channel's sender its receivers (``take_plan``: groups are formed or
   rebuilt when the membership changed) and waits until the replicas planned on a
   live channel joined, or were dropped;
3. gathers the weights once, group by group, and streams every group to every
   channel that has receivers (one thread per sender when there are several), keeping
   a copy for the volume;
4. reports what it sent (the content digest the replicas' acks must match, and the
   receivers a channel lost) and waits for the verdict; when a replica is planned on
   the volume (it has no live channel, or its channel failed), the volume copy is
   written first and marked durable, because that replica loads it from there;
   otherwise the copy is written in the background after the verdict, so late
   joiners and recovering replicas find it;
5. waits until one-sided channels' receivers consumed the version (``release``).

On a distributed trainer whose ranks agree on a layout the core can describe (``layouts``), rank 0 registers
it, and a replica that registered its engine layout is planned on the sharded path: every rank sends it only
the regions its workers keep, from its own shards, with no gather (``region_sends``: rank 0 tells the ranks
what each publish sends, and reports each such replica's combined region digest). The other replicas take the
path above in the same publish; the plan chooses, not the user.

A coordinator outage does not stop training: the client retries until its deadline
and registers again after a restart; when the coordinator stays unreachable,
``publish`` returns a report instead of raising: FAILED with version 0 (the step was
not published; the next publish sends a whole version anyway), or STAGING with the
reason when it became unreachable after the bytes went out (the outcome is unknown).

The publisher registers with what it discovers: the node it runs on, its GPU's UUID,
the job's NCCL domain, whether NIXL is importable, the checkpoint volume. It offers
every channel of the job it can send; the coordinator negotiates only those. The
checkpoint volume is pruned by the coordinator (it knows which version is the newest
durable READY one), never by the writer (``durable``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync import channels, jobconfig
from weightsync.channels import nccl, nixl, rules
from weightsync.channels.base import Sender, SenderConfig, SendReport, UpdateTicket
from weightsync.channels.volume import VolumeSender
from weightsync.coordinator import auth, models
from weightsync.coordinator.client import CoordinatorClient, until_registered
from weightsync.coordinator.tls import TlsConfig
from weightsync.errors import PermanentError, WeightsyncError
from weightsync.metrics import PublisherMetrics
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel, VersionState
from weightsync_trainer import layouts, phases, region_sends, shard_copies
from weightsync_trainer.durable import VolumeCopies
from weightsync_trainer.sources import LoraAdapterSource, ModuleSource, WeightSource

log = logging.getLogger(__name__)


@dataclass
class PublishReport:
    version: int
    step: int
    state: VersionState
    bytes: int
    tensors: int
    channels: dict[str, str] = field(default_factory=dict)
    """Replica id -> the channel it was planned on (the volume for a replica that fell back)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the publish went: ``open`` (the coordinator plans), ``joined`` (the live receivers set up), ``stream``
    (one gather to every live channel), ``durable`` (the volume copy, when a replica waits for it), ``verdict``
    (the replicas load and ack), ``release`` (one-sided channels' buffers freed), ``total``."""
    failed: dict[str, str] = field(default_factory=dict)
    """Replica id -> why a channel lost it."""
    content_digest: str = ""
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON types (for logs and tools)."""
        return {**dataclasses.asdict(self), "state": self.state.value}


def send(source: WeightSource, sender: Sender, ticket: UpdateTicket, rank: int = 0) -> SendReport:
    """One gather of ``source`` into one sender, collective on every rank (only rank 0 sends).

    The building block for tools and benchmarks that drive a channel without a coordinator.
    """
    if rank != 0:
        phases.take_part(source)
        return SendReport()
    return sender.send(ticket, source.groups())


def _region_sends(
    source: WeightSource, rank: int, timeout_s: float, device: torch.device
) -> region_sends.RegionSends | None:
    """Every rank's part of the sharded path, when the ranks of a distributed trainer agreed on a layout the core
    can describe; else None: every replica takes the gathered path, as before. Collective: on every rank.

    A trainer on one rank keeps the gathered path: the sharded path's gain is every rank sending in parallel."""
    import torch.distributed as dist

    if type(source) is not ModuleSource:
        return None
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    layout = layouts.agreed(layouts.trainer_layout(source))
    if layout.unsupported:
        log.info("every replica takes the gathered path: %s", layout.unsupported)
        return None
    return region_sends.RegionSends(source, layout, rank, timeout_s, device)


POD_IP_ENV = "POD_IP"
IN_A_POD_ENV = "KUBERNETES_SERVICE_HOST"
"""Set by the kubelet in every container: how a process knows it runs in a pod."""


def pod_ip(env: Mapping[str, str]) -> str:
    """The address the live channels offer (their rendezvous listens there): ``$POD_IP``.

    In a pod, it is required: without it the publisher would offer 127.0.0.1, which no replica on another node can
    reach (the coordinator refuses to plan them against it, so they would all take the volume). Outside a pod (a
    local run) 127.0.0.1 serves replicas on the same host, and a warning says so."""
    address = env.get(POD_IP_ENV, "")
    if address:
        return address
    if env.get(IN_A_POD_ENV):
        raise PermanentError(
            f"${POD_IP_ENV} is not set in this pod: the live channels would listen on 127.0.0.1, which replicas on "
            f"other nodes cannot reach; set it from the downward API (env {POD_IP_ENV}: valueFrom.fieldRef.fieldPath "
            "status.podIP), as the operator's trainer pods do"
        )
    log.warning(
        "$%s is not set: the live channels listen on 127.0.0.1, so only replicas on this host can use them (the "
        "coordinator plans the others on the volume); set %s to this host's address to serve other hosts",
        POD_IP_ENV,
        POD_IP_ENV,
    )
    return "127.0.0.1"


class Publisher:
    """Publishes a source's weights to the job's fleet through its coordinator; see the module docstring."""

    def __init__(
        self,
        source: WeightSource,
        client: CoordinatorClient | None,
        *,
        job: str,
        trainer_id: str = "trainer-0",
        rank: int = 0,
        channels_: Sequence[Channel] = (Channel.CPU, Channel.VOLUME),
        host: str = "127.0.0.1",
        node: str = "",
        device: str = "cpu",
        checkpoint_dir: str | os.PathLike[str] | None = None,
        volume_id: str = "",
        nccl_domain: str = "",
        config: jobconfig.JobConfig | None = None,
        timeout_s: float = 120.0,
        version_timeout_s: float = 600.0,
        verify: bool = True,
        metrics: PublisherMetrics | None = None,
    ) -> None:
        """``client`` is used on rank 0 only (pass None elsewhere). ``host`` is the address replicas reach this
        process at (the pod's IP); every rendezvous listens there only. ``node`` names the machine (IPC needs
        the replica on the same one). ``timeout_s`` bounds each transfer wait (a stalled peer is given up after
        it), ``version_timeout_s`` the wait for a version's verdict."""
        self.source, self.client, self.rank = source, client, rank
        self.timeout_s, self.version_timeout_s, self.verify, self.metrics = (
            timeout_s,
            version_timeout_s,
            verify,
            metrics,
        )
        self.every_steps = config.every_steps if config else 1
        self.table: TensorTable = source.table()
        self.summary = models.summarize(self.table, verify)
        self.senders: dict[Channel, Sender] = {}
        self.volume: VolumeSender | None = None
        self.copies: VolumeCopies | None = None
        # every rank writes its own shards when the layout allows (a collective: decided alike on every rank)
        self.sharded = shard_copies.sharded_copies(source, checkpoint_dir, client, verify, timeout_s)
        # a collective too: every rank reads the layout, the ranks compare; the other ranks wait in a round's
        # broadcast while rank 0 opens the version and its replicas join (bounded by the version's timeout)
        self.regions = _region_sends(source, rank, version_timeout_s, torch.device(device))
        if rank != 0:
            return
        if client is None:
            raise PermanentError("the publisher's rank 0 needs a coordinator client")
        dev = torch.device(device)
        volume = Path(checkpoint_dir) if checkpoint_dir else None
        found = self._discover(dev, node, nccl_domain or (config.nccl_domain if config else ""), volume, job, volume_id)
        offered, why = rules.usable(
            channels_, found, sends=True, nccl_transport=nccl.transport(), nixl_memory=nixl.memory()
        )
        for ch, reason in why.items():
            log.warning("not offering %s: %s", ch.value, reason)
        sender_config = SenderConfig(host=host, device=device, timeout_s=timeout_s, root=str(volume or ""))
        for ch in offered:
            sender = channels.sender_class(ch).create(sender_config)
            if isinstance(sender, VolumeSender):
                self.volume = sender
            else:
                self.senders[ch] = sender
        if not self.senders and self.volume is None:
            raise PermanentError(f"this trainer can send none of the job's channels {[c.value for c in channels_]}")
        self.copies = self.sharded or VolumeCopies(self.volume, client, self.table, verify, source.groups)
        from weightsync.channels import batched

        batched.warm(dev)  # the digest kernel compiles now, not inside the first version's stream

        caps = dataclasses.replace(
            found,
            channels=tuple(self._all_senders()),
            nixl=Channel.NIXL in self.senders,
            rank_gpu_uuids=self.regions.gpus if self.regions is not None else (),
        )
        policy = models.JobPolicy.of(config) if config else None
        offers = self._offers()
        layout = self.regions.layout if self.regions is not None else None
        until_registered(
            lambda: client.register_trainer(job, trainer_id, caps, policy=policy, offers=offers, layout=layout),
            f"trainer {trainer_id}",
        )

    @staticmethod
    def _discover(
        dev: torch.device, node: str, domain: str, volume: Path | None, job: str, volume_id: str
    ) -> models.Capabilities:
        """What this trainer process can send from, for ``channels.rules`` (its channels are filled in after)."""
        from weightsync.channels import gpu

        cuda = dev.type == "cuda"
        return models.Capabilities(
            host=node or socket.gethostname(),
            gpu_uuids=(gpu.uuid(dev),) if cuda else (),
            nccl_domain=domain,
            nixl=importlib.util.find_spec("nixl") is not None,
            volume_id=volume_id or (job if volume else ""),
            volume_mount=str(volume or ""),
            engine=models.EngineKind.GPU if cuda else models.EngineKind.CPU,
        )

    def _all_senders(self) -> dict[Channel, Sender]:
        return {**self.senders, **({Channel.VOLUME: self.volume} if self.volume else {})}

    def _offers(self) -> list[channels.base.Offer]:
        return [s.offer() for s in self._all_senders().values()]

    @classmethod
    def from_env(
        cls, source: WeightSource, env: Mapping[str, str] = os.environ, *, metrics: PublisherMetrics | None = None
    ) -> Publisher:
        """Everything from what the operator injects into a trainer pod (docs/kubernetes.md):
        ``WEIGHTSYNC_COORDINATOR``, ``WEIGHTSYNC_TOKEN``, ``WEIGHTSYNC_TLS_CA`` (or ``WEIGHTSYNC_INSECURE=1``
        for a local run), ``WEIGHTSYNC_CONFIG`` (job.json), ``WEIGHTSYNC_CHECKPOINT_DIR``, ``RANK``,
        ``POD_NAME``, ``POD_IP`` (required in a pod: ``pod_ip``), ``NODE_NAME``, and ``LOCAL_RANK`` for the GPU when
        CUDA is available."""
        config = jobconfig.load(env.get(jobconfig.ENV))
        if config is None:
            raise PermanentError(f"${jobconfig.ENV} names no job config; the operator sets it in trainer pods")
        rank = int(env.get("RANK", "0"))
        device = f"cuda:{int(env.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
        client = None
        if rank == 0:
            insecure = env.get("WEIGHTSYNC_INSECURE") == "1"
            client = CoordinatorClient(
                env["WEIGHTSYNC_COORDINATOR"],
                token=env.get(auth.TOKEN_ENV),
                tls=None if insecure else TlsConfig(ca_file=env.get("WEIGHTSYNC_TLS_CA")),
                insecure=insecure,
            )
        return cls(
            source,
            client,
            job=config.job,
            trainer_id=env.get("POD_NAME", socket.gethostname()),
            rank=rank,
            channels_=config.channels,
            host=pod_ip(env),
            node=env.get("NODE_NAME", ""),
            device=device,
            checkpoint_dir=env.get("WEIGHTSYNC_CHECKPOINT_DIR") or config.checkpoint_dir or None,
            config=config,
            timeout_s=config.transfer_timeout_s,
            version_timeout_s=config.timeout_s,
            metrics=metrics,
        )

    # ---- one version --------------------------------------------------------------------------------------------

    def publish(self, step: int) -> PublishReport | None:
        """Publish the source's current weights as a new version (on every rank); rank 0 returns the report.

        The phases (``phases``) each return what they did; the report is made of their results."""
        if self.sharded is not None:
            with self.sharded.round():  # every rank takes part in this publish's volume copy, once
                return self._publish(step)
        return self._publish(step)

    def _publish(self, step: int) -> PublishReport | None:
        if self.rank != 0:
            if self.regions is None:
                phases.take_part(self.source)
                return None
            told = self.regions.round()  # rank 0's word: what this publish sends, and whether a gather follows
            theirs = self.regions.start(told)
            if told.gather:
                phases.take_part(self.source)
            theirs.result()
            return None
        assert self.client is not None and self.copies is not None
        t0 = time.perf_counter()
        try:
            opened = phases.open_version(
                self.client,
                self.source,
                step,
                self.summary,
                self._offers(),
                timeout_s=self.timeout_s,
                gather_on_failure=self.regions is None,
            )
        except WeightsyncError:
            self._nothing_this_round()  # the other ranks wait for rank 0's word: they go on, this rank raises
            raise
        if isinstance(opened, phases.Unpublished):
            self._nothing_this_round()
            seconds = {"open": opened.seconds, "total": time.perf_counter() - t0}
            return self._report(0, step, VersionState.FAILED, seconds, reason=opened.reason)
        version, plan = opened.version, opened.opened
        # the replicas the plan sends regions join their region groups, not the CPU stream's
        sharded = region_sends.targets(plan)
        sent_regions = {t.replica_id for t in sharded}
        gathered = dataclasses.replace(plan, plans=tuple(p for p in plan.plans if p.replica_id not in sent_regions))
        receivers = {ch: sorted(gathered.receivers(ch)) for ch in self.senders}
        keep = self.volume is not None and self.sharded is None  # a sharded copy snapshots each rank's own shards
        # nobody gathers when every replica takes regions and no gathered copy is kept
        gather = self.regions is None or keep or any(receivers.values())
        sending: region_sends.InFlight | None = None
        if self.regions is not None:  # every rank sends its regions while the gathered path joins and streams
            sending = self.regions.start(self.regions.round(region_sends.Round(version, gather, sharded)))
        lost = phases.LostReports(self.client, version)
        joined = phases.join(self.client, self.senders, gathered, lost)
        tickets = {ch: self._ticket(version, ch, step) for ch in joined.live}
        if gather:
            streamed = phases.stream(self.source, joined.live, tickets, receivers, keep, lost)
        else:
            lost.close()
            streamed = phases.Streamed({}, {}, [], 0.0)
        regioned = (sending.result() if sending is not None else None) or region_sends.Sent()
        if sharded:
            sent_to = sorted(regioned.digests)
            log.info("v%d: regions sent to %s, bytes per trainer rank %s", version, sent_to, regioned.bytes_sent)
        failed = {**streamed.failed, **joined.lost, **regioned.failed}
        digest = streamed.content_digest
        verdict = phases.settle(
            self.client,
            self.copies,
            version,
            step,
            digest,
            failed,
            streamed.snapshot,
            self.version_timeout_s,
            regioned.digests,
        )
        released = phases.release(joined.live, receivers, version, self.timeout_s)
        seconds = {
            "open": opened.seconds,
            "joined": joined.seconds,
            **({"regions": regioned.seconds} if sharded else {}),
            "stream": streamed.seconds,
            **({"durable": verdict.durable_seconds} if verdict.durable_seconds else {}),
            "verdict": verdict.seconds,
            "release": released.seconds,
            "total": time.perf_counter() - t0,
        }
        if self.metrics:
            self.metrics.observe_publish(seconds["total"], next(iter(joined.live), Channel.VOLUME))
        failed.update(released.failed)
        return self._report(version, step, verdict.state, seconds, verdict.channels, failed, digest, verdict.reason)

    def _nothing_this_round(self) -> None:
        """Rank 0 opened no version: tell the ranks that wait for its round (nothing to send, no gather)."""
        if self.regions is not None:
            self.regions.send(self.regions.round(region_sends.Round(0, gather=False)))

    def _ticket(self, version: int, channel: Channel, step: int) -> UpdateTicket:
        return UpdateTicket(
            version,
            channel,
            self.table,
            self.summary.layout_digest,
            step=step,
            verify=self.verify,
            timeout_s=self.timeout_s,
        )

    def _report(
        self,
        version: int,
        step: int,
        state: VersionState,
        seconds: dict[str, float],
        channels_: dict[str, str] | None = None,
        failed: dict[str, str] | None = None,
        digest: str = "",
        reason: str = "",
    ) -> PublishReport:
        if self.metrics:
            self.metrics.versions_published_total.labels(state.value).inc()
        return PublishReport(
            version,
            step,
            state,
            self.table.total_bytes,
            len(self.table),
            channels_ or {},
            seconds,
            failed or {},
            digest,
            reason,
        )

    # ---- the durable copy -----------------------------------------------------------------------------------------

    @property
    def durable_errors(self) -> list[str]:
        """Every volume copy that failed ("version N: why")."""
        return self.copies.errors if self.copies is not None else []

    def wait_durable(self, timeout_s: float | None = None) -> None:
        """Block until the last version's background volume copy has landed (or failed)."""
        copies = self.copies or self.sharded  # a rank other than 0 writes its own shards of a sharded copy
        if copies is not None:
            copies.wait(timeout_s)

    def close(self) -> None:
        self.wait_durable()
        if self.sharded is not None:
            self.sharded.close()
        if self.regions is not None:
            self.regions.close()
        for sender in self._all_senders().values():
            sender.close()
        if self.client is not None:
            self.client.close()


ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def publish_adapter(source: LoraAdapterSource, volume: VolumeSender, version: int, step: int) -> SendReport:
    """Write a LoRA adapter as a volume version laid out as a PEFT folder (one file + its config).

    The replica verifies it like any volume version, then hands the folder to vLLM's LoRA
    loader; the base weights never change.
    """
    ticket = UpdateTicket(
        version,
        Channel.VOLUME,
        source.table(),
        step=step,
        shard_name=ADAPTER_FILE,
        files={ADAPTER_CONFIG: source.adapter_config()},
    )
    return send(source, volume, ticket)
