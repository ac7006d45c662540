"""What vLLM's own loader makes of a checkpoint, per worker of a TP replica, with no engine: ``python -m
tests.integration.served_reference FOLDER TP OUT``.

For each worker of a ``TP``-way replica: vLLM's model for that worker built on the CPU from ``FOLDER``'s config
(``offline_layouts.worker_model``), ``FOLDER/model.safetensors`` loaded through the model's ``load_weights`` and
post-processed as an engine does (the CPU backend packs its linear weights), then the digest of every parameter it
computes with (``held.parameter_digests``, what a live worker answers through ``weightsync_parameter_digests``).
Writes the list, in worker order, as JSON to ``OUT``. In a process of its own: vLLM keeps process-wide state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from weightsync_inference import held, offline_layouts

    folder, tp, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    digests = []
    for rank in range(tp):
        model, vllm_config = offline_layouts.worker_model(config, tp, rank, device="cpu")
        with set_current_vllm_config(vllm_config), torch.no_grad():
            model.load_weights(tensors.items())
            process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
            digests.append(held.parameter_digests(model))
    out.write_text(json.dumps(digests))


if __name__ == "__main__":
    main()
