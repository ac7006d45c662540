"""vLLM worker extension: what the agent asks each worker through ``collective_rpc``.

Started with ``--worker-extension-cls weightsync_inference.worker.WorkerExtension``
(the operator and the embedded default add it), vLLM mixes these methods into its
worker class; the agent calls them over the dev-mode ``/collective_rpc`` route (on
localhost only, like the other dev routes) or ``LLM.collective_rpc``, and gets one
answer per worker:

- ``weightsync_identity``: rank, device, GPU UUID, NIXL (what the agent registers);
- ``weightsync_receipt``: the receipt of the worker's last update (digests computed
  where the bytes landed, phase times, torn or not).

Only JSON-safe dicts cross the boundary.
"""

from __future__ import annotations

from typing import Any

from weightsync.errors import PermanentError

QUALNAME = "weightsync_inference.worker.WorkerExtension"


class WorkerExtension:
    weight_transfer_engine: Any

    def _weightsync_engine(self) -> Any:
        from weightsync_inference.engine import WeightsyncEngine

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, WeightsyncEngine):
            raise PermanentError(
                "vLLM runs no weightsync engine: start it with --weight-transfer-config "
                '\'{"backend": "weightsync-<channel>"}\''
            )
        return engine

    def weightsync_identity(self) -> dict[str, Any]:
        identity: dict[str, Any] = self._weightsync_engine().identity().to_dict()
        return identity

    def weightsync_receipt(self) -> dict[str, Any]:
        receipt: dict[str, Any] = self._weightsync_engine().receipt.to_dict()
        return receipt
