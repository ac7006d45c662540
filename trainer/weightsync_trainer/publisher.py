"""Publishing a version: one collective call on every trainer rank, every planned channel from one gather.

From a trainer pod, everything comes from the environment the operator injects::

    publisher = Publisher.from_env(ModuleSource(model))    # coordinator, token, CA, job, rank, checkpoint dir
    for step in range(steps):
        train_step()
        if step % publisher.every_steps == 0:
            report = publisher.publish(step)               # on every rank: FSDP2 gathers are collective
    publisher.close()

``publish(step)`` on the sending rank (rank 0; the other ranks only take part in the
gather):

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

A coordinator outage does not stop training: the client retries until its deadline
and registers again after a restart; when the coordinator stays unreachable,
``publish`` returns a report instead of raising: FAILED with version 0 (the step was
not published; the next publish sends a whole version anyway), or STAGING with the
reason when it became unreachable after the bytes went out (the outcome is unknown).

The publisher registers with what it discovers: the node it runs on, its GPU's UUID,
the job's NCCL domain, whether NIXL is importable, the checkpoint volume. It offers
every channel of the job it can send; the coordinator negotiates only those. The
checkpoint volume is pruned by the coordinator (it knows which version is the newest
durable READY one), never by the writer.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync import channels, jobconfig
from weightsync.channels import manifests
from weightsync.channels.base import Sender, SenderConfig, SendReport, UpdateTicket
from weightsync.channels.volume import VolumeSender
from weightsync.coordinator import auth, models
from weightsync.coordinator.client import CoordinatorClient, until_registered
from weightsync.coordinator.tls import TlsConfig
from weightsync.errors import PermanentError, RetryableError, WeightsyncError
from weightsync.metrics import PublisherMetrics
from weightsync.tensors import TensorTable, content_digest, manifest_checksum
from weightsync.vocabulary import Channel, ReplicaState, VersionState
from weightsync_trainer.sources import LoraAdapterSource, WeightSource

log = logging.getLogger(__name__)
READY_AFTER_TIMEOUT_S = 1.0
"""How long a sender's groups may still take to form once the wait for joins ran out: its receivers had the
whole transfer timeout to join, and a joined receiver's group forms with its join."""


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


def take_part(source: WeightSource) -> None:
    """Iterate the gather without sending: what every rank that does not send does (gathers are collective)."""
    for _ in source.groups():
        pass


def send(source: WeightSource, sender: Sender, ticket: UpdateTicket, rank: int = 0) -> SendReport:
    """One gather of ``source`` into one sender, collective on every rank (only rank 0 sends).

    The building block for tools and benchmarks that drive a channel without a coordinator.
    """
    if rank != 0:
        take_part(source)
        return SendReport()
    return sender.send(ticket, source.groups())


def _feasible(channel: Channel, device: torch.device, nccl_domain: str, volume: Path | None) -> str:
    """Why this process cannot send ``channel`` (empty when it can)."""
    cuda = device.type == "cuda"
    if channel is Channel.VOLUME and volume is None:
        return "no checkpoint directory"
    if channel is Channel.IPC and not cuda:
        return "the trainer's weights are not on a GPU"
    if channel is Channel.NIXL and not (cuda and importlib.util.find_spec("nixl") is not None):
        return "NIXL is not importable or the weights are not on a GPU"
    if channel is Channel.NCCL:
        from weightsync.channels import nccl

        if not nccl_domain:
            return "the job has no NCCL domain"
        if not cuda and nccl.transport() == "nccl":
            return "the trainer's weights are not on a GPU"
    return ""


class _Tee:
    """One gather feeding several senders, each on its own thread through its own queue.

    The queues are unbounded so that the gather never waits for the slowest channel: a sender stalled on a dead
    peer (until its transfer timeout) must not hold back the groups of the others, whose receivers would time out
    too. The cost is memory only where the source materialises groups (a DTensor's gather): a stalled channel
    keeps references to the groups it has not sent until it fails."""

    def __init__(self, jobs: Mapping[Channel, tuple[Sender, UpdateTicket]]) -> None:
        self.queues: dict[Channel, queue.Queue[Sequence[torch.Tensor] | None]] = {}
        self.reports: dict[Channel, SendReport] = {}
        self.errors: dict[Channel, BaseException] = {}
        self.threads: dict[Channel, threading.Thread] = {}
        for ch, (sender, ticket) in jobs.items():
            q: queue.Queue[Sequence[torch.Tensor] | None] = queue.Queue()
            self.queues[ch] = q
            self.threads[ch] = threading.Thread(
                target=self._run, args=(ch, sender, ticket, q), name=f"weightsync-send-{ch.value}", daemon=True
            )
            self.threads[ch].start()

    def _run(
        self, ch: Channel, sender: Sender, ticket: UpdateTicket, q: queue.Queue[Sequence[torch.Tensor] | None]
    ) -> None:
        def groups() -> Iterator[Sequence[torch.Tensor]]:
            while (item := q.get()) is not None:
                yield item

        try:
            self.reports[ch] = sender.send(ticket, groups())
        except BaseException as e:  # noqa: BLE001 - reported for this channel's receivers
            self.errors[ch] = e

    def put(self, group: Sequence[torch.Tensor] | None) -> None:
        for ch, q in self.queues.items():
            if self.threads[ch].is_alive():
                q.put(group)

    def join(self) -> None:
        self.put(None)
        for t in self.threads.values():
            t.join()


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
        self.durable_errors: list[str] = []
        self._writer: threading.Thread | None = None
        if rank != 0:
            return
        if client is None:
            raise PermanentError("the publisher's rank 0 needs a coordinator client")
        dev = torch.device(device)
        volume = Path(checkpoint_dir) if checkpoint_dir else None
        domain = nccl_domain or (config.nccl_domain if config else "")
        sender_config = SenderConfig(host=host, device=device, timeout_s=timeout_s, root=str(volume or ""))
        for ch in channels_:
            why = _feasible(ch, dev, domain, volume)
            if why:
                log.warning("not offering %s: %s", ch.value, why)
                continue
            sender = channels.sender_class(ch).create(sender_config)
            if isinstance(sender, VolumeSender):
                self.volume = sender
            else:
                self.senders[ch] = sender
        if not self.senders and self.volume is None:
            raise PermanentError(f"this trainer can send none of the job's channels {[c.value for c in channels_]}")
        from weightsync.channels import batched, gpu

        batched.warm(dev)  # the digest kernel compiles now, not inside the first version's stream

        caps = models.Capabilities(
            host=node or socket.gethostname(),
            gpu_uuids=(gpu.uuid(dev),) if dev.type == "cuda" else (),
            channels=tuple(self._all_senders()),
            nccl_domain=domain,
            nixl=Channel.NIXL in self.senders,
            volume_id=volume_id or (job if volume else ""),
            volume_mount=str(volume or ""),
            engine=models.EngineKind.GPU if dev.type == "cuda" else models.EngineKind.CPU,
        )
        policy = models.JobPolicy.of(config) if config else None
        offers = self._offers()
        until_registered(
            lambda: client.register_trainer(job, trainer_id, caps, policy=policy, offers=offers),
            f"trainer {trainer_id}",
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
        ``POD_NAME``, ``POD_IP``, ``NODE_NAME``, and ``LOCAL_RANK`` for the GPU when CUDA is available."""
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
            host=env.get("POD_IP", "127.0.0.1"),
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
        """Publish the source's current weights as a new version (on every rank); rank 0 returns the report."""
        if self.rank != 0:
            take_part(self.source)
            return None
        assert self.client is not None
        t0 = time.perf_counter()
        try:
            # as long as a transfer may take: a restarted coordinator holds opens for a lease TTL
            opened = self.client.open_version(step, self.summary, offers=self._offers(), timeout_s=self.timeout_s)
        except WeightsyncError as e:
            take_part(self.source)  # the other ranks are in the gather: take part, then fail
            if not isinstance(e, RetryableError):
                raise
            # the coordinator is down or unreachable past the client's deadline: training goes on, and the
            # next publish (a whole version) makes up for this one
            log.warning("step %d not published: the coordinator is unreachable (%s)", step, e)
            reason = f"not published: the coordinator is unreachable ({e})"
            return self._report(0, step, VersionState.FAILED, {"total": time.perf_counter() - t0}, reason=reason)
        version = opened.version
        seconds = {"open": time.perf_counter() - t0}
        live = {ch: s for ch, s in self.senders.items() if opened.receivers(ch)}
        for ch, sender in self.senders.items():
            sender.take_plan(opened.receivers(ch))
        lost: dict[str, str] = {}
        if live:
            joined, dropped = True, set()
            try:
                info = self.client.wait_receivers_joined(version, self.timeout_s)
                dropped = {r.replica_id for r in info.replicas if r.state is ReplicaState.DROPPED}
            except WeightsyncError as e:
                log.warning("v%d: %s; sending to those that joined", version, e)
                joined = False
            for ch, sender in list(live.items()):
                # formed once its receivers joined; one that is not does not get to stall the others, nor does one
                # the coordinator dropped before it joined (its lease ran out: it never will)
                settled = joined and not dropped.intersection(opened.receivers(ch))
                try:
                    sender.ready(self.timeout_s if settled else READY_AFTER_TIMEOUT_S)
                except WeightsyncError as e:
                    log.warning("v%d: the %s sender is not ready: %s", version, ch.value, e)
                    lost.update({rid: f"{ch.value}: {e}" for rid in opened.receivers(ch)})
                    del live[ch]
        t1 = time.perf_counter()
        seconds["joined"] = t1 - t0 - seconds["open"]
        digests, failed, snapshot = self._stream(version, step, live, opened)
        failed.update(lost)
        seconds["stream"] = time.perf_counter() - t1
        digest = content_digest(digests) if digests else ""
        t2 = time.perf_counter()
        try:
            info = self.client.report_sent(version, digest, failed, wait_s=self.version_timeout_s)
            if info.durable_needed:
                t3 = time.perf_counter()
                volume_error = self._write_durable(version, step, snapshot)
                seconds["durable"] = time.perf_counter() - t3
                if volume_error:  # the replicas waiting for it fail now, not at the version's timeout
                    self.client.report_sent(version, digest, failed, volume_error=volume_error)
                info = self.client.wait_version(version, self.version_timeout_s)
            else:
                self._write_durable_later(version, step, snapshot)
            state, reason = info.state, info.reason
            channels_ = {r.replica_id: r.channel.value for r in info.replicas if r.channel is not None}
        except RetryableError as e:
            # the bytes went out peer to peer; only the verdict is missing. A restarted coordinator fails the
            # version (its plans died with it); one that was only unreachable may still settle it.
            log.warning("v%d: the coordinator became unreachable mid-publish (%s); its outcome is unknown", version, e)
            self._write_durable_later(version, step, snapshot)
            state, reason, channels_ = (
                VersionState.STAGING,
                f"outcome unknown: the coordinator is unreachable ({e})",
                {},
            )
        t4 = time.perf_counter()
        seconds["verdict"] = t4 - t2 - seconds.get("durable", 0.0)
        for ch, sender in live.items():
            try:
                sender.release(version, self.timeout_s)
            except WeightsyncError as e:
                failed.update({rid: f"{ch.value}: {e}" for rid in opened.receivers(ch)})
        seconds["release"] = time.perf_counter() - t4
        seconds["total"] = time.perf_counter() - t0
        if self.metrics:
            self.metrics.observe_publish(seconds["total"], next(iter(live), Channel.VOLUME))
        return self._report(version, step, state, seconds, channels_, failed, digest, reason)

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

    def _stream(
        self, version: int, step: int, live: Mapping[Channel, Sender], opened: models.OpenedVersion
    ) -> tuple[dict[str, str], dict[str, str], list[list[torch.Tensor]]]:
        """Gather once; feed every live sender; keep a copy of each group for the volume."""
        snapshot: list[list[torch.Tensor]] = []
        keep = self.volume is not None

        def gathered() -> Iterator[list[torch.Tensor]]:
            for group in self.source.groups():
                if keep:
                    snapshot.append([t.detach().clone() for t in group])
                yield group

        def ticket(ch: Channel) -> UpdateTicket:
            return UpdateTicket(
                version,
                ch,
                self.table,
                self.summary.layout_digest,
                step=step,
                verify=self.verify,
                timeout_s=self.timeout_s,
            )

        reports: dict[Channel, SendReport] = {}
        errors: dict[Channel, BaseException] = {}
        if len(live) == 1:
            ch, sender = next(iter(live.items()))
            source = gathered()
            try:
                reports[ch] = sender.send(ticket(ch), source)
            except Exception as e:  # noqa: BLE001 - reported for this channel's receivers; the gather goes on
                errors[ch] = e
            for _ in source:  # a failed sender stops early; the gather (collective) goes on
                pass
        else:
            tee = _Tee({ch: (s, ticket(ch)) for ch, s in live.items()})
            for group in gathered():
                tee.put(group)
            tee.join()
            reports, errors = tee.reports, tee.errors
        failed: dict[str, str] = {}
        digests: dict[str, str] = {}
        for report in reports.values():
            failed.update(report.failed)
            digests = digests or report.digests
        for ch, error in errors.items():
            log.warning("v%d: the %s sender failed: %s", version, ch.value, error)
            failed.update({rid: f"{ch.value}: {error}" for rid in opened.receivers(ch)})
        return digests, failed, snapshot

    # ---- the durable copy -----------------------------------------------------------------------------------------

    def _write_durable(self, version: int, step: int, snapshot: Sequence[Sequence[torch.Tensor]]) -> str:
        """Write ``snapshot`` as ``version`` on the volume and mark it durable at the coordinator; why not, if not."""
        assert self.client is not None
        if self.volume is None:
            error = "a replica waits for the volume, which is not configured"
            self.durable_errors.append(f"version {version}: {error}")
            return error
        try:
            groups: Iterable[Sequence[torch.Tensor]] = snapshot if snapshot else self.source.groups()
            ticket = UpdateTicket(version, Channel.VOLUME, self.table, step=step, verify=self.verify)
            written = self.volume.send(ticket, groups).digests
            path = manifests.manifest_path(self.volume.root, version)
            # what was written, for the replicas that load it from there: a version no live channel carried
            # is checked against the trainer's digest too
            digest = content_digest(written) if written else ""
            self.client.mark_durable(version, str(path), manifest_checksum(path.read_bytes()), digest)
        except (WeightsyncError, OSError) as e:
            log.error("v%d: the volume copy failed: %s", version, e)
            self.durable_errors.append(f"version {version}: {e}")
            return str(e)
        return ""

    def _write_durable_later(self, version: int, step: int, snapshot: list[list[torch.Tensor]]) -> None:
        if self.volume is None or not snapshot:
            return
        self.wait_durable()
        self._writer = threading.Thread(
            target=self._write_durable,
            args=(version, step, snapshot),
            name=f"weightsync-durable-v{version}",
            daemon=True,
        )
        self._writer.start()

    def wait_durable(self, timeout_s: float | None = None) -> None:
        """Block until the last version's background volume copy has landed (or failed)."""
        if self._writer is not None:
            self._writer.join(timeout_s)

    def close(self) -> None:
        self.wait_durable()
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
        params={"shard_name": ADAPTER_FILE, "files": {ADAPTER_CONFIG: source.adapter_config()}},
    )
    return send(source, volume, ticket)
