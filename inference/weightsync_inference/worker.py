"""vLLM worker extension: what the agent asks each worker through ``collective_rpc``.

Started with ``--worker-extension-cls weightsync_inference.worker.WorkerExtension``
(the operator and the embedded default add it), vLLM mixes these methods into its
worker class; the agent calls them over the dev-mode ``/collective_rpc`` route (on
localhost only, like the other dev routes) or ``LLM.collective_rpc``, and gets one
answer per worker:

- ``weightsync_identity``: rank, device, GPU UUID, NIXL (what the agent registers);
- ``weightsync_receipt``: the receipt of the worker's last update (digests computed
  where the bytes landed, phase times, torn or not);
- ``weightsync_layout``: what the worker keeps of each tensor of a table and where it
  lands (its engine layout, recorded from vLLM's own loaders; ``recording``);
- ``weightsync_table``: the table of the last version the worker received whole (the trainer's
  table travels in band: the agent records the layout against it);
- ``weightsync_receive_regions``: the sharded path: receive only this worker's regions
  from every trainer rank and land them in its parameters (``sharded``); a failure is answered, not raised
  (``receipts.regions_answers`` says why), and a worker it left torn refuses to step as after a failed switch;
- ``weightsync_release_regions``: let the region groups go once the replica left the sharded path;
- ``weightsync_read_regions``: a sharded volume version read by region: only this worker's fills
  (``volume_reads``);
- ``weightsync_parameter_digests``: the digest of every parameter the worker computes with (``held``), to
  compare two replicas of one layout bit for bit whichever path loaded them;
- ``weightsync_stage`` / ``weightsync_stage_status``: start receiving a version into the
  worker's stage beside generation (``staging``), and how far it got. The stage RPC
  returns once its receive runs on a thread of its own: the engine's step loop, which
  runs these calls between steps, is not held for the transfer;
- ``weightsync_switch``: switch a staged version in with one call (start, update, finish),
  which the step loop runs between two steps: generation stops for the switch only, with
  no pause around it. A switch that fails after bytes reached the parameters leaves the
  worker refusing every later step (vLLM's engine then fails loudly) until a whole version
  loads: a step never runs on a mix of two versions.

Only JSON-safe dicts cross the boundary (and JSON text as arguments: vLLM's dev route passes strings only).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from weightsync.errors import PermanentError

QUALNAME = "weightsync_inference.worker.WorkerExtension"


class WorkerExtension:
    # vLLM's worker, which this class extends (annotations only: vLLM refuses an extension that redefines them)
    weight_transfer_engine: Any
    execute_model: Callable[..., Any]
    start_weight_update: Callable[[], None]
    update_weights: Callable[[dict[str, Any]], None]
    finish_weight_update: Callable[[], None]

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

    def weightsync_layout(self, table: str) -> dict[str, Any]:
        """``table``: the trainer's table as JSON text (``TensorTable.to_dict``). Answers what this worker keeps of
        each tensor (``{"layout": WorkerLayout.to_dict()}``, recorded from vLLM's own loaders), or ``{"error":
        ...}`` when a loader needs data to decide (the replica then takes the gathered path)."""
        from weightsync.tensors import TensorTable
        from weightsync_inference import recording

        engine = self._weightsync_engine()
        try:
            layout = recording.record_live(engine, TensorTable.from_dict(json.loads(table)))
        except NotImplementedError as e:
            return {"error": f"worker {engine.updater.ctx.rank}: {e}"}
        return {"layout": layout.to_dict()}

    def weightsync_table(self) -> dict[str, Any]:
        """``{"table": TensorTable.to_dict()}`` of the last version this worker received whole, ``{}`` before any."""
        receiver = self._weightsync_engine().updater.receiver
        table = receiver.table if receiver is not None else None
        return {"table": table.to_dict()} if table is not None else {}

    def weightsync_parameter_digests(self) -> dict[str, str]:
        """``name -> digest`` of every parameter this worker computes with (``held``: the CPU backend's packed
        linear weights read back through their kernels), to compare replicas bit for bit."""
        from weightsync_inference import held

        return held.parameter_digests(self._weightsync_engine().model)

    def weightsync_receive_regions(self, request: str) -> dict[str, Any]:
        """``request``: JSON of ``sharded.request`` (the region group's rendezvous, the table, the replica's regions,
        its workers' layouts). Receives this worker's regions from every trainer rank into its parameters, inside
        vLLM's layerwise reload; answers bytes and per-region digests (``sharded.receive``)."""
        from weightsync_inference import sharded

        engine = self._weightsync_engine()
        try:
            answer: dict[str, Any] = sharded.from_request(engine, json.loads(request))
        except Exception as e:  # noqa: BLE001 - answered, not raised: ``receipts.regions_answers`` says why
            if engine.updater.torn:
                self._refuse_steps_while_torn(engine)
            return {"worker": engine.updater.ctx.rank, "error": f"{type(e).__name__}: {e}"}
        return answer

    def weightsync_release_regions(self) -> dict[str, Any]:
        """Let this worker's region groups and its IPC mappings or NIXL reader go (its replica left the sharded
        path): an NCCL communicator holds GPU memory, a mapping keeps a trainer rank's shard memory alive, a NIXL
        agent its registrations. Answers how many."""
        regions = self._weightsync_engine().updater.regions
        released = len(regions.groups) + (regions.reads is not None)
        regions.close()
        return {"released": released}

    def weightsync_read_regions(self, request: str) -> dict[str, Any]:
        """``request``: JSON of ``volume_reads.request`` (a sharded volume version, its manifest checksum, the
        workers' layouts, the phase). ``check``: verifies every tile of this worker's fills, changing nothing;
        ``land`` (once every worker's check passed): reads its fills and lands them inside vLLM's layerwise reload,
        answering bytes read and landed and each fill's digest. A failure is answered as ``{"error", "torn"}``
        (not raised: vLLM's executor would keep it queued for the next call)."""
        from weightsync_inference import volume_reads

        engine = self._weightsync_engine()
        answer = volume_reads.answer(engine, json.loads(request))
        if answer.get("torn"):
            self._refuse_steps_while_torn(engine)
        return answer

    def weightsync_stage(self, update_info: str, nbytes: str) -> dict[str, Any]:
        """``update_info``: the ticket as JSON text; answers ``{"ok": false, "error": ...}`` when the stage cannot
        be allocated (the agent then loads the version in place), else the stage's status."""
        from weightsync_inference.staging import StagingUnavailable

        engine = self._weightsync_engine()
        try:
            engine.stage(json.loads(update_info), int(nbytes))
        except StagingUnavailable as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True, "error": ""}

    def weightsync_switch(self, update_info: str) -> dict[str, Any]:
        """``update_info``: the switch's ticket (naming its staged version) as JSON text; answers the receipt."""
        engine = self._weightsync_engine()
        try:
            self.start_weight_update()
            self.update_weights(json.loads(update_info))
            self.finish_weight_update()
        except BaseException:
            if engine.updater.torn:
                self._refuse_steps_while_torn(engine)
            raise
        if engine.updater.torn:  # a failed update is in the receipt, not raised (``WeightsyncEngine.receive_weights``)
            self._refuse_steps_while_torn(engine)
        receipt: dict[str, Any] = engine.receipt.to_dict()
        return receipt

    def _refuse_steps_while_torn(self, engine: Any) -> None:
        """Until an update leaves the weights whole, every step raises (the instance's ``execute_model`` shadows the
        class's; vLLM's engine treats the error as fatal, so no request gets tokens from a mix); the first step
        after a whole version loaded drops the shadow."""
        step = type(self).execute_model

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            if engine.updater.torn:
                raise PermanentError(
                    f"weightsync: this worker's weights are torn ({engine.receipt.error}); it refuses to step until "
                    "a whole version loads"
                )
            del self.execute_model
            return step(self, *args, **kwargs)

        self.execute_model = execute_model

    def weightsync_stage_status(self) -> dict[str, Any]:
        status: dict[str, Any] = self._weightsync_engine().updater.stager.status.to_dict()
        return status
