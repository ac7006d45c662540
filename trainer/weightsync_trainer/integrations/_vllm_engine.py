"""The ``weightsync`` trainer engine itself; ``vllm.register`` names this module to vLLM's factory.

It subclasses vLLM's ``TrainerWeightTransferEngine`` and ``TrainerInitInfo``, so it imports vLLM
at its top, after checking the installed version against the tested range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from weightsync_trainer.integrations import frameworks

frameworks.require("vllm")

from vllm.distributed.weight_transfer.base import (  # noqa: E402 - after the version check
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from weightsync.channels.wire import TORCH_DTYPES  # noqa: E402
from weightsync.errors import PermanentError  # noqa: E402
from weightsync_trainer.integrations import streams  # noqa: E402
from weightsync_trainer.publisher import PublishReport  # noqa: E402


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]
    """``rank`` (keyword-only, from vLLM's base) 0 sends; ``wire_dtype`` is what floating tensors travel as (``""``:
    as the trainer holds them)."""

    backend: ClassVar[str] = "weightsync"
    wire_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.wire_dtype and self.wire_dtype not in TORCH_DTYPES:
            raise PermanentError(
                f"WeightsyncTrainerInitInfo.wire_dtype {self.wire_dtype!r} is not a dtype weightsync sends; "
                f"choose one of {', '.join(TORCH_DTYPES)} or '' (the trainer's own)"
            )


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):  # type: ignore[misc]
    """Each ``send_weights`` publishes one version of the source's weights (collective: every rank iterates its
    source, rank 0 sends), with the table vLLM's ``WeightSource.metadata()`` declares."""

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool,
        stream: streams.StreamPublisher,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.stream = stream
        self.rounds = 0

    @classmethod
    def trainer_init(
        cls, init_info: WeightsyncTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise PermanentError(
                "the weightsync trainer engine sends whole versions: pass source= (a vLLM WeightSource, e.g. "
                "ModuleSource(model)) to WeightTransferTrainerFactory.trainer_init"
            )
        wire = TORCH_DTYPES[init_info.wire_dtype] if init_info.wire_dtype else None
        metadata = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]
        stream = streams.StreamPublisher(streams.StreamSource.declared(metadata, wire), rank=init_info.rank)
        return cls(client=client, source=source, is_sender=init_info.is_sender, stream=stream)

    @property
    def last(self) -> PublishReport | None:
        """The report of the last round (on the sender)."""
        return self.stream.last

    def send_weights(self, step: int | None = None) -> None:
        """Publish the source's current weights; ``step`` defaults to the count of rounds sent so far."""
        assert self.source is not None
        pairs: Any = iter(self.source)
        self.stream.publish(pairs, self.rounds if step is None else step)
        self.rounds += 1

    def shutdown(self) -> None:
        self.stream.close()
