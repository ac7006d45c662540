"""vLLM's trainer-side API: ``weightsync`` is an engine of ``WeightTransferTrainerFactory``.

vLLM 0.32 has a trainer-side registry parallel to its worker engines: a framework builds the
engine it was configured with by name and sends each round through it::

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from weightsync_trainer.integrations import vllm as weightsync_vllm

    weightsync_vllm.register()  # also done by vLLM's plugin loader in any process that loads vLLM's plugins
    engine = WeightTransferTrainerFactory.trainer_init(
        weightsync_vllm.init_info(rank=rank), client=client, source=ModuleSource(model)
    )
    for step in range(steps):
        train_step()
        engine.send_weights()       # on every rank: one weightsync version, READY when every replica verified it
    engine.shutdown()

The engine publishes through ``Publisher.from_env`` (the environment an RLJob's trainer pod
gets); the replicas' agents drive their own engines, so the ``client`` the framework passes (its
handle on the inference servers' development routes, which a weightsync deployment does not
expose) is kept but never called. Registration is a module path, so nothing here imports vLLM;
the engine module checks the installed vLLM against the tested range when the factory loads it.
"""

from __future__ import annotations

from typing import Any

BACKEND = "weightsync"
ENGINE_MODULE = "weightsync_trainer.integrations._vllm_engine"


def register() -> None:
    """Register the ``weightsync`` trainer engine with vLLM's factory (idempotent; never raises inside vLLM's plugin
    loader: the version check runs when the engine is first built)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, ENGINE_MODULE, "WeightsyncTrainerEngine")


def init_info(*, rank: int, wire_dtype: str = "bfloat16") -> Any:
    """The ``TrainerInitInfo`` that selects the ``weightsync`` engine (``rank`` 0 sends)."""
    from weightsync_trainer.integrations import _vllm_engine

    return _vllm_engine.WeightsyncTrainerInitInfo(rank=rank, wire_dtype=wire_dtype)
