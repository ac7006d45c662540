"""TRL's AsyncGRPOTrainer with weightsync: its weight_transfer publishes each sync through the coordinator.

What differs from a plain AsyncGRPOTrainer script: ``vllm_server_base_url`` is the job's OpenAI
endpoint (the weightsync proxy forwards ``/v1/completions``, ``/health`` and ``/v1/models``),
``weight_transfer=weightsync_trl.WeightTransfer()``, and ``weightsync_trl.tag_versions(trainer)``
so samples and reward functions see which weights generated them (logged per step as
``weightsync/version_min`` and ``weightsync/version_max``).

    weightsync run -- python examples/integrations/trl_async_grpo.py            # reward rises from ~0.13
    weightsync run -- python examples/integrations/trl_async_grpo.py --no-sync  # stays flat: the initial policy serves

TRL's rollout worker names the model by the trainer's model path: the replicas must serve the
same name (``weightsync run`` serves ``$WEIGHTSYNC_MODEL``; in a cluster, ``--served-model-name``).
"""

from __future__ import annotations

from typing import Any

import task


def reward(completion_ids: list[list[int]], weightsync_versions: list[str], **_: Any) -> list[float]:
    """Module-level: TRL's rollout worker runs reward functions in a spawned process."""
    return [task.reward_of(ids) for ids in completion_ids]


def cpu_stand_ins() -> None:
    """AsyncGRPOTrainer trains with a FlashAttention-3 kernel it fetches for CUDA and reads the GPU's peak FLOPs at
    start. Without a GPU (this repository's CI), register the same variable-length causal attention in plain torch
    and report no peak FLOPs (MFU is then not logged). On a GPU, none of this runs."""
    import types

    import torch
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    def varlen(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, _max_q: Any, _max_k: Any, **kw: Any) -> Any:
        out = torch.empty_like(q)
        repeat = q.shape[1] // k.shape[1]
        for i in range(len(cu_q) - 1):
            qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            qi = q[qs:qe].transpose(0, 1)
            ki, vi = (x[ks:ke].repeat_interleave(repeat, 1).transpose(0, 1) for x in (k, v))
            causal = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
            attn = torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=causal, scale=kw.get("softmax_scale")
            )
            out[qs:qe] = attn.transpose(0, 1)
        return out

    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen)
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None


def main() -> None:
    args = task.arguments(__doc__.splitlines()[0]).parse_args()
    from weightsync_trainer.integrations import frameworks
    from weightsync_trainer.integrations import trl as weightsync_trl

    try:
        transfer = weightsync_trl.WeightTransfer(publish=not args.no_sync)
    except frameworks.UnsupportedFramework as e:
        task.fail_clearly(e)
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    if not torch.cuda.is_available():
        cpu_stand_ins()
    torch.manual_seed(args.seed)
    path = task.model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = qwen3_chat_template  # the tiny tokenizer has none; TRL parses replies by this one
    config = AsyncGRPOConfig(
        output_dir=task.scratch_dir("trl-async-grpo-"),
        vllm_server_base_url=weightsync_trl.endpoint(),
        max_steps=args.steps,
        per_device_train_batch_size=32,  # 4 prompts x 8 completions per step
        token_budget=0,  # exactly those 32: TRL's default budget (the server's max_model_len) would pack about 15
        num_generations=8,
        max_completion_length=8,
        max_staleness=1,  # samples from the weights of this step or the one before; older ones are dropped
        temperature=1.0,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dtype="float32",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=args.seed,
    )
    prompts = [[{"role": "user", "content": p}] for p in task.prompts(512, args.seed)]
    trainer = AsyncGRPOTrainer(
        model=str(path),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        weight_transfer=transfer,
    )
    weightsync_trl.tag_versions(trainer)
    trainer.train()  # TRL syncs after every step, the last one included
    if args.save:
        trainer.model.save_pretrained(args.save)
    logs = [e for e in trainer.state.log_history if "reward" in e]
    task.write_report(
        args.report,
        {
            "framework": "trl.AsyncGRPOTrainer",
            "rewards": [e["reward"] for e in logs],
            "published": transfer.versions,
            "served_min": [e.get("weightsync/version_min") for e in logs],
            "served_max": [e.get("weightsync/version_max") for e in logs],
            "final_version": transfer.versions[-1] if transfer.versions else None,
        },
    )


if __name__ == "__main__":
    main()
