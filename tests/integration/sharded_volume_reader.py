"""The workers of a tensor-parallel replica load a sharded version by region: ``python -m
tests.integration.sharded_volume_reader``.

For each worker of a TP replica, in a process of its own (vLLM keeps process-wide state): vLLM's own model for
that worker is built on the CPU (``offline_layouts``) and loaded with the model it started from (``--initial``)
and post-processed as an engine does; its layout is recorded from vLLM's loaders (``recording``, as a live
worker records it); then the version is reloaded twice: once from the volume, by region (``RegionReader``:
every tile it will read checked first, then its fills read and landed through ``Landing`` inside vLLM's
layerwise reload, as a worker lands regions), once through vLLM's own loader with the gathered tensors
(``--reference``). Both must leave every parameter equal, in the kernel's form. Writes per version and worker:
bytes read and checked, bytes the layout needs, the parameters that differ, seconds (JSON to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main() -> None:
    from safetensors.torch import load_file

    from weightsync.channels import manifests

    p = argparse.ArgumentParser()
    p.add_argument("--initial", required=True, help="the model folder the replica started from")
    p.add_argument("--reference", required=True, help="the gathered tensors of the version (model.safetensors)")
    p.add_argument("--root", required=True)
    p.add_argument("--versions", type=int, nargs="+", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    config = json.loads(Path(args.initial, "config.json").read_text())
    initial = load_file(str(Path(args.initial, "model.safetensors")))
    gathered = load_file(str(Path(args.reference, "model.safetensors")))
    out: dict[str, Any] = {}
    for version in args.versions:
        directory = manifests.version_dir(Path(args.root), version)
        manifest = manifests.Manifest.load(directory)
        workers = [load(config, initial, gathered, directory, manifest, args.tp, rank) for rank in range(args.tp)]
        out[str(version)] = {"tile": manifest.tile, "total_bytes": manifest.table.total_bytes, "workers": workers}
    Path(args.out).write_text(json.dumps(out))


def load(
    config: dict[str, Any], initial: Any, gathered: Any, directory: Path, manifest: Any, tp: int, rank: int
) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from weightsync.channels.volume_regions import RegionReader
    from weightsync_inference import offline_layouts, recording
    from weightsync_inference.landing import Landing

    table = manifest.table
    meta, meta_config = offline_layouts.worker_model(config, tp, rank)
    with set_current_vllm_config(meta_config):
        layout = recording.record(meta, table, rank)
    model, vllm_config = offline_layouts.worker_model(config, tp, rank, device="cpu")

    def snapshot() -> dict[str, Any]:
        return {n: t.detach().clone() for n, t in model.named_parameters()}

    reader = RegionReader(directory, manifest)
    with set_current_vllm_config(vllm_config), torch.no_grad():
        model.load_weights((n, initial[n]) for n in initial)
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
        before = snapshot()
        t0 = time.perf_counter()
        reader.check(layout.fills)  # nothing lands from a damaged version
        initialize_layerwise_reload(model)
        landing = Landing(model, layout, table)
        landing.land(reader.fills(layout.fills))
        landing.finish()
        finalize_layerwise_reload(model, vllm_config.model_config)
        seconds = time.perf_counter() - t0
        landed = snapshot()
        initialize_layerwise_reload(model)
        model.load_weights((spec.name, gathered[spec.name]) for spec in table)
        finalize_layerwise_reload(model, vllm_config.model_config)
        loaded = snapshot()
    reader.close()
    return {
        "rank": rank,
        "bytes_read": reader.bytes_read,
        "bytes_checked": reader.bytes_checked,
        "bytes_needed": layout.bytes_needed(table),
        "landed": landing.nbytes,
        "fills": len(layout.fills),
        "differ": [n for n in loaded if not torch.equal(landed[n], loaded[n])],
        "unchanged": [n for n in loaded if torch.equal(before[n], landed[n]) and before[n].numel() > 1],
        "seconds": seconds,
    }


if __name__ == "__main__":
    main()
