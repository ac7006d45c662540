"""Channels: one module per transport, each holding its sender and its receiver.

Modules load lazily (a CPU-only replica never imports the NCCL code); asking for a
channel that has no implementation names the ones that exist.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from weightsync.vocabulary import Channel

if TYPE_CHECKING:
    from weightsync.channels.base import Receiver, Sender

_MODULES: dict[Channel, str] = {
    Channel.CPU: "weightsync.channels.cpu",
    Channel.VOLUME: "weightsync.channels.volume",
    Channel.NCCL: "weightsync.channels.nccl",
    Channel.IPC: "weightsync.channels.ipc",
    Channel.NIXL: "weightsync.channels.nixl",
}


def _module(channel: Channel | str) -> object:
    ch = channel if isinstance(channel, Channel) else Channel.parse(channel)
    path = _MODULES.get(ch)
    if path is None:
        have = ", ".join(c.value for c in _MODULES)
        raise ValueError(f"channel {ch.value!r} has no implementation here; implemented: {have}")
    return importlib.import_module(path)


def sender_class(channel: Channel | str) -> type[Sender]:
    cls: type[Sender] = _module(channel).SENDER  # type: ignore[attr-defined]
    return cls


def receiver_class(channel: Channel | str) -> type[Receiver]:
    cls: type[Receiver] = _module(channel).RECEIVER  # type: ignore[attr-defined]
    return cls


def implemented() -> list[Channel]:
    return list(_MODULES)
