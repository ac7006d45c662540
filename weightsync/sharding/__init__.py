"""The sharded path's contracts, torch-free: layouts on both sides and the transfer plan.

- ``boxes``: the geometry (a block of a tensor) both layouts and the plan speak;
- ``shards``: the trainer's layout, which rank holds which box of each tensor (DTensor placements);
- ``fills``: the engine's layout, what each vLLM worker keeps of each checkpoint tensor and where it lands;
- ``plans``: the transfer plan from the two, and its cache;
- ``links``: which of a plan's links (trainer rank, worker) have both ends on one GPU (copied over CUDA IPC).

The trainer builds its layout in ``weightsync_trainer.layouts``; each vLLM worker records its own in
``weightsync_inference.recording``; the coordinator plans (``plans.PlanCache``) and hands each side its part.
"""
