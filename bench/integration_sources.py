"""What a framework's hand-over costs the trainer against a ``ModuleSource``, per sync (CPU).

TRL's ``send_weights(iterator)`` and verl's ``send_weights(weights)`` give weightsync one
``(name, tensor)`` at a time (``weightsync_trainer.integrations.streams``); a ``ModuleSource``
reads the model itself. Both cast to the wire dtype (bf16) as they go; the stream also checks
every tensor against its table, and its first sync keeps a host copy of every tensor while it
learns the table. Measured here, in one process and one run, without channels (their cost is the
same for both): one full pass of ``groups()`` for

- ``module``: ``ModuleSource(model)`` (the baseline),
- ``stream first``: ``StreamSource`` fed the model's named parameters the first time (learns the table),
- ``stream``: a later sync of the same stream (checked against the table),

median of ``--repeats`` passes (interleaved), on a Qwen2 model of ``--layers`` x ``--hidden`` built in memory.

    python bench/integration_sources.py                  # 12 layers x 1024 (~0.3B parameters)
    python bench/integration_sources.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _model(layers: int, hidden: int) -> torch.nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        intermediate_size=hidden * 4,
        vocab_size=32000,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _interleaved_ms(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, tuple[float, int]]:
    """Median ms and tensor count of each run, the runs interleaved so that a busy machine slows them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    counts: dict[str, int] = {}
    for _ in range(repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            counts[name] = run()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: (statistics.median(times[name]), counts[name]) for name in runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from weightsync_trainer.integrations.streams import StreamSource
    from weightsync_trainer.sources import ModuleSource

    torch.set_num_threads(1)
    model = _model(args.layers, args.hidden)
    module = ModuleSource(model)

    def module_pass() -> int:
        return sum(len(g) for g in module.groups())

    def stream_first() -> int:
        fresh = StreamSource()
        fresh.feed(model.named_parameters())
        return sum(len(g) for g in fresh.groups())

    stream = StreamSource()
    stream.feed(model.named_parameters())
    sum(len(g) for g in stream.groups())

    def stream_later() -> int:
        stream.feed(model.named_parameters())
        return sum(len(g) for g in stream.groups())

    runs = {"module": module_pass, "stream first": stream_first, "stream": stream_later}
    rows: dict[str, Any] = {
        name: {"ms": round(ms, 1), "tensors": tensors}
        for name, (ms, tensors) in _interleaved_ms(runs, args.repeats).items()
    }
    base = rows["module"]["ms"]
    for row in rows.values():
        row["vs_module"] = round(row["ms"] / base, 2)
    result = {
        "model": f"qwen2 {args.layers}x{args.hidden}",
        "bytes_bf16": module.table().total_bytes,
        "threads": 1,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}, {result['bytes_bf16'] / 1e6:.0f} MB in bf16, one thread, median of {args.repeats}")
    print("| source | ms per sync | tensors | vs ModuleSource |\n|---|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['ms']} | {row['tensors']} | {row['vs_module']}x |")


if __name__ == "__main__":
    main()
