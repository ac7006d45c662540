"""vLLM general plugin: registers one weight-transfer engine per weightsync channel.

vLLM calls ``register`` in every process it starts (the API server, the engine core,
each worker) through the ``vllm.general_plugins`` entry point, so the engines exist
wherever ``weight_transfer_config={"backend": "weightsync-<channel>"}`` is resolved.
Registration is lazy (a module path, not a class): a worker that never uses the
NCCL channel never imports it. Registering twice is harmless.
"""

from __future__ import annotations

from weightsync.vocabulary import Channel

ENGINE_CLASSES: dict[Channel, str] = {
    Channel.CPU: "CpuEngine",
    Channel.VOLUME: "VolumeEngine",
    Channel.NCCL: "NcclEngine",
    Channel.IPC: "IpcEngine",
    Channel.NIXL: "NixlEngine",
}


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for channel, class_name in ENGINE_CLASSES.items():
        if channel.engine_name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(channel.engine_name, "weightsync_inference.engine", class_name)
