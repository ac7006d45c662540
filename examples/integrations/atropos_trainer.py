"""Atropos's example GRPO trainer loop with weightsync's publish in place of checkpoint-and-restart.

``atropos.train`` runs Atropos's own pieces (model loading, ``/batch`` polling, the GRPO loss and
optimizer step of ``example_trainer``) and publishes the initial weights, then one version per
step; the batches' ``overrides`` say which weights generated each sample.

    weightsync run -- python examples/integrations/atropos_trainer.py --start-api-and-env            # reward rises
    weightsync run -- python examples/integrations/atropos_trainer.py --start-api-and-env --no-sync  # stays flat

starts Atropos's trajectory API (``run-api``) and ``atropos_env.py`` beside the trainer; in a
cluster they run where you run them and ``--atropos-url`` names the API.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import task

HERE = Path(__file__).resolve().parent


def _start_api_and_env(port: int, steps: int) -> list[subprocess.Popen[bytes]]:
    api = subprocess.Popen([sys.executable, "-m", "atroposlib.cli.run_api", "--port", str(port)])
    time.sleep(5)
    env = {**os.environ, "ATROPOS_TOTAL_STEPS": str(steps)}
    flags = ["--env.rollout_server_url", f"http://127.0.0.1:{port}", "--slurm", "false"]
    return [api, subprocess.Popen([sys.executable, str(HERE / "atropos_env.py"), "serve", *flags], env=env)]


def main() -> None:
    p = task.arguments(__doc__.splitlines()[0])
    p.add_argument("--atropos-url", default="http://127.0.0.1:8000", help="Atropos's trajectory API")
    p.add_argument("--start-api-and-env", action="store_true", help="run Atropos's API and atropos_env.py here")
    args = p.parse_args()
    from weightsync_trainer.integrations import atropos, frameworks

    try:
        frameworks.require("atropos")
    except frameworks.UnsupportedFramework as e:
        task.fail_clearly(e)
    import torch
    from example_trainer import TrainingConfig

    torch.manual_seed(args.seed)
    started = _start_api_and_env(int(args.atropos_url.rsplit(":", 1)[1]), args.steps) if args.start_api_and_env else []
    try:
        config = TrainingConfig(
            model_name=str(task.model_dir()),
            lr=5e-3,
            training_steps=args.steps,
            batch_size=32,  # 4 groups of 8 completions per step, one micro-batch
            gradient_accumulation_steps=1,
            seq_len=64,
            device="cuda" if torch.cuda.is_available() else "cpu",
            save_path=task.scratch_dir("atropos-"),
            atropos_url=args.atropos_url,
            weight_bridge_mode="none",
            use_wandb=False,
        )
        steps, model = atropos.train(config, publish=not args.no_sync)
        if args.save:
            model.save_pretrained(args.save)
        task.write_report(
            args.report,
            {
                "framework": "atropos",
                "rewards": [s.reward for s in steps],
                "steps": [dataclasses.asdict(s) for s in steps],
                "final_version": steps[-1].version if steps else None,
            },
        )
    finally:
        for proc in started:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
