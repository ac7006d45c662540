"""A version store that mirrors each version into a ``WeightVersion`` resource, for the coordinator on Kubernetes.

The coordinator is the only writer of WeightVersion objects (DESIGN.md): it
creates ``<job>-v<N>`` (label ``weightsync.io/job``, an ownerReference to the
RLJob when one of that name exists) when the version opens, and writes its
status through the status subresource when the version settles, is superseded or
becomes durable. The operator reads them, reflects the current one into the
RLJob's status and prunes those beyond the job's retention.

Writes stay off the coordinator's lock: ``save`` records the version in the
wrapped store (memory, or the volume journal) and queues it; one writer thread
coalesces what is queued per version and writes it, so the API server sees a
create and a few status patches per version, never one write per ack, and a slow
or unreachable API server never stalls leases or acks. The writer reads each
version's replicas from the coordinator it is attached to (``attach``), since the
store itself is handed versions without them; a status equal to the last one
written is not written again. Writes are idempotent: a create that meets an
existing object (409, e.g. after a coordinator restart) goes on to the status
patch; a status patch that meets no object (404) means the operator pruned it,
and the store does not bring it back.

``load(job)`` lists the job's WeightVersion objects, so a coordinator restarted
in a new pod (nothing on local disk) recovers which versions are READY and
durable; a version left Staging comes back FAILED (its plans died with the old
process) and that verdict is written back. Versions only the wrapped store knows
(e.g. recovered from volume manifests) are kept too; where both know a version,
Kubernetes decides its state and the wrapped store supplies the manifest path.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from weightsync.coordinator.models import TableSummary, VersionInfo
from weightsync.coordinator.store import MemoryStore, VersionStore, VolumeStore
from weightsync.errors import PermanentError
from weightsync.resources import GROUP, JOB_LABEL, VERSION, WeightVersion, WeightVersionSpec, WeightVersionStatus
from weightsync.resources.weightversion import (
    MAX_LISTED_REPLICAS,
    MAX_REPLICA_ENTRIES,
    ChannelShare,
    PhaseSeconds,
    ReplicaEntry,
    replica_states,
    version_name,
)
from weightsync.vocabulary import ReplicaState, VersionState

log = logging.getLogger(__name__)

PLURAL = "weightversions"
RLJOBS = "rljobs"
TENSOR_COUNT = f"{GROUP}/tensor-count"
INCARNATION = f"{GROUP}/incarnation"
OPENED_AT = f"{GROUP}/opened-at"
REPLICA_FIELDS = ("replicasLoaded", "replicasFailed", "failedReplicas", "laggingReplicas", "replicas", "replicaStates")
"""Status fields written only with the replicas' details (a merge patch without them keeps the last ones)."""
REQUEST_TIMEOUT_S = 10.0
MAX_BACKOFF_S = 10.0
RESTARTED = "the coordinator restarted while this version was staging"

Key = tuple[str, int]


class _Versions(Protocol):
    def list_versions(self, job_name: str, limit: int = 0) -> list[VersionInfo]: ...


def api_client() -> Any:
    """In-cluster credentials in a pod (the coordinator's ServiceAccount), else $KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as e:
            raise PermanentError(
                f"--kubernetes-namespace needs API server credentials: none in-cluster and no usable kubeconfig ({e}); "
                "run in a pod with a ServiceAccount or set KUBECONFIG"
            ) from None
    return client.ApiClient()


def _status_code(error: Exception) -> int | None:
    status = getattr(error, "status", None)
    return status if isinstance(status, int) else None


class KubeStore:
    """Mirrors versions into WeightVersion objects in ``namespace``; wraps ``inner`` for everything else."""

    def __init__(
        self,
        namespace: str,
        inner: VersionStore | None = None,
        *,
        job: str = "",
        api: Any | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        """``job``: the one job this coordinator serves (an RLJob's coordinator), whose versions alone it
        recovers; other jobs' versions in the namespace are not its to read back or write."""
        from kubernetes import client

        self.namespace, self.job = namespace, job
        self.inner: VersionStore = inner if inner is not None else MemoryStore()
        self.api = client.CustomObjectsApi(api if api is not None else api_client())
        self.timeout = request_timeout_s
        self._details: Callable[[str, int], VersionInfo | None] | None = None
        self._cond = threading.Condition()
        self._pending: dict[Key, VersionInfo] = {}
        self._busy = False
        self._closed = False
        self._created: set[Key] = set()
        self._written: dict[Key, dict[str, Any]] = {}
        self._owners: dict[str, dict[str, Any]] = {}
        self.writes = 0
        """API writes made (creates and status patches): a few per version, never one per ack."""
        self._thread = threading.Thread(target=self._run, name="weightsync-kubestore", daemon=True)
        self._thread.start()

    def attach(self, versions: _Versions) -> None:
        """Read each version's replicas (counts, failed and lagging names, channel plan) from ``versions``."""

        def details(job: str, version: int) -> VersionInfo | None:
            return next((i for i in versions.list_versions(job) if i.version == version), None)

        self._details = details

    # ---- VersionStore -----------------------------------------------------------------------------------------

    def jobs(self) -> list[str]:
        found = set(self.inner.jobs())
        try:
            items = self._list(f"{JOB_LABEL}={self.job}" if self.job else JOB_LABEL)
        except Exception as e:  # noqa: BLE001 - recovery degrades to the wrapped store, loudly
            log.warning(
                "cannot list WeightVersions in %s (%s); recovering from the local store only", self.namespace, e
            )
            return sorted(found)
        found.update(str(i["metadata"]["labels"][JOB_LABEL]) for i in items)
        return sorted(found)

    def load(self, job: str) -> list[VersionInfo]:
        local = {i.version: i for i in self.inner.load(job)}
        try:
            items = self._list(f"{JOB_LABEL}={job}")
        except Exception as e:  # noqa: BLE001 - recovery degrades to the wrapped store, loudly
            log.warning(
                "cannot list WeightVersions of %s in %s (%s); recovering from the local store only",
                job,
                self.namespace,
                e,
            )
            return [local[v] for v in sorted(local)]
        found = dict(local)
        for item in items:
            info = _from_object(job, item)
            if info is None:
                continue
            key = (job, info.version)
            self._created.add(key)
            known = local.get(info.version)
            if known is not None and known.manifest_path:
                info = dataclasses.replace(info, manifest_path=known.manifest_path)
            if info.state is VersionState.STAGING:
                info = dataclasses.replace(info, state=VersionState.FAILED, reason=RESTARTED, settled_at=0.0)
                self._queue(info)
            found[info.version] = info
        if items:
            log.info("job %s: recovered %d WeightVersions from namespace %s", job, len(items), self.namespace)
        return [found[v] for v in sorted(found)]

    def save(self, info: VersionInfo) -> None:
        self.inner.save(info)
        self._queue(info)

    # ---- the writer -------------------------------------------------------------------------------------------

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued version is written (or dropped); False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (up to ``timeout_s``), then stop the writer."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _queue(self, info: VersionInfo) -> None:
        with self._cond:
            self._pending[(info.job, info.version)] = info
            self._cond.notify_all()

    def _run(self) -> None:
        backoff = 0.5
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                key = min(self._pending)  # oldest first: a version is created before its successor supersedes it
                info = self._pending.pop(key)
                self._busy = True
            retry = False
            try:
                self._write(info)
                backoff = 0.5
            except Exception as e:  # noqa: BLE001 - the API server's errors must never reach the coordinator
                code = _status_code(e)
                retry = code is None or code == 429 or code >= 500
                log.warning(
                    "WeightVersion %s/%s: write failed (%s)%s",
                    self.namespace,
                    version_name(*key),
                    e if code is None else f"HTTP {code}: {getattr(e, 'reason', '')}",
                    f"; retrying in {backoff:.1f}s" if retry else "; dropped",
                )
            with self._cond:
                if retry and not self._closed:
                    self._pending.setdefault(key, info)
                self._busy = False
                self._cond.notify_all()
                if retry and not self._closed:
                    self._cond.wait(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)

    def _write(self, info: VersionInfo) -> None:
        key = (info.job, info.version)
        # the coordinator's own record is at least as new as ``info`` and carries the replicas
        full = self._details(info.job, info.version) if self._details else None
        name = version_name(info.job, info.version)
        if key not in self._created:
            self._create(name, full or info)
            self._created.add(key)
        status = _status(full or info, with_replicas=full is not None)
        if self._written.get(key) == status:
            return
        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, name, {"status": status}, _request_timeout=self.timeout
            )
            self.writes += 1
        except Exception as e:
            if _status_code(e) != 404:
                raise
            log.info(
                "WeightVersion %s/%s is gone (pruned by the operator's retention); not writing it again",
                self.namespace,
                name,
            )
        self._written[key] = status

    def _create(self, name: str, info: VersionInfo) -> None:
        table = info.table
        shares = collections.Counter(r.channel for r in info.replicas if r.channel is not None)
        spec = WeightVersionSpec(
            job=info.job,
            version=info.version,
            step=info.step,
            bytes=table.total_bytes if table else 0,
            layout_digest=table.layout_digest if table else "",
            channel_plan=[ChannelShare(channel=c, replicas=n) for c, n in sorted(shares.items())],
        )
        metadata: dict[str, object] = {
            "name": name,
            "namespace": self.namespace,
            "labels": {JOB_LABEL: info.job},
            "annotations": {
                TENSOR_COUNT: str(table.tensor_count if table else 0),
                INCARNATION: info.incarnation,
                OPENED_AT: f"{info.opened_at:.3f}",
            },
        }
        owner = self._owner(info.job)
        if owner:
            metadata["ownerReferences"] = [owner]
        body = WeightVersion(metadata=metadata, spec=spec).to_wire()
        try:
            self.api.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, body, _request_timeout=self.timeout
            )
            self.writes += 1
        except Exception as e:
            if _status_code(e) != 409:
                raise
            existing = self.api.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, _request_timeout=self.timeout
            )
            if existing.get("spec", {}).get("step") != info.step:
                log.warning(
                    "WeightVersion %s/%s already exists with step %s, not %d: another coordinator wrote it",
                    self.namespace,
                    name,
                    existing.get("spec", {}).get("step"),
                    info.step,
                )

    def _owner(self, job: str) -> dict[str, Any] | None:
        """An ownerReference to the RLJob ``job`` (cached), or None when there is none to point at."""
        if job in self._owners:
            return self._owners[job]
        try:
            rljob = self.api.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, RLJOBS, job, _request_timeout=self.timeout
            )
        except Exception as e:
            if _status_code(e) not in (403, 404):
                raise
            log.info("no RLJob %s/%s to own its WeightVersions (%s)", self.namespace, job, _status_code(e))
            return None
        ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RLJob", "name": job, "uid": rljob["metadata"]["uid"]}
        self._owners[job] = ref
        return ref

    def _list(self, selector: str) -> list[dict[str, Any]]:
        out = self.api.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, label_selector=selector, _request_timeout=self.timeout
        )
        items: list[dict[str, Any]] = out.get("items", [])
        return items


def _status(info: VersionInfo, with_replicas: bool) -> dict[str, Any]:
    """The status to merge-patch. Without the replicas the counts and names are left out, so a merge patch
    keeps what an earlier write said; a superseded version keeps its own sync time."""
    settled = info.state in (VersionState.READY, VersionState.FAILED) and info.settled_at and info.opened_at
    seconds = PhaseSeconds(total=max(0.0, info.settled_at - info.opened_at) if settled else None)
    status = WeightVersionStatus(
        phase=info.state.phase,
        durable=info.durable,
        manifest_checksum=info.manifest_checksum,
        content_digest=info.content_digest,
        phase_seconds=seconds,
        message=info.reason[:4096] if info.state is VersionState.FAILED else "",
    )
    if with_replicas:
        failed = sorted(r.replica_id for r in info.replicas if r.state is ReplicaState.FAILED)
        done = (ReplicaState.LOADED, ReplicaState.FAILED)
        lagging = sorted(r.replica_id for r in info.replicas if r.state not in done)
        status.replicas_loaded = sum(r.state is ReplicaState.LOADED for r in info.replicas)
        status.replicas_failed = len(failed)
        status.failed_replicas = failed[:MAX_LISTED_REPLICAS]
        status.lagging_replicas = lagging[:MAX_LISTED_REPLICAS]
        status.replicas = [
            ReplicaEntry(name=r.replica_id, channel=r.channel, state=r.state)
            for r in info.replicas[:MAX_REPLICA_ENTRIES]
        ]
        status.replica_states = replica_states(status.replicas)
    wire = status.to_wire()
    if not with_replicas:
        for field in REPLICA_FIELDS:
            wire.pop(field, None)
    return wire


def _from_object(job: str, item: Mapping[str, Any]) -> VersionInfo | None:
    """The VersionInfo a WeightVersion object records, or None when it does not parse (or is another job's)."""
    meta = item.get("metadata", {})
    try:
        spec = WeightVersionSpec.model_validate(item.get("spec", {}))
        status = WeightVersionStatus.model_validate(item.get("status") or {})
        state = VersionState(status.phase.upper())
    except (ValidationError, ValueError) as e:
        log.warning("skipping WeightVersion %s during recovery: %s", meta.get("name"), e)
        return None
    if spec.job != job:
        return None
    notes = meta.get("annotations") or {}
    try:
        tensors = int(notes.get(TENSOR_COUNT, "0"))
        opened = float(notes.get(OPENED_AT, "0"))
    except ValueError:
        tensors, opened = 0, 0.0
    if not opened and meta.get("creationTimestamp"):
        opened = datetime.fromisoformat(str(meta["creationTimestamp"]).replace("Z", "+00:00")).timestamp()
    total = status.phase_seconds.total
    table = TableSummary(tensors, spec.bytes, spec.layout_digest) if tensors and spec.layout_digest else None
    return VersionInfo(
        job=job,
        version=spec.version,
        step=spec.step,
        incarnation=str(notes.get(INCARNATION, "")),
        state=state,
        durable=status.durable,
        manifest_checksum=status.manifest_checksum,
        content_digest=status.content_digest,
        table=table,
        reason=status.message or "recovered from its WeightVersion",
        opened_at=opened,
        settled_at=opened + total if total is not None else opened,
    )


def around(namespace: str, volumes: Mapping[str, Path], job: str = "") -> KubeStore:
    """The coordinator's store with ``--kubernetes-namespace``: WeightVersions over the volume journal (if any),
    for ``job`` alone when given."""
    return KubeStore(namespace, VolumeStore(volumes) if volumes else MemoryStore(), job=job)
