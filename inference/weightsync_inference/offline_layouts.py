"""Engine layouts without an engine: vLLM's model for one worker of a replica, built from a config alone.

A live worker records its own layout (``recording.record_live``). To plan for sizes no
machine here serves (Qwen3-235B at TP8/EP8, Kimi-K2) and to check recordings against
vLLM's loaders with real data, ``worker_model`` builds vLLM's own model class from a
Hugging Face config for one worker: vLLM's tensor- and expert-parallel groups are told
they have ``tp`` ranks and this worker's rank (one process and no collectives:
building and loading never communicate). On the meta device (the default) it holds no
weights: tensors of 64 Ki elements or more are made on meta, smaller ones (an expert
map the constructor indexes) on the CPU. ``engine_layout`` records every worker with
``recording.record``, the same recorder a live worker runs.

vLLM keeps process-wide state (its distributed environment, a registry of layers by
name in each config), so use this in a process of its own: the benchmark, or a test's
subprocess.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from weightsync.sharding.fills import EngineLayout
from weightsync.tensors import TensorTable
from weightsync_inference import recording

COMMON = {"max_position_embeddings": 4096, "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "hidden_act": "silu"}
"""Config fields every model here shares unless its config says otherwise."""


def worker_model(
    config: Mapping[str, Any], tp: int, rank: int, expert_parallel: bool = False, device: str = "meta"
) -> tuple[Any, Any]:
    """vLLM's model for worker ``rank`` of a ``tp``-way replica, and its config (for ``set_current_vllm_config``)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    folder = Path(tempfile.mkdtemp(prefix="weightsync-worker-model-"))
    (folder / "config.json").write_text(json.dumps({**COMMON, **config}))
    args = EngineArgs(
        model=str(folder),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        load_format="dummy",
        enable_expert_parallel=expert_parallel,
    )
    vllm_config = args.create_engine_config()  # a fresh one per worker: it registers each layer by name
    with set_current_vllm_config(vllm_config):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{folder}/pg", backend="gloo"
            )
        else:
            parallel_state.destroy_model_parallel()  # its groups follow the config (an expert group for MoE only)
        parallel_state.initialize_model_parallel(1, 1)
    for group in (parallel_state._TP, parallel_state._EP):  # the layers and loaders ask these for size and rank
        if group is not None:
            group.world_size, group.rank_in_group = tp, rank
    vllm_config.parallel_config.tensor_parallel_size = tp
    placing = _big_on_meta() if device == "meta" else torch.device(device)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16), placing:
        model = initialize_model(vllm_config=vllm_config)
    return model, vllm_config


def engine_layout(
    config: Mapping[str, Any], table: TensorTable, tp: int, expert_parallel: bool = False
) -> EngineLayout:
    """Every worker's recorded layout for ``table``, as a replica of ``tp`` workers would report it."""
    from vllm.config import set_current_vllm_config

    workers = []
    for rank in range(tp):
        model, vllm_config = worker_model(config, tp, rank, expert_parallel)
        with set_current_vllm_config(vllm_config):
            workers.append(recording.record(model, table, rank))
    return EngineLayout(table.layout_digest(), tuple(workers))


@contextmanager
def _big_on_meta() -> Iterator[None]:
    from torch.overrides import TorchFunctionMode

    factories = {torch.empty, torch.zeros, torch.ones, torch.full, torch.randn, torch.rand, torch.empty_strided}

    class BigOnMeta(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in factories:
                first = args[0] if args else kwargs.get("size", ())
                shape = (
                    first if isinstance(first, tuple | list | torch.Size) else [a for a in args if isinstance(a, int)]
                )
                if math.prod(shape) >= 1 << 16:
                    kwargs["device"] = "meta"
            return func(*args, **kwargs)

    with BigOnMeta():
        yield
