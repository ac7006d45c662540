"""What the GPU channels share: wire tensors on the device, and bounded waits on GPU work.

A trainer may hold fp32 master weights while the engine serves bf16: the cast
happens on the trainer's GPU, before the bytes travel, so the wire carries the
table's dtype and half the bytes. A tensor already in the wire dtype, contiguous and
on the device is sent as it is (no copy).

GPU work completes asynchronously, and a collective whose peer died never
completes at all. ``wait`` polls the work's completion from the CPU against a
deadline and, when it passes, runs the channel's abort (which tears the
communicator down so the stuck kernel returns) before raising
``TransferTimeoutError``: the trainer gets a clear error within its timeout instead
of a hang. It spins briefly before it sleeps between polls, which a paused engine
can afford; a stage receiving beside generation (``in_background``) never spins and
polls every 5 ms: each poll takes the GIL that the engine's own thread needs to launch
its next step (bench/staged_switch.py --throughput --graph, H200, Qwen3-1.7B: a decode
stand-in kept 0.75 of its steps/s with spinning polls, 0.78 polling every 1 ms, 0.86
every 5 ms, while each version took ~70 ms instead of ~43 ms to stage).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from weightsync.channels.wire import TORCH_DTYPES, dtype_name
from weightsync.errors import PermanentError, TransferTimeoutError
from weightsync.tensors import TensorSpec, align

_SPIN_S = 0.002
"""Busy-poll this long before sleeping between polls: most waits end within a layer group's time."""
_SLEEP_S = 0.0002
_BACKGROUND_SLEEP_S = 0.005
_background = threading.local()


@contextlib.contextmanager
def in_background() -> Iterator[None]:
    """This thread's waits sleep from the first poll, 5 ms at a time (its work runs beside the engine's)."""
    _background.on = True
    try:
        yield
    finally:
        _background.on = False


class Completable(Protocol):
    def is_completed(self) -> bool: ...


def cuda_device(device: str | int | torch.device) -> torch.device:
    """A ``cuda:N`` device with its index (vLLM hands ``cuda`` or ``cuda:N``)."""
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise PermanentError(f"GPU channel: device {device!r} is not a CUDA device")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def uuid(device: torch.device) -> str:
    """The GPU's UUID as ``nvidia-smi`` prints it (``GPU-...``): how two processes tell they share a GPU."""
    raw = str(torch.cuda.get_device_properties(device).uuid)
    return raw if raw.startswith("GPU-") else f"GPU-{raw}"


def peers(device: torch.device) -> tuple[str, ...]:
    """The UUIDs of the other GPUs this process sees whose memory ``device`` reads peer-to-peer (NVLink or PCIe P2P):
    where a worker copies a trainer rank's regions itself (``sharding.links.copied``)."""
    return tuple(
        uuid(other)
        for other in (torch.device("cuda", i) for i in range(torch.cuda.device_count()))
        if other.index != device.index and torch.cuda.can_device_access_peer(device.index, other.index)
    )


def check_wire(spec: TensorSpec, tensor: torch.Tensor) -> None:
    """Refuse, naming the tensor, what cannot become ``spec``: another shape, or a non-float dtype change."""
    want = TORCH_DTYPES[spec.dtype]
    if tuple(tensor.shape) != spec.shape or (
        tensor.dtype != want and not (tensor.is_floating_point() and want.is_floating_point)
    ):
        raise PermanentError(
            f"tensor {spec.name!r}: got dtype {dtype_name(tensor.dtype)} shape {list(tensor.shape)}, "
            f"the table says dtype {spec.dtype} shape {list(spec.shape)}"
        )


def wire_group(
    specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """A group's tensors as the table says they travel: on ``device``, in each spec's dtype, contiguous. Floating
    tensors are cast (fp32 master weights to a bf16 wire); one that already matches is returned as it is.

    Those that must change are made in one allocation with one ``_foreach_copy_``, at the same offsets from one
    another every version, so the group's prepared digests are reused (made one by one at new addresses, every
    version prepared each group's digests again: about 0.5 ms of the sender's host time per group)."""
    out: list[torch.Tensor] = []
    convert: list[int] = []
    for i, (spec, tensor) in enumerate(zip(specs, tensors, strict=True)):
        check_wire(spec, tensor)
        ready = tensor.device == device and tensor.dtype == TORCH_DTYPES[spec.dtype] and tensor.is_contiguous()
        out.append(tensor.detach())
        if not ready:
            convert.append(i)
    if convert:
        sizes = [align(specs[i].nbytes) for i in convert]
        raws = torch.split(torch.empty(sum(sizes), dtype=torch.uint8, device=device), sizes)
        views = [
            raw[: specs[i].nbytes].view(TORCH_DTYPES[specs[i].dtype]).view(specs[i].shape)
            for raw, i in zip(raws, convert, strict=True)
        ]
        torch._foreach_copy_(views, [out[i] for i in convert], non_blocking=True)
        for i, view in zip(convert, views, strict=True):
            out[i] = view
    return out


WATCH_S = 0.25
"""How often a wait that is still pending calls its ``watch`` (never within a layer group's usual time)."""


def wait(
    work: Completable,
    timeout_s: float,
    what: str,
    abort: Callable[[], None],
    watch: Callable[[], None] | None = None,
) -> None:
    """Return once ``work`` completed; past ``timeout_s`` call ``abort`` and raise naming ``what``. ``watch``, when
    given, is called every ``WATCH_S`` while the work is pending: it may raise to end the wait early (a member of
    the group was found silent), and the caller decides what becomes of the group then."""
    start = time.monotonic()
    spin, sleep = (0.0, _BACKGROUND_SLEEP_S) if getattr(_background, "on", False) else (_SPIN_S, _SLEEP_S)
    next_watch = WATCH_S
    while not work.is_completed():
        waited = time.monotonic() - start
        if watch is not None and waited >= next_watch:
            watch()
            next_watch = waited + WATCH_S
        if waited > timeout_s:
            abort()
            raise TransferTimeoutError(
                f"{what} did not complete within {timeout_s:.1f}s (a peer died or stalled); "
                "the group was aborted and must be rebuilt with the current members"
            )
        if waited >= spin:
            time.sleep(sleep)
