"""The product's vLLM worker extension plus one fault no test can cause from outside the worker.

A bit of a staged version flipped after the stage verified it (memory going bad between
the stage and the switch): the switch's own check must catch it after the bytes reached
the parameters, which is how a staged switch tears. Reached like the product's methods,
over vLLM's ``/collective_rpc``; everything else is ``WorkerExtension`` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync_inference.worker import WorkerExtension

QUALNAME = "tests.integration.faulty_worker.FaultyWorkerExtension"


class FaultyWorkerExtension(WorkerExtension):
    def weightsync_test_flip_staged_bit(self, name: str) -> dict[str, Any]:
        stager = self._weightsync_engine().updater.stager
        view = stager._views[name]
        view.view(torch.uint8).view(-1)[0] ^= 1
        return {"flipped": name}
