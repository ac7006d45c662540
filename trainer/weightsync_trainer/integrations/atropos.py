"""Atropos: environments generate through the job's endpoint; the trainer publishes instead of restarting vLLM.

Atropos splits a run into environments (``BaseEnv`` subclasses that generate and score), its
trajectory API (``run-api``) and a trainer that pulls batches from it. Its example GRPO trainer
syncs by saving a checkpoint and restarting vLLM; its built-in vLLM server class calls a custom
``/generate`` route. With weightsync:

- an environment selects ``WeightsyncServer`` (``/v1/completions`` through the proxy: token ids,
  logprobs, the versions that made them) with one line, and carries the versions into its
  scored data::

      class MathEnv(BaseEnv):
          server_cls = atropos.WeightsyncServer

          async def collect_trajectories(self, item):
              with atropos.served_versions() as versions:
                  prompt, outputs, logprobs, _ = await self.server.tokens_and_logprobs_completion(
                      input_ids=item, n=self.config.group_size, max_tokens=16)
              ...
              group["overrides"] = atropos.version_overrides(versions)   # one dict per sequence

- the trainer is Atropos's own example trainer loop (its model loading, batches, GRPO loss and
  optimizer step: ``example_trainer``, shipped in the ``atroposlib`` wheel) with the sync
  replaced: ``train(TrainingConfig(...))`` publishes the initial weights, then one version
  after every step, through ``Publisher.from_env``; each batch's versions (from the overrides)
  say how many of its samples were off-policy.

Requires ``atroposlib`` (``weightsync[atropos]``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync.served import Served
from weightsync_trainer.integrations import frameworks

log = logging.getLogger(__name__)
OVERRIDE_KEY = "weightsync_versions"
"""The key of each sequence's ``overrides`` dict: the versions that generated it (``"12"``, ``"12,13"``, or ``""``
when the endpoint did not say)."""
_COLLECTED: contextvars.ContextVar[list[Served | None] | None] = contextvars.ContextVar(
    "weightsync_atropos_versions", default=None
)


def __getattr__(name: str) -> Any:
    if name == "WeightsyncServer":  # imports atroposlib: only when an environment asks for it
        frameworks.require("atropos")
        from weightsync_trainer.integrations import _atropos_server

        return _atropos_server.WeightsyncServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def served_versions() -> Iterator[list[Served | None]]:
    """Collect the versions of every completion ``WeightsyncServer`` generates inside the block, in order (one entry
    per completion; None where the endpoint did not say). The list is shared with tasks the block starts, so a
    request Atropos splits (``n`` above the server manager's ``max_n_completions``) adds every part, in the order
    the parts finish."""
    collected: list[Served | None] = []
    token = _COLLECTED.set(collected)
    try:
        yield collected
    finally:
        _COLLECTED.reset(token)


def record(served: Sequence[Served | None]) -> None:
    """``WeightsyncServer``'s side of ``served_versions`` (a no-op outside such a block)."""
    collected = _COLLECTED.get()
    if collected is not None:
        collected.extend(served)


def version_overrides(versions: Sequence[Served | None]) -> list[dict[str, str]]:
    """A scored group's ``overrides``: one dict per sequence, carrying its versions to the trainer."""
    return [{OVERRIDE_KEY: str(v) if v else ""} for v in versions]


def batch_versions(batch: Mapping[str, Any]) -> list[Served | None]:
    """The versions of every sequence of a batch from Atropos's ``/batch`` (None where a group carried none)."""
    out: list[Served | None] = []
    for group in batch.get("batch") or []:
        overrides = group.get("overrides") or [{}] * len(group.get("tokens", []))
        out += [Served.parse(o.get(OVERRIDE_KEY) or None) for o in overrides]
    return out


@dataclass
class Step:
    """What ``train`` did in one step."""

    step: int
    version: int
    """The version published after this step (0 when not published)."""
    served: list[str] = field(default_factory=list)
    """The versions that generated each sequence it trained on."""
    off_policy: int = 0
    """Sequences not generated entirely by the version of the trainer's weights when the step began."""
    loss: float = 0.0
    reward: float = 0.0
    """The batch's mean score."""


def _next_batch(url: str, timeout_s: float) -> dict[str, Any]:
    from example_trainer import api

    deadline = time.monotonic() + timeout_s
    while True:
        data: dict[str, Any] = api.get_batch(url=url)
        if data.get("batch"):
            return data
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no batch from the Atropos API at {url} within {timeout_s:.0f}s: are its environments running?"
            )
        time.sleep(0.5)


def train(
    config: Any, *, publish: bool = True, env: Mapping[str, str] | None = None, batch_timeout_s: float = 600.0
) -> tuple[list[Step], Any]:
    """Atropos's example trainer loop (``train_legacy``) with weightsync's publish in place of checkpoint-and-restart.

    ``config`` is ``example_trainer.TrainingConfig``; its vLLM fields are unused (the replicas belong to the job).
    ``publish=False`` never syncs: the baseline a run compares against. Returns one ``Step`` per training step and
    the trained model.
    """
    frameworks.require("atropos")
    from example_trainer import api, data, model, trainers, training

    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    trained, _ = model.load_model_and_tokenizer(config)
    optimizer = trainers.create_optimizer(trained, config)
    if not api.check_atropos_api(url=config.atropos_url, timeout=60):
        raise TimeoutError(f"the Atropos API at {config.atropos_url} is not reachable")
    api.register_trainer(config)
    publisher = Publisher.from_env(ModuleSource(trained), os.environ if env is None else env) if publish else None
    policy: int | None = None
    """The version of the trainer's current weights: None when they changed without a READY publish."""
    if publisher is not None:  # the replicas serve the trainer's weights from the first batch on
        report = publisher.publish(0)
        policy = report.version if report is not None and report.state.value == "READY" else None
    steps: list[Step] = []
    try:
        for i in range(config.training_steps):
            raw = _next_batch(config.atropos_url, batch_timeout_s)
            versions = batch_versions(raw)
            scores = [s for group in raw["batch"] for s in group.get("scores", [])]
            tokens, labels, advantages, temperatures, logprobs = data.pad_data_to_good_offset(
                raw, config.batch_size, True
            )
            metrics = training.run_training_step(
                trained,
                optimizer,
                tokens,
                labels,
                advantages,
                temperatures,
                config,
                step_idx=i,
                inference_logprob_batches=logprobs,
            )
            step = Step(
                i + 1,
                0,
                [str(v) if v else "" for v in versions],
                sum(1 for v in versions if v is None or policy is None or not v.on_policy(policy)),
                float(metrics.get("loss", 0.0)),
                sum(scores) / max(len(scores), 1),
            )
            policy = None
            if publisher is not None:
                report = publisher.publish(i + 1)
                if report is not None and report.state.value == "READY":
                    step.version = policy = report.version
            log.info("atropos step %s", asdict(step))
            steps.append(step)
    finally:
        if publisher is not None:
            publisher.close()
    return steps, trained
