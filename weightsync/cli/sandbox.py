"""Sync one trainer into one real vLLM engine and prove it: the weight-sync sandbox.

The flow of torchforge's weight-sync sandbox, on this machine: initialise a trainer and
a vLLM engine on the same model, run one real optimizer step to create a weight delta,
publish it as version 1, load it into the engine through vLLM's weight-transfer
lifecycle, and verify: the per-tensor digests the engine computed while loading equal
the trainer's, the engine's generation changed (its greedy tokens, or their
log-probabilities by more than bf16 rounding: one step may move every logit without
changing an argmax), and it matches what transformers generates with the published
weights (greedy tokens, log-probabilities within bf16 tolerance). Prompts are token ids,
so a model folder needs no tokenizer files. Prints a report; --json prints it as one JSON
object, on failure too (``verified: false`` and the ``error``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from weightsync.cli._output import stdout_for_json

PROMPTS = [[1, 5, 7, 9], [1, 42, 17, 300, 12]]
# The engine and transformers run different bf16 kernels (fused qkv, other accumulation
# orders): log-probabilities of the same tokens differ by bf16 rounding (~0.03 seen).
LOGPROB_TOLERANCE = 0.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--channel", default="auto", help="cpu, volume, nccl or ipc (default: nccl on a GPU, else cpu)")
    p.add_argument("--model", default=None, help="a local HF model folder (default: the generated --preset)")
    p.add_argument("--preset", default="tiny-qwen2", help="generated model preset when --model is not given")
    p.add_argument("--volume", default=None, help="checkpoint volume folder (default: a temporary folder)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate of the one training step")
    p.add_argument("--tokens", type=int, default=8, help="tokens to generate per verification prompt")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _say(args: argparse.Namespace, msg: str) -> None:
    print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)


def run(args: argparse.Namespace) -> int:
    with stdout_for_json(args.json) as out:
        report: dict[str, Any] = {"verified": False}
        try:
            sync_once(args, report)
        except Exception as e:  # noqa: BLE001 - the report says what failed; a script reads verified: false
            report["error"] = f"{type(e).__name__}: {e}"
        if args.json:
            print(json.dumps(report), file=out)
        elif "error" in report:
            print(f"SANDBOX FAILED: {report['error']}", file=sys.stderr)
        else:
            _print_report(report)
    return 0 if report["verified"] else 1


def sync_once(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Fill ``report`` as the sync goes (what got done stays in it when a step fails)."""
    import torch
    import transformers

    from weightsync.channels import manifests
    from weightsync.channels.base import Rendezvous, UpdateTicket, direct_rendezvous
    from weightsync.channels.cpu import CpuSender
    from weightsync.channels.volume import VolumeSender
    from weightsync.errors import PermanentError
    from weightsync.tensors import manifest_checksum
    from weightsync.vocabulary import Channel, SyncPhase
    from weightsync_inference.lifecycle import Replica
    from weightsync_inference.offline import OfflineEngine
    from weightsync_trainer import reference, tiny_models
    from weightsync_trainer.publisher import send
    from weightsync_trainer.sources import ModuleSource

    channel = (
        Channel.parse(args.channel)
        if args.channel != "auto"
        else (Channel.NCCL if torch.cuda.is_available() else Channel.CPU)
    )
    if channel not in (Channel.CPU, Channel.VOLUME):
        raise PermanentError(
            f"channel {channel.value!r} moves GPU tensors; the sandbox runs vLLM's CPU engine here. "
            "The GPU channels are exercised by tests/gpu and bench/gpu_channels.py on a GPU machine."
        )
    model_dir = Path(args.model) if args.model else tiny_models.generate(args.preset)
    volume = Path(args.volume) if args.volume else Path(tempfile.mkdtemp(prefix="weightsync-sandbox-"))
    report.update(model=str(model_dir), channel=channel.value)
    bar = "=" * 72
    _say(args, f"{bar}\nWEIGHT SYNC SANDBOX\n{bar}\nModel:   {model_dir}\nChannel: {channel.value}\n{bar}")

    t0 = time.perf_counter()
    engine = OfflineEngine(model_dir, channel, skip_tokenizer_init=True)  # token-id prompts: no tokenizer needed
    replica = Replica(engine)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = engine.greedy(PROMPTS, args.tokens)
    report["init_seconds"] = time.perf_counter() - t0
    _say(args, f"✓ Initialisation complete ({report['init_seconds']:.2f}s)")

    _say(args, "[1/4] Running one training step to create a weight delta...")
    t0 = time.perf_counter()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
    loss = reference.train_step(trainer, optimizer, trainer.config.vocab_size)
    _say(args, f"✓ Training step complete (loss {loss:.3f}, {time.perf_counter() - t0:.2f}s)")

    source = ModuleSource(trainer)
    table = source.table()
    sender: Any
    if channel is Channel.CPU:
        sender = CpuSender()
        rdv = direct_rendezvous(sender.offer(), join_timeout_s=60)  # the engine joins after it is planned
        sender.take_plan({"sandbox": rdv})
    else:
        sender = VolumeSender(volume)
        rdv = Rendezvous(Channel.VOLUME, root=str(volume))
    replica.init_transfer(rdv.to_dict())
    sent = UpdateTicket(1, channel, table, table.layout_digest(), step=1)

    _say(args, f"[2/4] Publishing version 1 over {channel.value}...")
    digests: dict[str, str] = {}
    t_publish = time.perf_counter()

    def publish() -> None:
        digests.update(send(source, sender, sent).digests)

    if channel is Channel.VOLUME:
        publish()
        publish_seconds = time.perf_counter() - t_publish
        _say(args, f"✓ Published ({publish_seconds:.3f}s)")
        _say(args, "[3/4] Updating the engine from the volume...")
        checksum = manifest_checksum(manifests.manifest_path(volume, 1).read_bytes())
        outcome = replica.apply(
            UpdateTicket(1, channel, layout_digest=table.layout_digest(), manifest_checksum=checksum, step=1)
        )
    else:
        _say(args, "[3/4] Updating the engine while the trainer streams...")
        outcome = replica.apply(UpdateTicket(1, channel, layout_digest=table.layout_digest(), step=1), send=publish)
        publish_seconds = time.perf_counter() - t_publish
    update_seconds = outcome.seconds[SyncPhase.TOTAL]
    report.update(
        publish_seconds=publish_seconds,
        update_seconds=update_seconds,
        bytes=table.total_bytes,
        tensors=len(table),
    )
    total = publish_seconds + update_seconds if channel is Channel.VOLUME else update_seconds
    report["total_seconds"] = total
    report["gb_per_s"] = table.total_bytes / total / 1e9
    _say(args, f"✓ Engine holds version {engine.weight_version()} ({update_seconds:.3f}s)")

    _say(args, "[4/4] Verifying: digests, generation, transformers reference...")
    after = engine.greedy(PROMPTS, args.tokens)
    agreement = reference.agreement(trainer, PROMPTS, after, LOGPROB_TOLERANCE)
    receipt = outcome.receipt
    report["digests_verified"] = len(digests) == len(table) and dict(receipt.digests) == digests
    report["in_place"] = len(receipt.in_place)
    report["logprob_change"] = _logprob_change(before, after)
    report["generation_changed"] = [a[0] for a in after] != [b[0] for b in before] or (
        report["logprob_change"] > LOGPROB_TOLERANCE
    )
    report["tokens_match"] = agreement.tokens_match
    report["max_logprob_diff"] = agreement.max_logprob_diff
    report["mismatches"] = agreement.mismatches
    report["verified"] = bool(report["digests_verified"] and report["generation_changed"] and agreement.ok)
    report["sample_tokens"] = after[0][0]
    sender.close()


def _logprob_change(before: list[tuple[list[int], list[float]]], after: list[tuple[list[int], list[float]]]) -> float:
    """The largest change of a greedy token's log-probability, over each prompt's tokens until they first differ."""
    change = 0.0
    for (tokens_b, lps_b), (tokens_a, lps_a) in zip(before, after, strict=True):
        for tb, ta, lb, la in zip(tokens_b, tokens_a, lps_b, lps_a, strict=True):
            if tb != ta:
                break
            change = max(change, abs(la - lb))
    return change


def _print_report(report: dict[str, Any]) -> None:
    bar = "=" * 72
    mark = "yes" if report["verified"] else "NO"
    print(
        f"{bar}\nWEIGHT SYNC COMPLETE\n{bar}\n"
        f"Model:              {report['model']}\n"
        f"Channel:            {report['channel']}\n"
        f"Publish time:       {report['publish_seconds']:.3f}s\n"
        f"Update time:        {report['update_seconds']:.3f}s\n"
        f"Total sync time:    {report['total_seconds']:.3f}s\n"
        f"Bytes:              {report['bytes']} ({report['tensors']} tensors), {report['gb_per_s']:.3f} GB/s\n"
        f"Digests verified:   {report['digests_verified']}\n"
        f"Generation changed: {report['generation_changed']} (max |Δlogprob| {report['logprob_change']:.4f})\n"
        f"Matches transformers: {not report['mismatches']} (greedy tokens identical: {report['tokens_match']}, "
        f"max |Δlogprob| {report['max_logprob_diff']:.4f})\n"
        f"Sample tokens:      {report['sample_tokens']}\n"
        f"Verified:           {mark}\n{bar}"
    )
