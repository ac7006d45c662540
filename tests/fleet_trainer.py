"""A trainer process written the way the README says: ``Publisher.from_env`` and one ``publish`` per step.

The fleet tests start it on its own host and drive it over stdin, one JSON command per line,
so they can inject faults between versions; it answers each with one JSON line on stdout:

    {"seed": 3, "step": 7}               load the weights of ``support.hf_trainer(model, seed=3)`` and publish step 7
    {"seed": 4, "step": 8, "lie": true}  the same, but report another content digest than it sent
                                         (a trainer bug the coordinator must catch; fault injection)
    {"seed": 5, "step": 9, "stall": 30}  the same, but the gather stalls 30 s after its first group, as a
                                         slow trainer would: the fault suite kills a process mid-publish then

Everything else comes from the environment, as in a pod (docs/kubernetes.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    from tests import support
    from weightsync_trainer.publisher import Publisher
    from weightsync_trainer.sources import ModuleSource

    folder = Path(os.environ["TEST_MODEL"])
    model = support.hf_trainer(folder, seed=0, steps=0)
    source = ModuleSource(model)
    publisher = Publisher.from_env(source)
    gather = source.groups
    stall = 0.0

    def stalling() -> Iterator[list[torch.Tensor]]:
        for i, group in enumerate(gather()):
            if i == 1 and stall:
                time.sleep(stall)
            yield group

    assert publisher.client is not None
    honest = publisher.client.report_sent

    def lying(version: int, content_digest: str, failed: Any, **kw: Any) -> Any:
        return honest(version, "sha256:" + "0" * 64, failed, **kw)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        trained = support.hf_trainer(folder, seed=command["seed"])
        with torch.no_grad():
            for mine, theirs in zip(model.parameters(), trained.parameters(), strict=True):
                mine.copy_(theirs)
        publisher.client.report_sent = lying if command.get("lie") else honest  # type: ignore[method-assign]
        stall = float(command.get("stall", 0))
        source.groups = stalling  # type: ignore[method-assign]
        report = publisher.publish(command["step"])
        assert report is not None
        publisher.wait_durable()
        print(json.dumps({**report.to_json(), "durable_errors": publisher.durable_errors}), flush=True)
    publisher.close()


if __name__ == "__main__":
    main()
