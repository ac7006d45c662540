"""vLLM's trainer-side API: a trainer asks vLLM's WeightTransferTrainerFactory for the ``weightsync`` engine by name.

Frameworks built on vLLM's trainer-side registry (``TrainerWeightTransferEngine``) build whatever
engine their config names; naming ``weightsync`` gets weightsync's publisher behind the same
``send_weights()``. The training here is plain supervised steps on random tokens (what matters
is that every weight changes and reaches the replicas); ``--report`` records each round's version.

    weightsync run -- python examples/integrations/vllm_trainer.py
"""

from __future__ import annotations

import task


def main() -> None:
    args = task.arguments(__doc__.splitlines()[0]).parse_args()
    from weightsync_trainer.integrations import frameworks
    from weightsync_trainer.integrations import vllm as weightsync_vllm

    try:
        weightsync_vllm.register()  # vLLM's plugin loader does the same in processes that load vLLM's plugins
        init_info = weightsync_vllm.init_info(rank=0)
    except frameworks.UnsupportedFramework as e:
        task.fail_clearly(e)
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from weightsync_trainer import reference
    from weightsync_trainer.integrations import completions

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(task.model_dir(), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the framework's handle on the inference servers: pointed at the OpenAI endpoint, where every development route
    # answers 404, because the weightsync engine never calls it (each replica's agent drives its own engine)
    client = HTTPVLLMWeightSyncClient(completions.endpoint())
    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=ModuleSource(model))
    rounds = []
    for step in range(args.steps):
        loss = reference.train_step(model, optimizer, model.config.vocab_size, seed=step)
        if not args.no_sync:
            engine.send_weights()
        report = engine.last
        rounds.append(
            {
                "step": step,
                "loss": loss,
                "version": report.version if report else 0,
                "state": report and report.state.value,
            }
        )
    engine.shutdown()
    if args.save:
        model.save_pretrained(args.save)
    task.write_report(
        args.report,
        {
            "framework": "vllm.WeightTransferTrainerFactory",
            "engine": type(engine).__name__,
            "rounds": rounds,
            "final_version": rounds[-1]["version"] if rounds else None,
        },
    )


if __name__ == "__main__":
    main()
