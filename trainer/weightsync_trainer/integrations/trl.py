"""TRL: every sync becomes a weightsync version; every sample knows the weights that generated it.

``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) takes any ``weight_transfer`` with
``init_weight_transfer / pause / send_weights / resume / destroy``; its rollout worker calls the
job's OpenAI endpoint (``/v1/completions``, ``/health``, ``/v1/models``), which the weightsync
proxy forwards::

    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from weightsync_trainer.integrations import trl as weightsync_trl

    args = AsyncGRPOConfig(vllm_server_base_url=weightsync_trl.endpoint(), ...)
    trainer = AsyncGRPOTrainer(model, reward_funcs, args, dataset, weight_transfer=weightsync_trl.WeightTransfer())
    weightsync_trl.tag_versions(trainer)   # samples and reward functions see the replicas' version headers
    trainer.train()

``GRPOTrainer`` syncs through vLLM's NCCL engine in server mode, whose start-up calls
development routes the proxy refuses; its ``rollout_func`` generates elsewhere, so generation
goes through the endpoint and the sync through weightsync::

    trainer = GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=dataset,
                          rollout_func=weightsync_trl.RolloutFunc())

TRL gathers the weights (FSDP's ``full_tensor()``) and merges a PEFT adapter before
``send_weights``; weightsync receives finished tensors, one per ``(name, tensor)`` pair. The
first sync also learns the tensor table from them (``streams``): one copy of the model in host
memory, once. ``RolloutFunc`` has the trainer's model itself and publishes it as a
``ModuleSource`` (per-layer groups, no copy beyond the wire cast). Requires ``trl``
(``weightsync[trl]``); TRL's own ``AsyncRolloutWorker`` also insists that ``vllm`` is importable
in the trainer process, although it only speaks HTTP.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from weightsync.errors import PermanentError
from weightsync.served import Served
from weightsync_trainer.integrations import completions, frameworks, streams
from weightsync_trainer.publisher import Publisher, PublishReport

log = logging.getLogger(__name__)
VERSIONS_KWARG = "weightsync_versions"
"""The reward functions' keyword argument: per completion, the versions that generated it (``"12"``, ``"12,13"``,
or ``""`` when the endpoint did not say)."""


def endpoint(env: Mapping[str, str] | None = None) -> str:
    """The job's OpenAI endpoint for ``AsyncGRPOConfig(vllm_server_base_url=...)``."""
    return completions.endpoint(env)


class WeightTransfer:
    """``AsyncGRPOTrainer(weight_transfer=WeightTransfer())``: each sync publishes one version, on the main process.

    ``send_weights`` returns once the version is READY (every replica loaded and verified it) or failed; TRL then
    bumps its own version counter and resumes rollouts. ``pause`` and ``resume`` do nothing: each replica's agent
    pauses its own engine around the load (the job's pause mode), never the whole fleet from here. The publisher comes
    from the environment the operator injects (``Publisher.from_env``), or ``env``. ``publish=False`` never syncs:
    each sync drains TRL's pairs (its gathers) and the replicas keep their weights, the baseline an experiment compares
    against.
    """

    def __init__(
        self, *, publish: bool = True, env: Mapping[str, str] | None = None, wire_dtype: torch.dtype = torch.bfloat16
    ) -> None:
        frameworks.require("trl")
        self.stream = streams.StreamPublisher(streams.StreamSource(wire_dtype), env=env)
        self.publish = publish
        self.syncs = 0
        self.versions: list[int] = []
        """Per sync, the version it made READY (0 when it did not, or did not publish)."""

    @property
    def last(self) -> PublishReport | None:
        """The report of the last sync."""
        return self.stream.last

    def init_weight_transfer(self) -> None:
        """Nothing to set up before the first sync: the publisher registers once it knows the tensor table."""

    def pause(self) -> None:
        """Replicas pause themselves around their load (the agent), never on the trainer's word."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        report = None
        if self.publish:
            report = self.stream.publish(iterator, step=self.syncs)
        else:
            streams.drain(iterator)
        self.syncs += 1
        self.versions.append(report.version if report is not None and report.state.value == "READY" else 0)

    def resume(self) -> None:
        """See ``pause``."""

    def destroy(self) -> None:
        self.stream.close()


def tag_versions(trainer: Any) -> None:
    """Have ``trainer``'s rollout worker (TRL's ``AsyncRolloutWorker``) read the versions header of every completion:
    reward functions get ``weightsync_versions``, samples ``weightsync/version_min|max`` metrics. Call it before
    ``train()``; on processes other than the main one it does nothing (they have no rollout worker)."""
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    worker = getattr(trainer, "rollout_worker", None)
    if worker is None:
        return
    if not isinstance(worker, AsyncRolloutWorker):
        raise PermanentError(
            f"tag_versions needs TRL's AsyncRolloutWorker, the trainer has a {type(worker).__name__}: a custom rollout "
            "worker reads the proxy's x-weightsync-versions header itself (weightsync.served.Served.parse)"
        )
    from weightsync_trainer.integrations import _trl_rollouts

    worker._loop_cls = _trl_rollouts.VersionedRolloutLoop  # this worker only; TRL's class keeps its own loop


class RolloutFunc:
    """``GRPOTrainer(rollout_func=RolloutFunc())``: publish the policy when the step changed, then generate every
    completion of the batch through the job's OpenAI endpoint.

    Called on every process with its slice of prompts (each repeated ``num_generations`` times by TRL's sampler):
    consecutive copies of one prompt become one request with ``n`` completions. The publish is collective (FSDP
    gathers on every rank; rank 0 sends). Returns TRL's required ``prompt_ids``, ``completion_ids`` and ``logprobs``
    plus ``weightsync_versions``, which TRL forwards to the reward functions. ``publish=False`` never syncs (the
    replicas keep their weights: the baseline an experiment compares against). ``history`` keeps one record per call:
    the step, the version published (None when not), and the versions that served each completion.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        sampling: completions.Sampling | None = None,
        publish: bool = True,
        env: Mapping[str, str] | None = None,
        wire_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        frameworks.require("trl")
        self.env = dict(os.environ if env is None else env)
        self.client = completions.Client(url or completions.endpoint(self.env))
        self.sampling = sampling
        self.publish = publish
        self.wire_dtype = wire_dtype
        self.publisher: Publisher | None = None
        self.published_step: int | None = None
        self.history: list[dict[str, Any]] = []

    def _sampling(self, trainer: Any) -> completions.Sampling:
        if self.sampling is None:
            args = trainer.args
            self.sampling = completions.Sampling(
                max_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p
            )
        return self.sampling

    def _publish(self, trainer: Any, step: int) -> int | None:
        from weightsync_trainer.sources import LoraMergedSource, ModuleSource

        if self.publisher is None:
            model = trainer.accelerator.unwrap_model(trainer.model)
            peft = hasattr(model, "peft_config")
            source = (LoraMergedSource if peft else ModuleSource)(model, self.wire_dtype)
            self.publisher = Publisher.from_env(source, self.env)
        report = self.publisher.publish(step)
        self.published_step = step
        if report is None:  # not the sending rank
            return None
        if report.state.value == "READY":
            return report.version
        log.warning(
            "step %d: version %d is %s (%s); generating anyway", step, report.version, report.state, report.reason
        )
        return None

    def sync(self, trainer: Any) -> int | None:
        """Publish the trainer's weights unless this step's are published already; the version when READY. Call it
        after ``trainer.train()``: no generation follows the last optimizer step, so nothing else publishes it."""
        step = int(trainer.state.global_step)
        if not self.publish or step == self.published_step:
            return None
        return self._publish(trainer, step)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        step = int(trainer.state.global_step)
        published = self.sync(trainer)
        prompt_ids: list[list[int]] = trainer._tokenize_prompts(prompts)[0]  # TRL's own tokenization (chat template)
        sampling = self._sampling(trainer)
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], VERSIONS_KWARG: []}
        served: list[Served | None] = []
        i = 0
        while i < len(prompts):
            n = 1
            while i + n < len(prompts) and prompts[i + n] == prompts[i]:
                n += 1
            for c in self.client.complete(prompt_ids[i], n, sampling):
                out["prompt_ids"].append(list(c.prompt_ids))
                out["completion_ids"].append(list(c.token_ids))
                out["logprobs"].append(list(c.logprobs))
                out[VERSIONS_KWARG].append(str(c.served) if c.served else "")
                served.append(c.served)
            i += n
        # on-policy: generated entirely by the version of this step's weights; without one (not published, or the
        # publish failed) no sample can be shown to come from the trainer's current weights
        off_policy = sum(1 for s in served if s is None or published is None or not s.on_policy(published))
        self.history.append(
            {"step": step, "published": published, "served": out[VERSIONS_KWARG], "off_policy": off_policy}
        )
        metrics = getattr(trainer, "_metrics", {}).get("train")
        if metrics is not None:  # TRL's per-step logs
            metrics["weightsync/off_policy"].append(off_policy / max(len(served), 1))
        return out

    def close(self) -> None:
        self.client.close()
        if self.publisher is not None:
            self.publisher.close()
