"""weightsync from the trainers people already run: one small module per framework.

Each module imports its framework lazily (importing ``weightsync_trainer.integrations.trl``
does not import TRL until it is used) and checks the installed version against the range
weightsync was tested with (``frameworks.SUPPORTED``); each framework has its own extra, so
the trainer image does not grow by default:

- ``trl`` (``weightsync[trl]``): ``WeightTransfer`` for ``AsyncGRPOTrainer(weight_transfer=...)``,
  ``RolloutFunc`` for ``GRPOTrainer(rollout_func=...)``;
- ``atropos`` (``weightsync[atropos]``): ``WeightsyncServer`` for ``BaseEnv.server_cls``, ``train`` (the
  example trainer's loop, publishing instead of checkpoint-and-restart);
- ``vllm`` (``weightsync[vllm-trainer]``): the ``weightsync`` engine of vLLM's ``WeightTransferTrainerFactory``;
- ``verl`` (``weightsync[verl]``): the ``weightsync`` backend of verl's ``CheckpointEngineRegistry``.

Shared pieces: ``streams`` publishes the ``(name, tensor)`` streams frameworks hand over,
``completions`` asks the job's OpenAI endpoint (``$WEIGHTSYNC_OPENAI_URL``) for token ids,
logprobs and the weight versions that generated them. docs/integrations.md is the guide.
"""
