"""Publishing a version: one collective call on every trainer rank.

``Publisher.publish`` walks the source's layer groups on every rank (the gathers of a
sharded model are collectives, so all ranks must take part) and hands them to the
channel sender on the sending rank (rank 0). To stream to replicas and write the
volume from one gather, use ``weightsync_trainer.fleet.FleetPublisher``.

Example loop::

    publisher = Publisher(ModuleSource(model), senders=[sender] if rank == 0 else [], rank=rank)
    for step in range(steps):
        train_step()
        if step % sync_every == 0:
            report = publisher.publish(version=v, step=step)   # on every rank
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from weightsync.channels.base import Sender, UpdateTicket
from weightsync.channels.digests import table_digest
from weightsync.errors import PermanentError
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel
from weightsync_trainer.sources import LoraAdapterSource, WeightSource


@dataclass
class PublishReport:
    version: int
    step: int
    bytes: int
    tensors: int
    seconds: float
    digests: dict[str, str] = field(default_factory=dict)

    @property
    def table_digest(self) -> str:
        return table_digest(self.digests) if self.digests else ""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class Publisher:
    """Publishes a source's weights through one or more channel senders."""

    def __init__(
        self, source: WeightSource, senders: Sequence[Sender] = (), rank: int = 0, verify: bool = True
    ) -> None:
        if rank != 0 and senders:
            raise PermanentError(f"only rank 0 sends; rank {rank} was given {len(senders)} senders")
        if len(senders) > 1:
            raise PermanentError(
                f"one sender per publisher, got {len(senders)}; FleetPublisher streams to replicas and writes the "
                "volume from one gather"
            )
        self.source = source
        self.senders = list(senders)
        self.rank = rank
        self.verify = verify
        self.table: TensorTable = source.table()

    def ticket(self, version: int, step: int, channel: Channel, **params: object) -> UpdateTicket:
        return UpdateTicket(version, channel, self.table, step=step, verify=self.verify, params=params)

    def publish(self, version: int, step: int, tickets: Sequence[UpdateTicket] | None = None) -> PublishReport:
        """Send version ``version`` through the sender (its ticket: built here unless given)."""
        t0 = time.perf_counter()
        if tickets is None:
            tickets = [self.ticket(version, step, s.channel) for s in self.senders]
        if len(tickets) != len(self.senders):
            raise PermanentError(f"{len(tickets)} tickets for {len(self.senders)} senders")
        digests: dict[str, str] = {}
        groups = self.source.groups()
        if self.senders:
            digests = self.senders[0].send(tickets[0], groups)
        else:
            for _ in groups:  # non-sending ranks still take part in every gather
                pass
        return PublishReport(version, step, self.table.total_bytes, len(self.table), time.perf_counter() - t0, digests)


ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def publish_adapter(source: LoraAdapterSource, volume: Sender, version: int, step: int) -> PublishReport:
    """Write a LoRA adapter as a volume version laid out as a PEFT folder (one file + its config).

    The replica verifies it like any volume version, then hands the folder to vLLM's LoRA
    loader; the base weights never change.
    """
    if volume.channel is not Channel.VOLUME:
        raise PermanentError(f"adapters travel on the volume; got a {volume.channel.value!r} sender")
    publisher = Publisher(source, [volume])
    ticket = publisher.ticket(
        version, step, Channel.VOLUME, shard_name=ADAPTER_FILE, files={ADAPTER_CONFIG: source.adapter_config()}
    )
    return publisher.publish(version, step, [ticket])
