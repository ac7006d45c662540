"""Many tensors in one GPU launch: the digests of a group, the copies of a staged switch.

Done per tensor, a digest (``digests.word``) is two kernels and a temporary as large as
the tensor, and a switch is one memcpy per parameter: for a few hundred tensors the
launches and the extra passes over the bytes cost several times the bytes themselves
(full verification was 3.7x an NCCL transfer of Qwen3-1.7B). Here a table of chunks
(where each lies, which tensor it belongs to, how many 8-byte words) drives one Triton
kernel over all of them: the digests read the bytes once, the copies read and write
them once, whatever the tensor count.

Addresses travel as offsets, in 16-byte units, from the lowest address of the batch
(a pointer argument): the kernel then knows every access is 16-byte aligned and
loads 16 bytes at a time. A digest also reads a strided view as its runs of contiguous
bytes (``runs``: a sharded rank's row-parallel regions are column blocks of its shard,
rows of a few KB each), a chunk per run, each chunk knowing its first word's index in
the tensor. A tensor that is not 16-byte aligned, not whole 8-byte words, or (for a
copy) not contiguous keeps the per-tensor path (``eligible``, ``runs``).
Triton comes with torch's CUDA builds; without it, and on the CPU, callers keep their
per-tensor path (``available``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

CHUNK = 65536
"""Words per program (512 KiB): a few thousand programs for a 1.7B model, enough to fill any GPU."""
TILE, WARPS = 2048, 8
"""Words a digest program reads per step, and its warps."""
COPY_TILE, COPY_WARPS = 8192, 16
"""The same for a copy program. Tuned on an H200 (Qwen3-1.7B and 8B sets, chunks of 16K-256K words, tiles of
1K-8K words, 4-16 warps): copies 1.07-1.08x a flat copy here against 1.11-1.13x with the digests' shape,
digests 0.55-0.75x with theirs."""


@functools.cache
def _triton() -> Any:
    try:
        import triton  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    return triton


def available(device: torch.device) -> bool:
    """Whether batched kernels run on ``device`` (a CUDA device with Triton installed)."""
    return device.type == "cuda" and _triton() is not None


def address(t: torch.Tensor) -> tuple[int, int] | None:
    """``(data_ptr, bytes)`` of a tensor a batched kernel can read (contiguous, 16-byte aligned, whole 8-byte
    words), else None."""
    ptr, n = t.data_ptr(), _nbytes(t)
    return (ptr, n) if ptr % 16 == 0 and n % 8 == 0 and n and t.is_contiguous() else None


def eligible(t: torch.Tensor) -> bool:
    return address(t) is not None


MIN_RUN = 256
"""Bytes below which a strided view's runs are not worth a chunk each (each costs a table row, 32 bytes, and a
program): such a view keeps the per-tensor path."""

Runs = tuple[int, int, tuple[int, ...], tuple[int, ...]]
"""A tensor as runs of contiguous bytes: (data_ptr, bytes per run, the leading dims' sizes, their strides in bytes);
run ``i`` (row-major over the leading dims) starts at data_ptr + sum(i_d * stride_d). A contiguous tensor is one
run and no leading dims."""


def runs(t: torch.Tensor) -> Runs | None:
    """``t`` as runs a batched digest can read (each 16-byte aligned and whole 8-byte words), else None."""
    whole = address(t)
    if whole is not None:  # most tensors: one run, found at the cost of ``address``
        return (*whole, (), ())
    if not t.numel():
        return None
    ptr, run, lead, strides = as_runs(t)
    aligned = ptr % 16 == 0 and run % 8 == 0 and all(s > 0 and s % 16 == 0 for s in strides)
    return (ptr, run, lead, strides) if aligned and (not lead or run >= MIN_RUN) else None


def as_runs(t: torch.Tensor) -> Runs:
    """``t`` as its runs of contiguous bytes, whatever their alignment and length (``runs`` keeps those a batched
    kernel reads; ``peer_copies`` those a 2D copy moves)."""
    size = t.element_size()
    dims = [(n, s * size) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1]
    run = size
    while dims and dims[-1][1] == run:  # the innermost dims that lie back to back make one run
        run *= dims.pop()[0]
    return t.data_ptr(), run, tuple(n for n, _ in dims), tuple(s for _, s in dims)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


tl: Any = None
"""``triton.language`` once the kernels are defined: a module global, where Triton's interpreter looks for it."""


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    global tl
    triton = _triton()
    tl = triton.language

    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def digest_chunks(base, table, out, chunks, TILE: tl.constexpr):  # type: ignore[no-untyped-def]
        # table rows (chunks columns each): offset from base in 16-byte units, first word's index in its tensor,
        # words in the chunk, its tensor; a chunk adds sum w_i * (2i + 1) over its words (i: index in the tensor)
        # to its tensor's word (int64 addition wraps: the sum modulo 2**64, in any order)
        c = tl.program_id(0)
        start = base + tl.load(table + c) * 2
        first = tl.load(table + chunks + c)
        n = tl.load(table + 2 * chunks + c)
        lanes = tl.arange(0, TILE)
        acc = tl.zeros([TILE], dtype=tl.int64)
        full = (n // TILE) * TILE
        for i in range(0, full, TILE):
            acc += tl.load(start + i + lanes) * (2 * (first + i + lanes) + 1)
        tail = full + lanes
        acc += tl.load(start + tail, mask=tail < n, other=0) * (2 * (first + tail) + 1)
        tl.atomic_add(out + tl.load(table + 3 * chunks + c), tl.sum(acc, axis=0))

    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def copy_chunks(dst_base, src_base, table, chunks, TILE: tl.constexpr):  # type: ignore[no-untyped-def]
        # table rows: destination and source offsets in 16-byte units, words in the chunk
        c = tl.program_id(0)
        dst = dst_base + tl.load(table + c) * 2
        src = src_base + tl.load(table + chunks + c) * 2
        n = tl.load(table + 2 * chunks + c)
        lanes = tl.arange(0, TILE)
        full = (n // TILE) * TILE
        for i in range(0, full, TILE):
            tl.store(dst + i + lanes, tl.load(src + i + lanes))
        tail = full + lanes
        mask = tail < n
        tl.store(dst + tail, tl.load(src + tail, mask=mask), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator,unused-ignore]
    def copy_digest_rows(dst_base, src_base, table, out, pairs, TILE: tl.constexpr):  # type: ignore[no-untyped-def]
        # table rows (pairs columns each): destination and source offsets in 16-byte units, words per row, words in
        # the pair, each side's row stride in 16-byte units, rows per program. Program (p, g) copies rows g*per..
        # of pair p (word r*W + j of the pair lies at row r, word j) and adds each word w_i * (2i + 1), as
        # digest_chunks does, to the pair's word
        p = tl.program_id(0)
        w = tl.load(table + 2 * pairs + p)
        n = tl.load(table + 3 * pairs + p)
        per = tl.load(table + 6 * pairs + p)
        row0 = tl.program_id(1) * per
        rows = (n + w - 1) // w
        if row0 < rows:
            dst0 = tl.load(table + p)
            src0 = tl.load(table + pairs + p)
            src_stride = tl.load(table + 4 * pairs + p)
            dst_stride = tl.load(table + 5 * pairs + p)
            lanes = tl.arange(0, TILE)
            acc = tl.zeros([TILE], dtype=tl.int64)
            for r in range(row0, tl.minimum(row0 + per, rows)):
                dst = dst_base + (dst0 + r * dst_stride) * 2
                src = src_base + (src0 + r * src_stride) * 2
                m = tl.minimum(w, n - r * w)
                full = (m // TILE) * TILE
                for i in range(0, full, TILE):
                    x = tl.load(src + i + lanes)
                    tl.store(dst + i + lanes, x)
                    acc += x * (2 * (r * w + i + lanes) + 1)
                tail = full + lanes
                mask = tail < m
                x = tl.load(src + tail, mask=mask, other=0)
                tl.store(dst + tail, x, mask=mask)
                acc += x * (2 * (r * w + tail) + 1)
            tl.atomic_add(out + p, tl.sum(acc, axis=0))

    return digest_chunks, copy_chunks, copy_digest_rows


def _current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` as the current CUDA device (a launch goes there), unless it is already; on the CPU (Triton's
    interpreter, which the unit tests run the kernels in) nothing to set."""
    if device.type != "cuda" or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


Chunks = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _chunked(tensors: Sequence[torch.Tensor]) -> Chunks:
    """Which tensor lies lowest and, per chunk (host tensors): its tensor's index, the offset of its first word from
    the lowest address in 16-byte units, that word's index in its tensor, its words. A run longer than ``CHUNK``
    words is several chunks; a contiguous tensor is one run (all of them at once: a receiver's buckets and a stage
    hold hundreds), a strided one (``runs``) a run per row."""
    shapes = [s for s in map(runs, tensors) if s is not None]
    if len(shapes) != len(tensors):
        raise ValueError("a batched kernel reads 16-byte aligned runs of whole 8-byte words only (see runs)")
    ptrs = torch.tensor([s[0] for s in shapes], dtype=torch.int64)
    lowest = int(torch.argmin(ptrs))
    rel = ptrs - ptrs[lowest]
    whole = torch.tensor([not s[2] for s in shapes], dtype=torch.bool)
    owners = [torch.arange(len(shapes))[whole]]
    starts = [rel[whole]]
    words = [torch.tensor([s[1] // 8 for s in shapes], dtype=torch.int64)[whole]]
    firsts = [torch.zeros(int(whole.sum()), dtype=torch.int64)]
    for i, (_, run, lead, strides) in enumerate(shapes):
        if not lead:
            continue
        at = rel[i : i + 1]
        for n, stride in zip(lead, strides, strict=True):  # row-major: the outer dims vary slowest
            at = (at[:, None] + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
        starts.append(at)
        words.append(torch.full_like(at, run // 8))
        firsts.append(torch.arange(at.numel(), dtype=torch.int64) * (run // 8))
        owners.append(torch.full_like(at, i))
    start, word, first, owner = (torch.cat(x) for x in (starts, words, firsts, owners))
    per = (word + CHUNK - 1) // CHUNK
    run_of = torch.repeat_interleave(torch.arange(word.numel()), per)
    within = (torch.arange(int(per.sum())) - (torch.cumsum(per, 0) - per)[run_of]) * CHUNK
    count = torch.clamp(word[run_of] - within, max=CHUNK)
    return lowest, owner[run_of], start[run_of] // 16 + within // 2, first[run_of] + within, count


def _words(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor at ``t``'s first byte: the kernels' pointer argument (16-byte aligned, so Triton specialises
    on it; a strided ``t`` is read through the table's offsets, not through this view)."""
    return t.as_strided((8 // t.element_size(),), (1,)).view(torch.int64)


class Digests:
    """The digest words of one set of tensors (``digests.word`` of each), prepared for their addresses and sizes
    (it keeps none of them alive: called with tensors at the same addresses, of the same sizes)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._lowest, owner, offsets, first, count = _chunked(tensors)
        self.device = tensors[0].device
        self._chunks = int(owner.numel())
        self._table = upload(torch.stack([offsets, first, count, owner]), self.device)
        self._count = len(tensors)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The words, one per tensor, as an int64 tensor on their device: kernels only, no host sync."""
        digest_chunks, _, _ = _kernels()
        out = torch.zeros(self._count, dtype=torch.int64, device=self.device)
        with _current(self.device):
            digest_chunks[(self._chunks,)](
                _words(tensors[self._lowest]), self._table, out, self._chunks, TILE=TILE, num_warps=WARPS
            )
        return out


class Copies:
    """``dests[i] <- srcs[i]`` for every pair (same dtype and size), prepared for their addresses."""

    def __init__(self, dests: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        dst, owner, dst_offsets, _, count = _chunked(dests)
        src, _, src_offsets, _, _ = _chunked(srcs)
        self._dst, self._src = _words(dests[dst]), _words(srcs[src])
        self.device = dests[0].device
        self._chunks = int(owner.numel())
        self._table = upload(torch.stack([dst_offsets, src_offsets, count]), self.device)
        self._graph: torch.cuda.CUDAGraph | None = None

    def __call__(self) -> None:
        """The copies on the current stream: launched the first time, then replayed as a CUDA graph of that launch
        (a replay costs the host about 10 us; Triton's launch path about 100-150 us, most of what a switch of
        Qwen3-1.7B spends beyond its copy)."""
        if self._graph is not None:
            with _current(self.device):
                self._graph.replay()
            return
        self._launch()
        if self.device.type == "cuda":
            self._graph = _captured(self._launch, self.device)

    def _launch(self) -> None:
        _, copy_chunks, _ = _kernels()
        with _current(self.device):
            copy_chunks[(self._chunks,)](
                self._dst, self._src, self._table, self._chunks, TILE=COPY_TILE, num_warps=COPY_WARPS
            )


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, queued on the current stream without waiting for it: through pinned memory
    (torch's cached pinned blocks), since a copy from pageable memory may wait for the stream's queued work, and
    a walk's stream holds copies, digests and waits on the wire (a round's table waited for every round before it:
    about 50 ms a round on 2x H200)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


Rows = tuple[int, int, int, int, int, int]
"""A pair as rows a copy-and-digest launch reads: (destination, source) first bytes, words per row, words in all,
(source, destination) row strides in bytes."""


def pairable(dest: torch.Tensor, src: torch.Tensor) -> Rows | None:
    """``dest`` and ``src`` (same shape, dtype and device) as rows of the same words, each side's rows at a fixed
    stride (a contiguous tensor as rows of ``CHUNK`` words, a strided one as its runs when they are its only
    lead dimension: a rank's row-parallel cut), every row 16-byte aligned; else None (copied apart). Kept by
    everything it depends on (``_PAIRS``)."""
    key = (dest.data_ptr(), src.data_ptr(), dest.shape, src.shape, dest.stride(), src.stride(), dest.dtype, src.dtype)
    if key in _pairs:
        return _pairs[key]
    if len(_pairs) >= _PAIRS:
        _pairs.clear()
    _pairs[key] = rows = _pairable(dest, src)
    return rows


_PAIRS = 1 << 16
"""Pairs whose ``pairable`` answer is kept, by both sides' addresses (unique across devices: unified addressing),
shapes, strides and dtypes (about 200 bytes each): a walk's regions come from the same shards and land in the same
parameters from version to version wherever those stay in the same memory, and finding a pair's rows costs more
host time than the rest of its share of the launch (a walk runs one per region, about 600 per worker and version
for Qwen3-8B at TP=2)."""
_pairs: dict[tuple[Any, ...], Rows | None] = {}


def _pairable(dest: torch.Tensor, src: torch.Tensor) -> Rows | None:
    if (dest.dtype, dest.shape, dest.device) != (src.dtype, src.shape, src.device):
        return None
    rd, rs = runs(dest), runs(src)
    if rd is None or rs is None or len(rd[2]) > 1 or len(rs[2]) > 1:
        return None
    total = _nbytes(dest) // 8
    strided = rs if rs[2] else rd if rd[2] else None
    words = strided[1] // 8 if strided is not None else min(total, CHUNK)
    d, s = _rows(rd, words, total), _rows(rs, words, total)
    if d is None or s is None:
        return None
    return d[0], s[0], words, total, s[1], d[1]


def _rows(x: Runs, words: int, total: int) -> tuple[int, int] | None:
    """(first byte, row stride in bytes) of ``x`` read as rows of ``words`` words, or None."""
    ptr, run, lead, strides = x
    if lead:
        return (ptr, strides[0]) if run == words * 8 else None
    if total > words and (words * 8) % 16:
        return None  # rows after the first would start off a 16-byte boundary
    return ptr, words * 8


def copy_digest(dests: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], pairs: Sequence[Rows]) -> torch.Tensor:
    """``dests[i] <- srcs[i]`` and the digest word of each (``digests.word`` of what was written), in one launch on
    the current stream: the bytes read once and written once. ``pairs``: ``pairable`` of each (none None). The
    table is a row per pair, built in Python (no host tensor ops: a walk calls this every round, in processes
    that share the host's cores)."""
    _, _, copy_digest_rows = _kernels()
    device = dests[0].device
    low_d = min(range(len(dests)), key=lambda i: dests[i].data_ptr())
    low_s = min(range(len(srcs)), key=lambda i: srcs[i].data_ptr())
    base_d, base_s = dests[low_d].data_ptr(), srcs[low_s].data_ptr()
    columns: list[list[int]] = [[] for _ in range(7)]
    programs = 1
    for d, s, words, total, s_stride, d_stride in pairs:
        rows = -(-total // words)
        per = max(1, CHUNK // words, -(-rows // _MAX_PROGRAMS))
        programs = max(programs, -(-rows // per))
        row = ((d - base_d) // 16, (s - base_s) // 16, words, total, s_stride // 16, d_stride // 16, per)
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    table = upload(torch.tensor(columns, dtype=torch.int64), device)
    out = torch.zeros(len(dests), dtype=torch.int64, device=device)
    with _current(device):
        copy_digest_rows[(len(pairs), programs)](
            _words(dests[low_d]), _words(srcs[low_s]), table, out, len(pairs), TILE=TILE, num_warps=WARPS
        )
    return out


_MAX_PROGRAMS = 65535
"""A launch grid's second dimension at most (CUDA's limit)."""


def _captured(launch: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """``launch`` recorded (not run) as a CUDA graph, on a side stream. Thread-local capture: the engine's own
    threads may launch work meanwhile (a staged switch prepares beside them)."""
    graph = torch.cuda.CUDAGraph()
    with _current(device):
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
    return graph


_warm: set[torch.device] = set()


def warm(device: torch.device) -> None:
    """Compile the kernels for ``device`` now (a first launch compiles them: about a second), so that it happens
    when a receiver starts, not inside an update's pause."""
    if device in _warm or not available(device):
        return
    scratch = torch.zeros(4, dtype=torch.int64, device=device)
    Digests([scratch])([scratch])
    Copies([scratch[:2]], [scratch[2:]])()
    _warm.add(device)


def copies(dests: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> Callable[[], None]:
    """``dests[i] <- srcs[i]`` for all i, prepared once: one launch for the pairs that allow it, a batched
    ``copy_`` for the rest (other dtypes, unaligned views) and everywhere batched kernels do not run."""
    pairs = list(zip(dests, srcs, strict=True))
    kernels = bool(pairs) and available(pairs[0][0].device)
    fast = [kernels and d.dtype == s.dtype and d.numel() == s.numel() and eligible(d) and eligible(s) for d, s in pairs]
    batch = Copies(*zip(*(p for p, f in zip(pairs, fast, strict=True) if f), strict=True)) if any(fast) else None
    rest_d = [d for (d, _), f in zip(pairs, fast, strict=True) if not f]
    rest_s = [s for (_, s), f in zip(pairs, fast, strict=True) if not f]

    def run() -> None:
        if batch is not None:
            batch()
        if rest_d:
            torch._foreach_copy_(rest_d, rest_s)

    return run


__all__ = [
    "CHUNK",
    "MIN_RUN",
    "Copies",
    "Digests",
    "Rows",
    "Runs",
    "address",
    "as_runs",
    "available",
    "copies",
    "copy_digest",
    "eligible",
    "pairable",
    "runs",
    "upload",
    "warm",
]
