"""A small GRPO loop on a task with a verifiable reward, for the embedded demo.

The task: continue a prompt with tokens from a fixed target set (a "vocabulary
pattern" the random model knows nothing about). The reward of a completion is the
fraction of its tokens in the set, so it lies in [0, 1], and a random policy scores
about ``len(TARGETS) / vocab``. GRPO needs no value model: each prompt is sampled
``group`` times, each completion's advantage is its reward minus the group's mean
(divided by the group's std), and the loss is the advantage-weighted negative
log-likelihood of the completion under the trainer's current weights.

Rollouts come from the replicas, so the reward rises only if the weights the trainer
learns reach them: with syncing off, the replicas keep sampling the initial policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TARGET_STRIDE = 8
"""Target tokens: every 8th id above the specials (64 of a 512-token vocabulary)."""


def targets(vocab_size: int) -> frozenset[int]:
    return frozenset(range(3, vocab_size, TARGET_STRIDE))


def reward(tokens: list[int], target_set: frozenset[int]) -> float:
    return sum(t in target_set for t in tokens) / len(tokens) if tokens else 0.0


def prompts(n: int, vocab_size: int, length: int = 4, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, vocab_size, (length - 1,), generator=g).tolist()] for _ in range(n)]


@dataclass
class Rollout:
    prompt: list[int]
    completion: list[int]
    reward: float


def advantages(rollouts: list[Rollout], group: int) -> list[float]:
    out: list[float] = []
    for i in range(0, len(rollouts), group):
        rewards = torch.tensor([r.reward for r in rollouts[i : i + group]])
        std = float(rewards.std()) if len(rewards) > 1 else 0.0
        out += ((rewards - rewards.mean()) / (std + 1e-4)).tolist()
    return out


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rollouts: list[Rollout], group: int) -> float:
    """One policy-gradient step on a batch of rollouts; returns the loss."""
    adv = advantages(rollouts, group)
    model.train()
    optimizer.zero_grad()
    total = torch.zeros(())
    for rollout, a in zip(rollouts, adv, strict=True):
        if a == 0.0 or not rollout.completion:
            continue
        ids = torch.tensor([rollout.prompt + rollout.completion])
        logits = model(input_ids=ids).logits[0, len(rollout.prompt) - 1 : -1].float()
        logp = logits.log_softmax(-1).gather(1, torch.tensor(rollout.completion)[:, None]).sum()
        total = total - a * logp / len(rollouts)
    if not total.requires_grad:  # every group had equal rewards: nothing to learn from
        return 0.0
    total.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return float(total.detach())
