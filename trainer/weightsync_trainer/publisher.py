"""Publishing a version: one collective call on every trainer rank.

``Publisher.publish`` walks the source's layer groups on every rank (the gathers of a
sharded model are collectives, so all ranks must take part) and hands them to the
channel senders on the sending rank (rank 0). With several senders (e.g. the CPU
stream to live replicas and the checkpoint volume), each group is gathered once and
fed to every sender.

Example loop::

    publisher = Publisher(ModuleSource(model), senders=[sender] if rank == 0 else [], rank=rank)
    for step in range(steps):
        train_step()
        if step % sync_every == 0:
            report = publisher.publish(version=v, step=step)   # on every rank
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

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


class _Tee:
    """Feeds each gathered group to several consumers running in their own threads."""

    def __init__(self, n: int) -> None:
        self._slots: list[list[Sequence[torch.Tensor] | None]] = [[] for _ in range(n)]
        self._cond = threading.Condition()
        self._done = False

    def put(self, group: Sequence[torch.Tensor]) -> None:
        with self._cond:
            for slot in self._slots:
                slot.append(group)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def reader(self, i: int) -> Iterator[Sequence[torch.Tensor]]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._slots[i]) or self._done)
                if not self._slots[i]:
                    return
                group = self._slots[i].pop(0)
            assert group is not None
            yield group


class Publisher:
    """Publishes a source's weights through one or more channel senders."""

    def __init__(
        self, source: WeightSource, senders: Sequence[Sender] = (), rank: int = 0, verify: bool = True
    ) -> None:
        if rank != 0 and senders:
            raise PermanentError(f"only rank 0 sends; rank {rank} was given {len(senders)} senders")
        self.source = source
        self.senders = list(senders)
        self.rank = rank
        self.verify = verify
        self.table: TensorTable = source.table()

    def ticket(self, version: int, step: int, channel: Channel, **params: object) -> UpdateTicket:
        return UpdateTicket(version, channel, self.table, step=step, verify=self.verify, params=params)

    def publish(self, version: int, step: int, tickets: Sequence[UpdateTicket] | None = None) -> PublishReport:
        """Send version ``version`` through every sender (one ticket each, default: built here)."""
        t0 = time.perf_counter()
        if tickets is None:
            tickets = [self.ticket(version, step, s.channel) for s in self.senders]
        if len(tickets) != len(self.senders):
            raise PermanentError(f"{len(tickets)} tickets for {len(self.senders)} senders")
        digests: dict[str, str] = {}
        if len(self.senders) <= 1:
            groups = self.source.groups()
            if self.senders:
                digests = self.senders[0].send(tickets[0], groups)
            else:
                for _ in groups:  # non-sending ranks still take part in every gather
                    pass
        else:
            digests = self._fan_out(tickets)
        return PublishReport(version, step, self.table.total_bytes, len(self.table), time.perf_counter() - t0, digests)

    def _fan_out(self, tickets: Sequence[UpdateTicket]) -> dict[str, str]:
        tee = _Tee(len(self.senders))
        results: list[dict[str, str]] = [{} for _ in self.senders]
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                results[i] = self.senders[i].send(tickets[i], tee.reader(i))
            except BaseException as e:  # noqa: BLE001 - re-raised below on the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(self.senders))]
        for t in threads:
            t.start()
        try:
            for group in self.source.groups():
                tee.put(group)
        finally:
            tee.close()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        merged: dict[str, str] = {}
        for r in results:
            merged.update(r)
        return merged


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
