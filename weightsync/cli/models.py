"""Generate the small random-initialised test models (no hub needed).

Builds HF checkpoints of real architectures (Qwen2, Llama) with a locally trained
tokenizer and caches them under $WEIGHTSYNC_CACHE/models (default ~/.cache/weightsync),
keyed by their config; prints each model's folder.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "presets", nargs="*", default=["tiny-qwen2"], help="presets to build (default: tiny-qwen2); see --list"
    )
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.add_argument("--json", action="store_true", help="print a JSON object {preset: folder}")


def run(args: argparse.Namespace) -> int:
    from weightsync_trainer import tiny_models

    if args.list:
        for name, preset in tiny_models.PRESETS.items():
            shape = f"hidden={preset.hidden_size} layers={preset.num_layers} vocab={preset.vocab_size}"
            print(f"{name:14} {preset.arch:6} {shape}")
        return 0
    unknown = [p for p in args.presets if p not in tiny_models.PRESETS]
    if unknown:
        print(f"unknown preset(s) {', '.join(unknown)}; presets: {', '.join(tiny_models.PRESETS)}")
        return 2
    out = {name: str(tiny_models.generate(name, force=args.force)) for name in args.presets}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0
