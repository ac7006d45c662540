"""vLLM general plugin: registers one weight-transfer engine per weightsync channel.

vLLM calls ``register`` in every process it starts (the API server, the engine core,
each worker) through the ``vllm.general_plugins`` entry point, so the engines exist
wherever ``weight_transfer_config={"backend": "weightsync-<channel>"}`` is resolved.
Registration is lazy (a module path, not a class): a worker that never uses the
NCCL channel never imports it. Registering twice is harmless.

It also asks Linux for the AMX tile state in that process (below).
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

    allow_amx()
    for channel, class_name in ENGINE_CLASSES.items():
        if channel.engine_name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(channel.engine_name, "weightsync_inference.engine", class_name)


def allow_amx() -> bool:
    """Ask Linux for the AMX tile state in this process (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); True when granted.

    A process must ask before its first AMX instruction, or the CPU raises SIGILL. vLLM 0.32's CPU attention takes
    its AMX kernel for bfloat16 on a CPU that has AMX and never asks; oneDNN asks only once a GEMM is big enough for
    its own AMX kernel. So a small first batch (32 sequences of 4 tokens) killed the engine core with an illegal
    instruction on a Sapphire Rapids VM, while a batch of 64 sequences, or a machine without AMX, ran.
    """
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
