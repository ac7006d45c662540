"""Copies from another GPU's memory by the copy engines: a worker reading a trainer rank's shard on a peer GPU.

A worker whose process sees a trainer rank's GPU (one host, peer access between the two: NVLink or PCIe P2P) reads
that rank's regions itself, as it reads the rank on its own GPU (``ipc_regions``), but by the GPU's copy engines
instead of a kernel: a copy engine's work is not time-sliced against the kernels of the other processes on the
worker's GPU (2x H200, 1.2 GB over NVLink: 3.04 ms alone, 3.06 ms while another process kept the GPU's SMs busy;
a kernel's local copy went from 0.59 to 2.95 ms), where an NCCL exchange between four processes on two GPUs waits
for both pairs' time slices. A region is one ``cudaMemcpy2DAsync`` (its rows at a fixed stride on each side: a
rank's row-parallel cut is the column block of its rows), queued on the current stream like the walk's kernels.
Called through the CUDA runtime torch loaded (``ctypes``), since torch has no strided copy between devices that
keeps to the copy engines."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from weightsync.channels import batched
from weightsync.errors import PermanentError

_DEFAULT = 4
"""``cudaMemcpyDefault``: the direction from the pointers (unified addressing)."""


@functools.cache
def _runtime() -> ctypes.CDLL:
    version = (torch.version.cuda or "").split(".")[0]
    rt = ctypes.CDLL(f"libcudart.so.{version}")  # the one torch loaded: the same devices, contexts and streams
    size, ptr = ctypes.c_size_t, ctypes.c_void_p
    rt.cudaMemcpy2DAsync.argtypes = [ptr, size, ptr, size, size, size, ctypes.c_int, ptr]
    rt.cudaGetErrorString.restype = ctypes.c_char_p
    rt.cudaGetLastError.restype = ctypes.c_int
    return rt


def _check(code: int, what: str) -> None:
    if code:
        rt = _runtime()
        rt.cudaGetLastError()  # clear it: the next call on this thread would report it again
        raise PermanentError(f"{what}: CUDA error {code} ({rt.cudaGetErrorString(code).decode()})")


Rows = tuple[int, int, int, int]
"""(first byte, bytes per row, rows, row stride in bytes)."""


def rows(t: torch.Tensor) -> Rows | None:
    """``t`` as rows a 2D copy moves (its runs, ``batched.as_runs``); None where they are not rows at one stride
    (more than one dimension strided beyond them)."""
    ptr, run, lead, strides = batched.as_runs(t)
    if len(lead) > 1 or (lead and strides[0] < run):
        return None
    return (ptr, run, lead[0], strides[0]) if lead else (ptr, run, 1, run)


def pair(dest: torch.Tensor, src: torch.Tensor) -> tuple[Rows, Rows] | None:
    """Both sides as rows of one length and count (a contiguous side cut as the other's rows), or None."""
    d, s = rows(dest), rows(src)
    if d is None or s is None:
        return None
    if d[1:3] != s[1:3]:
        if d[2] == 1:
            d = (d[0], s[1], s[2], s[1])
        elif s[2] == 1:
            s = (s[0], d[1], d[2], d[1])
        else:
            return None
    return d, s


def copy(dests: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dests[i] <- srcs[i]`` (same shape and dtype; a source on another GPU mapped into the destinations'
    device, ``ipc.Export.open``), each by the copy engines on the current stream; a pair whose sides are not rows
    of one length (a box of a box) by torch's own copy."""
    if not dests:
        return
    device = dests[0].device
    rt = _runtime()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        for d, s in zip(dests, srcs, strict=True):
            both = pair(d, s)
            if both is None:
                d.copy_(s, non_blocking=True)
                continue
            (dp, width, height, dpitch), (sp, _, _, spitch) = both
            code = rt.cudaMemcpy2DAsync(dp, dpitch, sp, spitch, width, height, _DEFAULT, stream)
            _check(code, f"copying {width * height} bytes from {s.device} to {d.device}")


__all__ = ["Rows", "copy", "pair", "rows"]
