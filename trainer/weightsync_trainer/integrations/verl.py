"""verl: ``weightsync`` is a backend of verl's ``CheckpointEngineRegistry``.

verl picks its weight-sync backend by name; a module named in the config registers its own::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync_trainer.integrations.verl

verl then drives every engine the same way, per sync (``CheckpointEngineManager.update_weights``):
``prepare`` on every actor and rollout worker, ``build_topology`` once, ``init_process_group``
on each, the actors' ``send_weights(weights, global_steps)`` concurrently with the rollouts'
``receive_weights(global_steps)``, then ``finalize``. Here:

- the actor ranks publish: every rank walks verl's per-tensor generator (its ``full_tensor()``
  gathers are collective), rank 0 (``is_master``) sends one weightsync version through
  ``Publisher.from_env`` and returns once it is READY or failed, with the version, its state and
  seconds as verl's per-sync metrics;
- the rollout side yields nothing: each replica's weightsync agent receives the version from the
  coordinator and loads it into its engine itself, and the actor's ``send_weights`` returns only
  once every replica verified it;
- ``prepare``, ``build_topology``, ``init_process_group`` and ``finalize`` have nothing to
  rendezvous: weightsync's coordinator plans the channels of every version.

verl owns its vLLM servers inside Ray and has no CPU platform, so the end-to-end run (verl's own
replicas, each with a weightsync agent) needs GPUs; tests drive this engine in verl's order
against a real coordinator and replica. Requires ``verl`` (``weightsync[verl]``, in a virtualenv
of its own: verl pins transformers below what vLLM 0.32 needs).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from weightsync.channels.wire import TORCH_DTYPES
from weightsync.errors import PermanentError
from weightsync_trainer.integrations import frameworks, streams

frameworks.require("verl")

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry  # noqa: E402

BACKEND = "weightsync"
ENGINE_KWARGS = ("wire_dtype",)
"""What ``checkpoint_engine.engine_kwargs.weightsync`` may set."""


@CheckpointEngineRegistry.register(BACKEND)
class WeightsyncCheckpointEngine(CheckpointEngine):  # type: ignore[misc]
    """verl constructs it on every actor rank (``is_master`` on rank 0) and every rollout worker."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        wire_dtype: str = "bfloat16",
        env: Mapping[str, str] | None = None,
    ) -> None:
        if wire_dtype and wire_dtype not in TORCH_DTYPES:
            raise PermanentError(
                f"checkpoint_engine.engine_kwargs.weightsync.wire_dtype {wire_dtype!r} is not a dtype weightsync "
                f"sends; choose one of {', '.join(TORCH_DTYPES)} or '' (the trainer's own)"
            )
        self.bucket_size = bucket_size  # verl passes it to every backend; weightsync's channels size their own
        self.is_master = is_master
        self.role = ""
        source = streams.StreamSource(TORCH_DTYPES[wire_dtype] if wire_dtype else None)
        self.stream = streams.StreamPublisher(source, rank=0 if is_master else 1, env=dict(env or os.environ))
        self.syncs = 0

    def prepare(self) -> dict[str, Any]:
        return {"is_master": self.is_master}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        masters = [i for i, m in enumerate(metadata[:actor_wg_world_size]) if m.get("is_master")]
        if masters != [0]:
            raise PermanentError(
                f"the weightsync checkpoint engine needs actor rank 0, and only it, as is_master; got {masters}"
            )
        return {"role": ["actor"] * actor_wg_world_size}, {"role": ["rollout"] * rollout_world_size}

    def init_process_group(self, role: str) -> None:
        self.role = role

    def finalize(self) -> None:
        """Nothing is held per sync: the publisher and its channels live for the run."""

    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None
    ) -> dict[str, float]:
        """Publish the weights as one version (collective: every actor rank calls it); verl's per-sync metrics."""
        if hasattr(weights, "__aiter__"):
            raise PermanentError(
                "the weightsync checkpoint engine takes verl's per-tensor generator (a plain iterator); got an async "
                "iterator"
            )
        step = self.syncs if global_steps is None else int(global_steps)
        self.syncs += 1
        # the publish blocks until the replicas acked: off verl's event loop (the gathers stay on this process)
        report = await asyncio.to_thread(self.stream.publish, weights, step)
        if report is None:
            return {}
        return {
            "weightsync/version": float(report.version),
            "weightsync/ready": float(report.state.value == "READY"),
            "weightsync/publish_s": report.seconds.get("total", 0.0),
        }

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        """Nothing to yield: the replica's weightsync agent loads each version itself."""
        return
        yield  # an async generator that yields nothing

    def close(self) -> None:
        self.stream.close()
