"""An in-process vLLM engine (``vllm.LLM``, its core in this process) behind the lifecycle's ``EngineControl``.

Used by the sandbox and the tests, where trainer and engine share one process. The
offline API has no request queue to pause, so pause/resume are no-ops; everything
else is vLLM's own weight-transfer lifecycle.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from weightsync.errors import WeightsyncError
from weightsync.sharding.fills import EngineLayout
from weightsync.tensors import TensorTable
from weightsync.vocabulary import Channel
from weightsync_inference import receipts, staging, worker


@contextlib.contextmanager
def _core_in_process() -> Iterator[None]:
    """vLLM's engine core in this process, its workers in processes of their own: by default ``LLM`` starts the core
    in a process of its own too, which imports vLLM again before it starts the workers (on 2 CPU cores a tiny
    model's engine took 59 s to start, 22 s with the core here). The workers stay apart (``OfflineEngine`` asks for
    the ``mp`` executor, which vLLM would otherwise leave for one worker): vLLM's CPU worker sizes its KV cache as
    its share of the machine's memory less its process's (in this process, a trainer's memory or a test run's would
    count against it; a worker here failed to start for that), and sets up OpenMP for its process. vLLM reads the
    switch from the environment only, so it is set for the engine's construction and put back; what a core does to
    its process once it started is undone here, as this process is not only the engine's: vLLM's cache of its
    environment is turned off (settings made later still count) and the heap it froze is thawed (this process's
    objects, the engine's once closed, stay collectable)."""
    from vllm import envs

    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
        envs.disable_envs_cache()
        gc.unfreeze()


class OfflineEngine:
    def __init__(
        self,
        model: str | Path,
        channel: Channel,
        memory_fraction: float = 0.1,
        seed: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        from vllm import LLM

        with _core_in_process():
            self.llm = LLM(
                model=str(model),
                dtype="bfloat16",
                enforce_eager=True,
                gpu_memory_utilization=memory_fraction,
                seed=seed,
                weight_transfer_config={"backend": channel.engine_name},
                worker_extension_cls=worker.QUALNAME,
                **{"distributed_executor_backend": "mp", **llm_kwargs},
            )

    def close(self) -> None:
        """Stop the engine's processes (and its core here) now rather than at interpreter exit."""
        self.llm.llm_engine.engine_core.shutdown()

    def pause(self) -> None:
        """Nothing to pause: the offline engine serves no concurrent requests."""

    def resume(self) -> None:
        """Nothing to resume (see pause)."""

    def is_paused(self) -> bool:
        return False

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start(self) -> None:
        self.llm.start_weight_update()

    def update(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish(self, version: str) -> None:
        self.llm.finish_weight_update(weight_version=version)

    def reset_caches(self) -> None:
        """As ``HttpEngine.reset_caches``, through the offline engine's own calls."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
            raise WeightsyncError("vLLM's prefix cache (or its KV connector's) was not reset")
        self.llm.llm_engine.reset_encoder_cache()

    def weight_version(self) -> str:
        return str(self.llm.get_weight_version())

    between_steps = True
    """Its pause is a no-op anyway: a switch is one call."""

    def switch(self, update_info: dict[str, Any]) -> receipts.Receipt:
        answers = self.llm.collective_rpc("weightsync_switch", args=(json.dumps(update_info),))
        return receipts.merge([receipts.Receipt.from_dict(r) for r in answers])

    def label(self, version: str) -> None:
        self.llm.llm_engine.engine_core.set_weight_version(version)

    def identity(self) -> list[receipts.Identity]:
        return [receipts.Identity.from_dict(r) for r in self.llm.collective_rpc("weightsync_identity")]

    def receipt(self) -> receipts.Receipt:
        return receipts.merge([receipts.Receipt.from_dict(r) for r in self.llm.collective_rpc("weightsync_receipt")])

    def last_table(self) -> TensorTable | None:
        return receipts.last_table(self.llm.collective_rpc("weightsync_table"))

    def engine_layout(self, table: TensorTable) -> EngineLayout:
        """What each worker keeps of ``table``'s tensors (``WorkerExtension.weightsync_layout``), merged."""
        answers = self.llm.collective_rpc("weightsync_layout", args=(json.dumps(table.to_dict()),))
        return EngineLayout.merged(table.layout_digest(), answers)

    def receive_regions(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker receives its regions of a sharded update (``sharded.request``); one answer per worker."""
        return receipts.regions_answers(
            self.llm.collective_rpc("weightsync_receive_regions", args=(json.dumps(request),))
        )

    def release_regions(self) -> list[int]:
        """Every worker lets its region groups go (``WorkerExtension.weightsync_release_regions``)."""
        return [int(a["released"]) for a in self.llm.collective_rpc("weightsync_release_regions")]

    def read_regions(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """Every worker reads its regions of a sharded volume version (``volume_reads.request``); one answer each."""
        answers: list[dict[str, Any]] = self.llm.collective_rpc("weightsync_read_regions", args=(json.dumps(request),))
        return answers

    def parameter_digests(self) -> list[dict[str, str]]:
        """Each worker's digests of the parameters it computes with (``held.parameter_digests``), in worker order."""
        answers: list[dict[str, str]] = self.llm.collective_rpc("weightsync_parameter_digests")
        return answers

    def stage(self, update_info: dict[str, Any], nbytes: int) -> str:
        answers = self.llm.collective_rpc("weightsync_stage", args=(json.dumps(update_info), str(nbytes)))
        return "; ".join(str(a.get("error", "")) for a in answers if not a.get("ok"))

    def stage_status(self) -> staging.StageStatus:
        return staging.merge(
            [staging.StageStatus.from_dict(r) for r in self.llm.collective_rpc("weightsync_stage_status")]
        )

    def greedy(
        self, prompts: list[list[int]], max_tokens: int, lora_request: object | None = None
    ) -> list[tuple[list[int], list[float]]]:
        """Greedy token ids and their log-probabilities for each token-id prompt (optionally with an adapter)."""
        from vllm import SamplingParams, TokensPrompt

        # token ids in and out: no detokenizing, so an engine started without a tokenizer generates too
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False)
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False, lora_request=lora_request
        )
        result = []
        for out in outs:
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            lps = [step[tok].logprob for step, tok in zip(comp.logprobs or [], ids, strict=True)]
            result.append((ids, lps))
        return result
