"""TRL's async rollout loop, also reading which weights generated each completion.

``AsyncGRPOTrainer``'s rollout worker runs ``_AsyncRolloutLoop`` in a spawned child and tags
each sample with the trainer's own sync counter at the moment the group started, not with the
weights a replica actually served. This subclass reads the proxy's ``x-weightsync-versions``
header of every ``/v1/completions`` answer, joins a conversation's turns (``Served.span``), and
passes the result on twice: to the reward functions as ``weightsync_versions`` (one string per
completion, ``"12"`` or ``"12,13"``, empty when the endpoint did not say) and into each sample's
metrics as ``weightsync/version_min`` and ``weightsync/version_max``, which the trainer logs per
step.

It subclasses a TRL class, so this module imports TRL at its top; ``trl.tag_versions`` imports
it only when asked (the child unpickles the class by this module's name).
"""

from __future__ import annotations

import contextvars
from typing import Any

import aiohttp
from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, RolloutSample, _AsyncRolloutLoop

from weightsync.served import VERSIONS_HEADER, Served

_SEEN: contextvars.ContextVar[list[Served | None] | None] = contextvars.ContextVar("weightsync_seen", default=None)
"""The versions of one conversation's completions: every conversation runs in its own asyncio task, and a task's
context is its own, so concurrent conversations never mix their lists."""
GENERATE = "/v1/completions"


class VersionedRolloutLoop(_AsyncRolloutLoop):  # type: ignore[misc]
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._served: dict[int, Served | None] = {}
        """By ``id`` of a conversation's completion-id list, which the loop keeps in its group until it is scored."""

    async def _generate_one(self, prompt: Any, tool_dict: Any, tools: Any, group_id: int = 0) -> Any:
        seen: list[Served | None] = []
        token = _SEEN.set(seen)
        try:
            result = await super()._generate_one(prompt, tool_dict, tools, group_id)
        finally:
            _SEEN.reset(token)
        self._served[id(result[1])] = Served.span(seen)
        return result

    async def _post(self, path: str, payload: dict[str, Any], timeout: float, max_retries: int = 3) -> dict[str, Any]:
        """TRL's ``_post``, keeping the versions header of completions."""
        seen = _SEEN.get()

        async def post() -> dict[str, Any]:
            async with self.session.post(
                f"{self.vllm_server_url}{path}", json=payload, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                response.raise_for_status()
                content: dict[str, Any] = await response.json() or {}
                if seen is not None and path == GENERATE:
                    seen.append(Served.parse(response.headers.get(VERSIONS_HEADER)))
                return content

        result: dict[str, Any] = await self._retry(post, label=f"POST {path}", max_attempts=max_retries)
        return result

    async def _score_group(self, group: RolloutGroup) -> list[RolloutSample]:
        served = [self._served.pop(id(ids), None) for ids in group.completions_ids]
        group.reward_kwargs["weightsync_versions"] = [str(s) if s else "" for s in served]
        samples: list[RolloutSample] = await super()._score_group(group)
        rows = [s for s, sequences in zip(served, group.completions_sequences, strict=True) for _ in sequences]
        for sample, s in zip(samples, rows, strict=True):
            if s is not None:
                sample.metrics["weightsync/version_min"] = float(s.low)
                sample.metrics["weightsync/version_max"] = float(s.high)
        return samples
