"""TRL's GRPOTrainer with weightsync: generation through the job's replicas, one version per step.

The lines that differ from a plain GRPOTrainer script are the ``RolloutFunc`` (publish when the
step changed, then generate every completion through ``$WEIGHTSYNC_OPENAI_URL``) and the last
``rollout.sync(trainer)`` (the final weights). Reward functions receive ``weightsync_versions``:
which weights generated each completion.

    weightsync run -- python examples/integrations/trl_grpo.py            # reward rises from ~0.13
    weightsync run -- python examples/integrations/trl_grpo.py --no-sync  # stays flat: replicas keep the initial policy
"""

from __future__ import annotations

from typing import Any

import task


def main() -> None:
    args = task.arguments(__doc__.splitlines()[0]).parse_args()
    from weightsync_trainer.integrations import frameworks
    from weightsync_trainer.integrations import trl as weightsync_trl

    try:
        rollout = weightsync_trl.RolloutFunc(publish=not args.no_sync)
    except frameworks.UnsupportedFramework as e:
        task.fail_clearly(e)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    path = task.model_dir()
    served: list[list[str]] = []

    def reward(completion_ids: list[list[int]], weightsync_versions: list[str], **_: Any) -> list[float]:
        served.append(weightsync_versions)
        return [task.reward_of(ids) for ids in completion_ids]

    config = GRPOConfig(
        output_dir=task.scratch_dir("trl-grpo-"),
        max_steps=args.steps,
        per_device_train_batch_size=32,  # 4 prompts x 8 completions per step
        num_generations=8,
        max_completion_length=8,
        temperature=1.0,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": task.prompts(512, args.seed)}),
        processing_class=AutoTokenizer.from_pretrained(path),
        rollout_func=rollout,
    )
    trainer.train()
    final = rollout.sync(trainer)  # no generation follows the last step: publish its weights explicitly
    rollout.close()
    if args.save:
        trainer.model.save_pretrained(args.save)
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    task.write_report(
        args.report,
        {
            "framework": "trl.GRPOTrainer",
            "rewards": rewards,
            "steps": rollout.history,
            "final_version": final,
            "reward_funcs_saw": served,
        },
    )


if __name__ == "__main__":
    main()
