"""``WeightsyncServer``: the Atropos ``APIServer`` an environment selects with one line.

Atropos's built-in vLLM server class posts to a custom ``/generate`` route that neither stock
vLLM's OpenAI server nor the weightsync proxy serves. This one generates through
``/v1/completions`` with token-id prompts (``completions.AsyncClient``): the tokens and logprobs
GRPO needs, and the proxy's version header, which ``atropos.served_versions`` collects. It
subclasses Atropos's ``APIServer``, so this module imports ``atroposlib`` at its top;
``atropos.WeightsyncServer`` imports it on first use.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from atroposlib.envs.server_handling.server_baseline import APIServer, APIServerConfig, ReasoningConfig
from openai.types.chat.chat_completion import ChatCompletion, Choice
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.completion import Completion
from openai.types.completion_choice import CompletionChoice
from transformers import AutoTokenizer

from weightsync_trainer.integrations import atropos, completions

_ALIASES = {"max_new_tokens": "max_tokens", "max_completion_tokens": "max_tokens"}


class WeightsyncServer(APIServer):  # type: ignore[misc]
    """An Atropos server over the job's OpenAI endpoint: ``config.base_url`` (with or without ``/v1``), or
    ``$WEIGHTSYNC_OPENAI_URL`` when it is empty. The tokenizer (``tokenizer_name``, else ``model_name``) turns text
    prompts into token ids; ``model_name`` is sent only when it is not Atropos's placeholder ``"default"``."""

    def __init__(self, config: APIServerConfig, reasoning_config: ReasoningConfig | None = None) -> None:
        self.client = completions.AsyncClient(config.base_url or None, timeout_s=float(config.timeout))
        name = config.model_name if config.tokenizer_name == "none" else config.tokenizer_name
        self.tokenizer = AutoTokenizer.from_pretrained(name)
        self.model = None if config.model_name == "default" else config.model_name
        super().__init__(config, reasoning_config=reasoning_config)

    async def check_server_status_task(self, chat_completion: bool = True) -> None:
        while True:
            self.server_healthy = await self.client.healthy()
            await asyncio.sleep(1)

    def _request(self, kwargs: dict[str, Any]) -> tuple[list[int], int, completions.Sampling]:
        args = {_ALIASES.get(k, k): v for k, v in kwargs.items()}
        if "input_ids" in args:
            prompt_ids = list(args["input_ids"])
        elif "prompt" in args:
            prompt_ids = self.tokenizer.encode(args["prompt"], add_special_tokens=False)
        else:
            raise ValueError("WeightsyncServer needs input_ids or prompt")
        sampling = completions.Sampling(
            max_tokens=int(args.get("max_tokens", 16)),
            temperature=float(args.get("temperature", 1.0)),
            top_p=float(args.get("top_p", 1.0)),
            seed=args.get("seed"),
            model=self.model,
        )
        return prompt_ids, int(args.get("n", 1)), sampling

    async def _generate(self, kwargs: dict[str, Any]) -> list[completions.Completion]:
        prompt_ids, n, sampling = self._request(kwargs)
        out = await self.client.complete(prompt_ids, n, sampling)
        atropos.record([c.served for c in out])
        return out

    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list[int], list[list[int]], list[list[float]], list[str]]:
        out = await self._generate(kwargs)
        prompt = list(out[0].prompt_ids) if out else []
        return (
            prompt,
            [list(c.token_ids) for c in out],
            [list(c.logprobs) for c in out],
            [c.finish_reason for c in out],
        )

    def _texts(self, out: list[completions.Completion]) -> list[tuple[int, str, Any]]:
        """Each completion's index, decoded text and an OpenAI finish reason."""
        reasons = ("stop", "length")
        return [
            (i, self.tokenizer.decode(c.token_ids), c.finish_reason if c.finish_reason in reasons else "stop")
            for i, c in enumerate(out)
        ]

    def _envelope(self, prefix: str, kind: str) -> dict[str, Any]:
        """The fields an OpenAI answer carries besides its choices."""
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.model or "default",
            "object": kind,
        }

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        out = await self._generate(kwargs)
        choices = [CompletionChoice(index=i, text=text, finish_reason=why) for i, text, why in self._texts(out)]
        return Completion(**self._envelope("cmpl", "text_completion"), choices=choices)

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        """Chat through the tokenizer's chat template and ``/v1/completions``: the same tokens a trainer scores."""
        messages = kwargs.pop("messages")
        # rendered, then encoded: with tokenize=True transformers 5 returns a BatchEncoding, not the ids
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        kwargs["input_ids"] = self.tokenizer.encode(text, add_special_tokens=False)
        out = await self._generate(kwargs)
        choices = [
            Choice(index=i, message=ChatCompletionMessage(role="assistant", content=text), finish_reason=why)
            for i, text, why in self._texts(out)
        ]
        return ChatCompletion(**self._envelope("chatcmpl", "chat.completion"), choices=choices)
