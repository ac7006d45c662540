"""Durable versions: marking a version's volume copy, sending volume plans, retention on the volume.

``MarkDurable`` arrives once the publisher's copy of a version landed on the
job's checkpoint volume. It runs in three steps so that no file is read under
the core's lock (the facade sequences them):

1. ``check`` (locked): the version exists, so a bad request fails before any I/O;
2. ``verify`` (unlocked): a coordinator that mounts the job's volume reads the
   manifest from its own mount, never from the client's path, and checks the
   publisher's checksum against it, and its content digest against the per-tensor
   digests the manifest lists; without a mount the publisher's word stands;
3. ``record`` (locked): the version is durable; a version no channel but the
   volume carried takes the content digest of what the trainer wrote there, so its
   replicas are checked against the trainer's digest too, not only against each
   other (a version that was streamed keeps the digest the trainer reported sent);
   every replica planned on the volume for it is sent its ASSIGN now (with the
   checksum to verify against), the ``wait_version`` callers are woken, and the
   volume's retention is applied.

Retention (``_retire``) runs only for jobs whose volume this process mounts. It
keeps the newest ``policy.retention`` durable READY or SUPERSEDED versions (so
always the newest durable READY one, which late joiners catch up from) and
anything still STAGING; FAILED versions do not count toward what is kept. The
retired versions are forgotten as durable (and saved so) under the lock; their
files are deleted afterwards, off the lock, by the facade.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from weightsync.channels import manifests
from weightsync.coordinator import faults, streams
from weightsync.coordinator.jobs import Job
from weightsync.coordinator.models import VersionInfo
from weightsync.coordinator.state import CoreState
from weightsync.errors import WeightsyncError
from weightsync.tensors import content_digest, is_digest, manifest_checksum
from weightsync.vocabulary import VersionState


@dataclass(frozen=True)
class Durable:
    """What a version's volume copy is: where its manifest lies, that manifest's checksum, and the content digest
    of the per-tensor digests it lists (empty: written with verification off)."""

    manifest_path: str
    checksum: str
    content_digest: str = ""


def check(state: CoreState, job_name: str, version: int, checksum: str, digest: str = "") -> None:
    if not is_digest(checksum):
        raise faults.InvalidArgument(
            f"manifest_checksum {checksum[:80]!r} is not sha256:<64 hex>; send tensors.manifest_checksum(bytes)"
        )
    if digest and not is_digest(digest):
        raise faults.InvalidArgument(
            f"content_digest {digest[:80]!r} is not sha256:<64 hex>; send tensors.content_digest(per-tensor digests)"
        )
    state.record(state.job(job_name), version)  # NotFound before any file is read


def verify(root: Path, job_name: str, version: int, checksum: str, digest: str = "") -> tuple[str, str]:
    """The manifest's path on this process's mount of the volume, once its checksum matched ``checksum``, and the
    content digest of the digests it lists (refused when the publisher claimed another)."""
    path = manifests.manifest_path(root, version)
    try:
        actual = manifest_checksum(path.read_bytes())
    except OSError as e:
        raise faults.FailedPrecondition(
            f"version {version} of job {job_name!r} has no manifest on the coordinator's volume ({e}); "
            "mark it durable once its copy landed"
        ) from None
    if actual != checksum:
        raise faults.InvalidArgument(
            f"manifest_checksum {checksum} does not match version {version}'s manifest on the volume "
            f"({actual}); hash the manifest after its final write"
        )
    try:
        listed = manifests.read(path.parent, version, checksum).table.digests()
    except (WeightsyncError, OSError) as e:
        raise faults.InvalidArgument(f"version {version}'s manifest on the volume cannot be read: {e}") from None
    written = content_digest(listed) if listed else ""
    if digest and written != digest:
        raise faults.InvalidArgument(
            f"content_digest {digest} is not the {written or 'none'} of the per-tensor digests version {version}'s "
            "manifest lists: the volume copy is not what the publisher wrote"
        )
    return str(path), written


def record(
    state: CoreState, job_name: str, version: int, durable: Durable, on_volume: Sequence[int] = ()
) -> tuple[VersionInfo, list[int]]:
    """Mark the version durable; returns its info and the versions retired from the volume (to delete).

    ``on_volume``: the complete versions the volume holds, read just before; those older than every version kept
    go too, durable or not (a copy written while the coordinator was unreachable was never marked durable, and
    nothing would ever delete it otherwise)."""
    job = state.job(job_name)
    rec = state.record(job, version)
    checksum = durable.checksum
    rec.durable, rec.manifest_path, rec.manifest_checksum = True, durable.manifest_path, checksum
    # a version only the volume carried is held to what the trainer wrote; one streamed keeps what the trainer
    # reported sent, and a replica that loads other bytes from the volume fails its ack against that
    rec.content_digest = rec.content_digest or durable.content_digest
    for rid in rec.volume_waiting():
        member = job.members.get(rid)
        if member is not None:
            plan = rec.plans[rid] = dataclasses.replace(rec.plans[rid], manifest_checksum=checksum)
            streams.assign(member, job, rec, plan)
    state.store.save(rec.info(with_replicas=False))
    doomed = _retire(state, job, on_volume)
    state.wake()
    return rec.info(), doomed


def _retire(state: CoreState, job: Job, on_volume: Sequence[int]) -> list[int]:
    """Durable versions beyond the job's retention, forgotten as durable, and copies on the volume older than every
    kept version whatever the record says; the caller deletes them off the lock."""
    if job.name not in state.volumes:
        return []
    good = [
        v
        for v in sorted(job.versions, reverse=True)
        if job.versions[v].durable and job.versions[v].state in (VersionState.READY, VersionState.SUPERSEDED)
    ]
    keep = set(good[: job.policy.retention])  # the newest durable READY version is good[0]
    keep |= {m.catching_up for m in job.members.values() if m.catching_up}  # replicas loading it now
    doomed = []
    for v, rec in job.versions.items():
        if rec.durable and v not in keep and rec.state is not VersionState.STAGING:
            rec.durable, rec.manifest_path, rec.manifest_checksum = False, "", ""
            state.store.save(rec.info(with_replicas=False))
            doomed.append(v)
    staging = {v for v, rec in job.versions.items() if rec.state is VersionState.STAGING}
    if keep:
        doomed += [v for v in on_volume if v < min(keep) and v not in doomed and v not in staging]
    return sorted(doomed)
