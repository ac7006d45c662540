"""The embedded RL demo: a GRPO loop whose reward rises only because weights reach the replicas.

On this machine, as real processes: a coordinator, two vLLM CPU replicas (each with its
agent and its OpenAI-only proxy) and a trainer. Every step the trainer samples rollouts
from the replicas, scores them with a verifiable reward (the share of tokens from a
target set), takes a GRPO step, and publishes the new weights through the coordinator:
the CPU stream to live replicas, the checkpoint volume for durability. Midway one
replica is killed and restarted; it catches up from the volume and follows again.
With --kill-coordinator-at the coordinator is killed too; the fleet restarts it (as
Kubernetes restarts its pod) and the trainer and agents ride through.

With --no-sync the replicas keep the initial weights, and the reward stays flat.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from weightsync.cli._output import stdout_for_json

REPLICAS = ("replica-0", "replica-1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=16, help="training steps (default 16)")
    p.add_argument("--no-sync", action="store_true", help="never publish: replicas keep the initial weights")
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="step at which replica-1 is killed and restarted (default: steps/2; -1: never)",
    )
    p.add_argument(
        "--kill-coordinator-at",
        type=int,
        default=-1,
        help="step after whose publish the coordinator is SIGKILLed; the fleet restarts it, and trainer and "
        "agents ride through (default -1: never)",
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt, GRPO's group (default 8)")
    p.add_argument("--tokens", type=int, default=8, help="tokens per completion (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, sampling and init (default 0)")
    p.add_argument("--preset", default="tiny-qwen2", help="generated model preset (default tiny-qwen2)")
    p.add_argument("--workdir", default=None, help="where the volume and the logs go (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _sample(url: str, prompts: list[list[int]], group: int, tokens: int, seed: int) -> list[list[int]]:
    import httpx

    body = {
        "prompt": prompts,
        "n": group,
        "max_tokens": tokens,
        "temperature": 1.0,
        "seed": seed,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120.0, trust_env=False)
    answer.raise_for_status()
    choices = sorted(answer.json()["choices"], key=lambda c: int(c["index"]))
    return [[int(t) for t in c["token_ids"]] for c in choices]


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so the fleet's processes are stopped on the way out


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupted)
    with stdout_for_json(args.json) as out:
        result = _run(args, out if not args.json else sys.stderr)
        if args.json:
            print(json.dumps(result), file=out)
        else:
            _print_summary(result)
    return 0


def _run(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    import torch
    import transformers

    from weightsync import metrics
    from weightsync.cli._localfleet import LocalFleet
    from weightsync.coordinator.client import CoordinatorClient
    from weightsync_trainer import grpo, tiny_models
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    def log(msg: str) -> None:
        print(msg, file=say, flush=True)

    torch.manual_seed(args.seed)
    kill_at = args.steps // 2 if args.kill_at is None else args.kill_at
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    model_dir = tiny_models.generate(args.preset)
    fleet = LocalFleet(workdir, model_dir)
    log(f"work dir {workdir} (volume, logs); model {model_dir}")
    publisher: Publisher | None = None
    client: CoordinatorClient | None = None
    rewards: list[float] = []
    steps: list[dict[str, Any]] = []
    by_phase: dict[str, dict[str, float]] = {}
    try:
        fleet.start_coordinator()
        replicas = [fleet.start_replica(r) for r in REPLICAS]
        log(f"starting the coordinator and {len(replicas)} vLLM replicas (about a minute)...")
        t0 = time.perf_counter()
        fleet.wait_healthy(replicas, timeout_s=600)
        log(f"fleet up in {time.perf_counter() - t0:.0f}s")
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        targets = grpo.targets(model.config.vocab_size)
        client = CoordinatorClient(fleet.coordinator_address, insecure=True, timeout_s=60.0)  # rides out restarts
        fleet.wait_registered(client, timeout_s=120)
        if not args.no_sync:
            publisher = Publisher(
                ModuleSource(model),
                CoordinatorClient(fleet.coordinator_address, insecure=True),
                job=fleet.job,
                channels_=fleet.config.channels,
                node="localhost",
                checkpoint_dir=fleet.volume,
                config=fleet.config,
                timeout_s=fleet.config.transfer_timeout_s,
                version_timeout_s=fleet.config.timeout_s,
            )
        for step in range(args.steps):
            if step == kill_at and not args.no_sync:
                log(f"step {step}: killing {REPLICAS[1]} (vLLM, agent, proxy) and starting it again")
                fleet.replicas[REPLICAS[1]].stop(sig=9)
                fleet.start_replica(REPLICAS[1])
            live = [r for r in fleet.replicas.values() if r.healthy()]
            prompts = grpo.prompts(args.prompts, model.config.vocab_size, seed=args.seed * 1000 + step)
            rollouts: list[grpo.Rollout] = []
            for i, r in enumerate(live):
                share = prompts[i :: len(live)]
                if not share:
                    continue
                completions = _sample(r.url, share, args.group, args.tokens, seed=args.seed * 1000 + step * 10 + i)
                for j, completion in enumerate(completions):
                    prompt = share[j // args.group]
                    rollouts.append(grpo.Rollout(prompt, completion, grpo.reward(completion, targets)))
            reward = statistics.fmean(r.reward for r in rollouts)
            rewards.append(reward)
            grpo.train_step(model, optimizer, rollouts, args.group)
            record: dict[str, Any] = {"step": step, "reward": reward, "replicas_sampled": [r.replica_id for r in live]}
            if publisher is not None:
                report = publisher.publish(step)
                assert report is not None  # rank 0
                record |= {
                    "version": report.version,
                    "state": report.state.value,
                    "channels": report.channels,
                    "sync_seconds": report.seconds["total"],
                    "sync_phases": report.seconds,
                    "failed": report.failed,
                }
            record["served"] = _served(client, fleet.job)
            steps.append(record)
            served = " ".join(f"{k}=v{v}" for k, v in record["served"].items())
            sync = (
                f" | v{record['version']} {record['state']} in {record['sync_seconds']:.2f}s via "
                f"{','.join(sorted(set(record['channels'].values())))}"
                if publisher
                else ""
            )
            log(f"step {step + 1:3}/{args.steps} reward {reward:.3f} | serving {served}{sync}")
            if step == args.kill_coordinator_at:
                log(f"step {step}: killing the coordinator (SIGKILL); the fleet restarts it")
                fleet.kill_coordinator()
        catch_up = _wait_caught_up(fleet, client, publisher, log) if publisher else {}
        totals = metrics.sync_seconds_totals(f"http://127.0.0.1:{fleet.coordinator_metrics_port}/metrics")
        by_phase = {k: {"count": n, "mean": total / n} for k, (n, total) in totals.items() if n}
    finally:
        if publisher is not None:
            publisher.close()
        if client is not None:
            client.close()
        fleet.stop()
    q = max(1, args.steps // 4)
    first, last = statistics.fmean(rewards[:q]), statistics.fmean(rewards[-q:])
    sync_times = [s["sync_seconds"] for s in steps if "sync_seconds" in s]
    return {
        "sync": not args.no_sync,
        "steps": steps,
        "rewards": rewards,
        "reward_first_quarter": first,
        "reward_last_quarter": last,
        "reward_gain": last - first,
        "sync_latency_seconds": _latency(sync_times),
        "publish_phases_p50": _phases_p50([s["sync_phases"] for s in steps if "sync_phases" in s]),
        "sync_latency_by_phase": by_phase,
        "catch_up": catch_up,
        "coordinator_starts": fleet.coordinator_starts,
        "metrics": {
            "coordinator": f"http://127.0.0.1:{fleet.coordinator_metrics_port}/metrics",
            **{r.replica_id: f"http://127.0.0.1:{r.metrics_port}/metrics" for r in fleet.replicas.values()},
        },
        "workdir": str(workdir),
    }


def _served(client: Any, job: str) -> dict[str, int]:
    info = client.get_job(job)
    return {m.member_id: m.current_version for m in info.members if m.role.value.lower() == "replica"}


def _wait_caught_up(fleet: Any, client: Any, publisher: Any, log: Any) -> dict[str, Any]:
    """After the loop: the restarted replica must hold the newest durable version, loaded from the volume."""
    publisher.wait_durable()
    t0 = time.perf_counter()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        info = client.get_job(fleet.job)
        served = _served(client, fleet.job)
        if served and all(v >= info.newest_durable_ready > 0 for v in served.values()) and len(served) == len(REPLICAS):
            log(
                f"all replicas serve v{info.newest_durable_ready} ({time.perf_counter() - t0:.1f}s after the last step)"
            )
            return {"newest_durable_ready": info.newest_durable_ready, "served": served}
        time.sleep(0.5)
    return {
        "newest_durable_ready": client.get_job(fleet.job).newest_durable_ready,
        "served": _served(client, fleet.job),
        "timed_out": True,
    }


def _phases_p50(reports: list[dict[str, float]]) -> dict[str, float]:
    """The median of each of the publisher's phases (a phase a publish did not go through counts as 0)."""
    names = dict.fromkeys(name for r in reports for name in r)
    return {name: statistics.median(r.get(name, 0.0) for r in reports) for name in names}


def _latency(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)
    return {
        "count": len(ordered),
        "p50": statistics.median(ordered),
        "max": ordered[-1],
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


def _print_summary(result: dict[str, Any]) -> None:
    bar = "=" * 72
    curve = " ".join(f"{r:.2f}" for r in result["rewards"])
    print(f"{bar}\nREWARD CURVE ({'sync on' if result['sync'] else 'sync OFF'})\n{curve}")
    print(
        f"first quarter {result['reward_first_quarter']:.3f} -> last quarter {result['reward_last_quarter']:.3f} "
        f"(gain {result['reward_gain']:+.3f})"
    )
    lat = result["sync_latency_seconds"]
    if lat:
        print(
            f"\nSYNC LATENCY (publish -> READY, cpu stream + volume)\n  versions {lat['count']}  "
            f"p50 {lat['p50']:.3f}s  p90 {lat['p90']:.3f}s  max {lat['max']:.3f}s"
        )
        phases = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in result["publish_phases_p50"].items())
        print(f"  the trainer's wait by phase, p50 ms: {phases}")
    if result["sync_latency_by_phase"]:
        print("\nSYNC LATENCY BY PHASE AND CHANNEL (replicas' acks, from the coordinator's /metrics; total - the rest")
        print("  = the agent's start/finish/receipt calls to vLLM)")
        print(f"  {'phase/channel':24} {'count':>6} {'mean s':>9}")
        for key, row in sorted(result["sync_latency_by_phase"].items()):
            print(f"  {key:24} {int(row['count']):6d} {row['mean']:9.3f}")
    if result["catch_up"]:
        print(f"\nCATCH-UP: {result['catch_up']}")
    print("\nMETRICS were served at:")
    for name, url in result["metrics"].items():
        print(f"  {name:12} {url}")
    print(f"\nlogs and volume: {result['workdir']}\n{bar}")
