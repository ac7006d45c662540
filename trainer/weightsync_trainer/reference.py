"""What transformers says the published weights generate: the yardstick for an engine.

After an update the engine must behave like the trainer's model with the weights as
they were sent (cast to the wire dtype): the same greedy tokens, and log-probabilities
within the wire dtype's rounding. This runs the trainer's model, cast to that dtype, on
token-id prompts.
"""

from __future__ import annotations

import copy

import torch


def greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype = torch.bfloat16
) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation of each prompt and the log-probability of each chosen token."""
    ref = copy.deepcopy(model).to(dtype).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens: list[int] = []
            logprobs: list[float] = []
            for _ in range(max_tokens):
                logits = ref(input_ids=ids).logits[0, -1].float().log_softmax(-1)
                tok = int(logits.argmax())
                tokens.append(tok)
                logprobs.append(float(logits[tok]))
                ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            out.append((tokens, logprobs))
    return out


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
