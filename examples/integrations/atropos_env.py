"""An Atropos environment that generates through weightsync's replicas: ``server_cls = atropos.WeightsyncServer``.

The task (``task.py``): continue a short prompt with tokens from the target set. Each group is
``group_size`` completions of one prompt through ``/v1/completions`` (token ids, logprobs), scored
by the verifiable reward; ``served_versions`` / ``version_overrides`` carry the weights that
generated each completion into the scored data, so the trainer can count off-policy samples.

    python examples/integrations/atropos_env.py serve --env.rollout_server_url http://ATROPOS_API:8000

(``atropos_trainer.py --start-api-and-env`` starts Atropos's API and this environment itself.)
The OpenAI endpoint is ``$WEIGHTSYNC_OPENAI_URL`` unless ``--openai.base_url`` names one.
"""

from __future__ import annotations

import os
from typing import Any

import task
from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

from weightsync_trainer.integrations import atropos

MAX_TOKENS = 8


class TargetTokensEnv(BaseEnv):  # type: ignore[misc]
    name = "target_tokens"
    server_cls = atropos.WeightsyncServer  # the one line that points an Atropos environment at weightsync

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        model = str(task.model_dir())
        env = BaseEnvConfig(
            tokenizer_name=model,
            wandb_name=cls.name,  # the name it registers under with Atropos's API (required there)
            group_size=8,
            use_wandb=False,
            max_token_length=64,
            total_steps=int(os.environ.get("ATROPOS_TOTAL_STEPS", "12")),
            steps_per_eval=10**9,
            max_num_workers_per_node=4,
            max_batches_offpolicy=1,  # one batch queued ahead: samples lag the trainer by about a version, not three
            ensure_scores_are_not_same=False,
            include_messages=False,
        )
        server = APIServerConfig(model_name="default", tokenizer_name=model, base_url="", timeout=300)
        return env, [server]

    async def setup(self) -> None:
        self.prompts = task.prompts(512, seed=0)
        self.next = 0

    async def get_next_item(self) -> list[int]:
        prompt = self.prompts[self.next % len(self.prompts)]
        self.next += 1
        return list(self.tokenizer.encode(prompt, add_special_tokens=False))

    async def collect_trajectories(self, item: list[int]) -> tuple[ScoredDataGroup, list[Any]]:
        with atropos.served_versions() as versions:
            prompt, outputs, logprobs, _ = await self.server.tokens_and_logprobs_completion(
                input_ids=item, n=self.config.group_size, max_tokens=MAX_TOKENS, temperature=1.0
            )
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for output, lps in zip(outputs, logprobs, strict=True):
            group["tokens"].append(prompt + output)
            group["masks"].append([-100] * len(prompt) + output)
            group["inference_logprobs"].append([1.0] * len(prompt) + lps)
            group["scores"].append(task.reward_of(output))
        group["overrides"] = atropos.version_overrides(versions)
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


if __name__ == "__main__":
    TargetTokensEnv.cli()
