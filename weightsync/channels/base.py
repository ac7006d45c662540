"""The channel contract: a sender on the trainer, a receiver beside the engine.

Every channel moves the same thing: the tensors of one ``TensorTable``, group by
group, in table order. A sender is handed the trainer's tensors one group at a
time (so a sharded trainer gathers one layer group, sends it, and frees it); a
receiver yields each group as ``(spec, tensor)`` pairs, already checked against the
trainer's digests when the ticket asks for verification, so the engine loads only
bytes that are known to be whole. Both ends hold their connection across versions
and are closed explicitly.

An ``UpdateTicket`` is everything the receiving side needs for one version; it
crosses process boundaries as a plain dict (vLLM's ``update_info``) and validates
itself when parsed back.
"""

from __future__ import annotations

import datetime
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed

from weightsync.errors import IntegrityError, PermanentError, TransferTimeoutError
from weightsync.tensors import TensorSpec, TensorTable
from weightsync.vocabulary import Channel

# The process-group and store classes the channels use (TCPStore, PrefixStore, the gloo and
# NCCL backends) are public in practice but missing from torch's type stubs; one Any-typed
# handle keeps every channel module strictly checked otherwise.
dist: Any = torch.distributed


def tcp_store(host: str, port: int, master: bool, timeout_s: float) -> Any:
    """A channel's own rendezvous store (port 0 on the master picks a free one); never the global group's."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, None, is_master=master, timeout=timeout, wait_for_workers=False)


def wait_key(store: Any, key: str, timeout_s: float, what: str, channel: Channel) -> bytes:
    """A store key's value, or ``TransferTimeoutError`` naming what did not arrive."""
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TransferTimeoutError(
            f"{channel.value} channel: {what} did not arrive within {timeout_s:.1f}s: {e}"
        ) from e
    return bytes(store.get(key))


TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES: Mapping[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

Group = list[tuple[TensorSpec, torch.Tensor]]


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise PermanentError(f"dtype {dtype} cannot travel; supported: {', '.join(TORCH_DTYPES)}") from None


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def view_from_bytes(buffer: torch.Tensor, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    """The tensor ``spec`` viewed in place inside ``buffer`` (which starts at stream offset ``base``)."""
    start = spec.offset - base
    raw = buffer[start : start + spec.nbytes]
    return raw.view(TORCH_DTYPES[spec.dtype]).reshape(spec.shape)


def fits_in_place(spec: TensorSpec, device: torch.device, view: torch.Tensor | None) -> bool:
    """True when ``spec``'s bytes can be received straight into ``view`` (a destination parameter)."""
    return (
        view is not None
        and view.device == device
        and view.dtype == TORCH_DTYPES[spec.dtype]
        and tuple(view.shape) == spec.shape
        and view.is_contiguous()
    )


def check_tensor(spec: TensorSpec, tensor: torch.Tensor) -> None:
    """Raise naming the tensor when the sender's tensor does not match its spec."""
    if tuple(tensor.shape) != spec.shape or tensor.dtype != TORCH_DTYPES[spec.dtype]:
        raise PermanentError(
            f"tensor {spec.name!r}: got dtype {dtype_name(tensor.dtype)} shape {list(tensor.shape)}, "
            f"the table says dtype {spec.dtype} shape {list(spec.shape)}"
        )


@dataclass(frozen=True)
class UpdateTicket:
    """What a receiver needs for one version: the table and the channel's parameters."""

    version: int
    channel: Channel
    table: TensorTable
    step: int = 0
    verify: bool = True
    timeout_s: float = 300.0
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version < 1:
            raise PermanentError(f"version must be >= 1, got {self.version}")
        if self.timeout_s <= 0:
            raise PermanentError(f"timeout_s must be positive, got {self.timeout_s}")

    def to_update_info(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "channel": self.channel.value,
            "step": self.step,
            "verify": self.verify,
            "timeout_s": self.timeout_s,
            "table": self.table.to_dict(),
            "params": dict(self.params),
        }

    @classmethod
    def from_update_info(cls, info: Mapping[str, Any]) -> UpdateTicket:
        try:
            return cls(
                version=int(info["version"]),
                channel=Channel.parse(str(info["channel"])),
                table=TensorTable.from_dict(info["table"]),
                step=int(info.get("step", 0)),
                verify=bool(info.get("verify", True)),
                timeout_s=float(info.get("timeout_s", 300.0)),
                params=dict(info.get("params", {})),
            )
        except KeyError as e:
            raise PermanentError(f"update_info lacks field {e.args[0]!r}") from None


def init_field(init: Mapping[str, Any], key: str, channel: Channel) -> Any:
    """A required ``init_info`` field, or an error naming it."""
    try:
        return init[key]
    except KeyError:
        raise PermanentError(f"{channel.value} channel: init_info lacks {key!r} (got {sorted(init)})") from None


def verify_group(group: Group, expected: Mapping[str, str]) -> dict[str, str]:
    """Digest each received tensor and compare with the trainer's; raise naming the first mismatch."""
    from weightsync.channels import digests

    got: dict[str, str] = {}
    for spec, tensor in group:
        digest = digests.digest(tensor)
        want = expected.get(spec.name) or spec.digest
        if want and digest != want:
            raise IntegrityError(
                f"tensor {spec.name!r}: received digest {digest}, the trainer sent {want}; "
                "the bytes were altered in transit, the update is refused"
            )
        got[spec.name] = digest
    return got


class Sender(ABC):
    """Trainer side of a channel. ``send`` is called on the sending rank only."""

    channel: ClassVar[Channel]

    @abstractmethod
    def send(self, ticket: UpdateTicket, groups: Iterable[Sequence[torch.Tensor]]) -> dict[str, str]:
        """Send every group of ``ticket.table``; ``groups`` yields the tensors of each group in order.

        Returns the per-tensor digests when ``ticket.verify`` is set (else an empty dict).
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default holds none."""


@dataclass(frozen=True)
class WorkerContext:
    """Where a receiver runs: one worker of one replica (tensor-parallel rank ``rank`` of ``world_size``)."""

    rank: int = 0
    world_size: int = 1
    device: str = "cpu"


class Receiver(ABC):
    """Engine side of a channel.

    Built inside a vLLM worker from the plain-dict ``init_info`` the trainer side handed
    out (``from_init``), then fed one ``UpdateTicket`` per version.
    """

    channel: ClassVar[Channel]
    verified: dict[str, str]
    """Digests checked during the last ``receive`` (tensor name -> digest); reset by each ``receive``."""
    table: TensorTable | None = None
    """The table the last ``receive`` delivered: the ticket's, or the one the channel carried itself
    (the volume's manifest, the stream's header), so a ticket may name only the version."""

    @classmethod
    @abstractmethod
    def from_init(cls, init: Mapping[str, Any], ctx: WorkerContext) -> Receiver:
        """Build (and rendezvous) from vLLM's ``init_info``; raise naming a missing or bad field."""

    @abstractmethod
    def receive(self, ticket: UpdateTicket, destinations: Mapping[str, torch.Tensor] | None = None) -> Iterator[Group]:
        """Yield each group of ``ticket.table`` in order, verified when ``ticket.verify`` is set.

        ``destinations`` maps trainer tensor names to views of the engine's own
        parameters (fused q/k/v and gate/up row slices included) with the same dtype and
        shape. A channel that can receive in place writes those tensors straight into
        their views and does not yield them; the others ignore it. Views yielded may be
        reused for the next group: consume them before advancing.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default holds none."""
