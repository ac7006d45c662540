"""What transformers says the published weights generate: the yardstick for an engine.

After an update the engine must behave like the trainer's model with the weights as
they were sent (cast to the wire dtype): the same greedy tokens, and log-probabilities
within the wire dtype's rounding. The comparison is teacher-forced on the engine's own
continuation (see ``agreement``), because free-running greedy decoding of a small random
model amplifies one bf16 near-tie into a different sequence even between transformers'
own bf16 and fp32 runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass
class Agreement:
    """How an engine's greedy output compares with transformers on the same weights."""

    tokens_match: bool
    max_logprob_diff: float
    mismatches: list[str]

    @property
    def ok(self) -> bool:
        return not self.mismatches


def agreement(
    model: torch.nn.Module,
    prompts: list[list[int]],
    outputs: list[tuple[list[int], list[float]]],
    tolerance: float,
    dtype: torch.dtype = torch.bfloat16,
) -> Agreement:
    """Score the engine's greedy continuations with the model, teacher-forced.

    Teacher forcing keeps one near-tie from cascading into a different continuation: at
    every generated position the engine's token must be the model's argmax (unless the
    model's top two are within ``tolerance`` of each other, where bf16 rounding may
    legitimately pick either), and its log-probability must be within ``tolerance``.
    """
    ref = copy.deepcopy(model).to(dtype).eval()
    worst = 0.0
    mismatches: list[str] = []
    exact = True
    with torch.no_grad():
        for p, (prompt, (tokens, logprobs)) in enumerate(zip(prompts, outputs, strict=True)):
            ids = torch.tensor([prompt + tokens])
            logits = ref(input_ids=ids).logits[0].float().log_softmax(-1)
            for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
                row = logits[len(prompt) - 1 + i]
                top2 = row.topk(2)
                diff = abs(float(row[tok]) - lp)
                worst = max(worst, diff)
                if diff > tolerance:
                    mismatches.append(f"prompt {p} token {i}: logprob {lp:.4f} vs transformers {float(row[tok]):.4f}")
                if int(top2.indices[0]) != tok:
                    exact = False
                    margin = float(top2.values[0] - top2.values[1])
                    if margin > tolerance:
                        mismatches.append(
                            f"prompt {p} token {i}: engine chose {tok}, transformers {int(top2.indices[0])} "
                            f"by a margin of {margin:.3f}"
                        )
    return Agreement(exact, worst, mismatches)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, vocab_size: int, seed: int = 0) -> float:
    """One real optimizer step on random token data: enough to change every weight."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (4, 32), generator=g)
    model.train()
    optimizer.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())
