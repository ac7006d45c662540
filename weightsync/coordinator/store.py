"""Version stores: where the coordinator keeps what must survive its own restart.

The coordinator holds live state (leases, plans, watchers) in memory; what a
restart must not lose is each version's outcome (READY, FAILED, durable, its
manifest). ``VersionStore`` is the seam: ``MemoryStore`` for tests and embedded
runs, ``VolumeStore`` for a coordinator that mounts the checkpoint volume, and on
Kubernetes (a later issue) a store that mirrors versions into ``WeightVersion``
resources. Writes happen a few times per version (open, settled, durable), never
per ack.

``VolumeStore`` keeps a small journal beside the versions
(``<root>/.weightsync-coordinator/<job>.json``, written to a temporary name and
renamed) and, on load, also trusts the volume itself: a version whose manifest
landed but that the journal does not know (the journal was lost, or the version
was written by another coordinator) comes back READY and durable, since its bytes
are whole and verifiable. A version the journal left STAGING comes back FAILED:
its plans and watchers died with the old process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from weightsync.channels import manifests
from weightsync.coordinator.models import TableSummary, VersionInfo, summarize
from weightsync.tensors import manifest_checksum
from weightsync.vocabulary import VersionState

log = logging.getLogger(__name__)
JOURNAL_DIR = ".weightsync-coordinator"


class VersionStore(Protocol):
    def load(self, job: str) -> list[VersionInfo]:
        """Every retained version of ``job``, oldest first (empty for a new job)."""

    def save(self, info: VersionInfo) -> None:
        """Record ``info`` (replacing the previous record of the same job and version)."""

    def jobs(self) -> list[str]:
        """Jobs this store knows (recovered at start)."""


def to_json(info: VersionInfo) -> dict[str, Any]:
    d = dataclasses.asdict(info)
    d["state"] = info.state.value
    d.pop("replicas", None)
    return d


def from_json(d: Mapping[str, Any]) -> VersionInfo:
    table = d.get("table")
    return VersionInfo(
        job=str(d["job"]),
        version=int(d["version"]),
        step=int(d["step"]),
        incarnation=str(d.get("incarnation", "")),
        state=VersionState(d["state"]),
        durable=bool(d.get("durable", False)),
        manifest_path=str(d.get("manifest_path", "")),
        manifest_checksum=str(d.get("manifest_checksum", "")),
        table=TableSummary(**table) if table else None,
        reason=str(d.get("reason", "")),
        opened_at=float(d.get("opened_at", 0.0)),
        settled_at=float(d.get("settled_at", 0.0)),
        content_digest=str(d.get("content_digest", "")),
    )


class MemoryStore:
    """Keeps versions for the life of the process."""

    def __init__(self, retain: int = 256) -> None:
        self.retain = retain
        self._by_job: dict[str, dict[int, VersionInfo]] = {}

    def load(self, job: str) -> list[VersionInfo]:
        return [self._by_job.get(job, {})[v] for v in sorted(self._by_job.get(job, {}))]

    def save(self, info: VersionInfo) -> None:
        versions = self._by_job.setdefault(info.job, {})
        versions[info.version] = dataclasses.replace(info, replicas=())
        for old in sorted(versions)[: -self.retain]:
            del versions[old]

    def jobs(self) -> list[str]:
        return sorted(self._by_job)


class VolumeStore(MemoryStore):
    """Journals versions on each job's checkpoint volume and recovers from its manifests."""

    def __init__(self, roots: Mapping[str, Path], retain: int = 256) -> None:
        super().__init__(retain)
        self.roots = {job: Path(root) for job, root in roots.items()}

    def jobs(self) -> list[str]:
        return sorted(self.roots)

    def _journal(self, job: str) -> Path:
        return self.roots[job] / JOURNAL_DIR / f"{job}.json"

    def load(self, job: str) -> list[VersionInfo]:
        if job not in self.roots:
            return super().load(job)
        found: dict[int, VersionInfo] = {}
        journal = self._journal(job)
        if journal.is_file():
            try:
                for entry in json.loads(journal.read_text())["versions"]:
                    info = from_json(entry)
                    found[info.version] = info
            except (ValueError, KeyError, TypeError) as e:
                log.warning("journal %s is unreadable (%s); recovering from the manifests alone", journal, e)
        for info in self._from_manifests(job):
            known = found.get(info.version)
            if known is None:
                found[info.version] = info
            elif not known.durable:
                found[info.version] = dataclasses.replace(
                    known, durable=True, manifest_path=info.manifest_path, manifest_checksum=info.manifest_checksum
                )
        on_volume = {v.version for v in self._from_manifests(job)}
        for v, info in list(found.items()):
            if info.state is VersionState.STAGING:
                found[v] = dataclasses.replace(
                    info, state=VersionState.FAILED, reason="the coordinator restarted while this version was staging"
                )
            if info.durable and v not in on_volume:
                found[v] = dataclasses.replace(found[v], durable=False, manifest_path="", manifest_checksum="")
        self._by_job[job] = found
        return [found[v] for v in sorted(found)]

    def _from_manifests(self, job: str) -> list[VersionInfo]:
        root = self.roots[job]
        out = []
        for v in manifests.list_versions(root):
            path = manifests.manifest_path(root, v)
            try:
                data = path.read_bytes()
                manifest = manifests.Manifest.parse(data, path)
            except Exception as e:  # noqa: BLE001 - one bad manifest must not stop recovery of the rest
                log.warning("skipping %s during recovery: %s", path, e)
                continue
            out.append(
                VersionInfo(
                    job=job,
                    version=v,
                    step=manifest.step,
                    incarnation="",
                    state=VersionState.READY,
                    durable=True,
                    manifest_path=str(path),
                    manifest_checksum=manifest_checksum(data),
                    table=summarize(manifest.table),
                    reason="recovered from the volume manifest",
                    opened_at=manifest.created,
                    settled_at=manifest.created,
                )
            )
        return out

    def save(self, info: VersionInfo) -> None:
        super().save(info)
        if info.job not in self.roots:
            return
        journal = self._journal(info.job)
        try:
            journal.parent.mkdir(parents=True, exist_ok=True)
            tmp = journal.with_suffix(f".tmp-{os.getpid()}")
            entries = [to_json(i) for i in super().load(info.job)]
            tmp.write_text(json.dumps({"versions": entries}, indent=1))
            os.replace(tmp, journal)
        except OSError as e:
            log.warning("cannot write the version journal %s (%s); READY state will not survive a restart", journal, e)
