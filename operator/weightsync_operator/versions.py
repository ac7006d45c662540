"""WeightVersion objects as the operator sees them: the job's current version and what to prune.

The coordinator writes these objects; the operator only reads them and deletes
the old ones. ``current`` is the newest Ready version (what the fleet serves);
the newest version of any phase drives the Synced condition. Retention keeps
the newest ``spec.sync.retention`` versions, and never deletes the current one
or one still Staging (its sync is in flight), whatever its age.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from weightsync.resources import JOB_LABEL
from weightsync.resources.weightversion import WeightVersionSpec, WeightVersionStatus, version_name
from weightsync.vocabulary import VersionState

READY, FAILED, STAGING = VersionState.READY.phase, VersionState.FAILED.phase, VersionState.STAGING.phase


@dataclass(frozen=True)
class Seen:
    name: str
    spec: WeightVersionSpec
    status: WeightVersionStatus


@dataclass(frozen=True)
class VersionSummary:
    current: int | None = None
    current_step: int | None = None
    replicas_loaded: int = 0
    replicas_failed: int = 0
    last_sync_seconds: float | None = None
    last_failed: int | None = None
    last_failed_message: str = ""
    newest: int | None = None
    newest_phase: str = ""


def parse(job: str, items: list[dict[str, Any]], uid: str = "") -> list[Seen]:
    """The job's versions, newest first. Skipped: objects that do not parse, and any that does not belong to
    this job in every way it can say so (``spec.job``, the job label, the name ``<job>-v<version>``, and an
    RLJob owner, when it has one, of this job's ``uid``): another job's coordinator cannot pass a version off
    as this job's, nor can one left by an earlier job of the same name."""
    out = []
    for item in items:
        try:
            spec = WeightVersionSpec.model_validate(item.get("spec", {}))
            status = WeightVersionStatus.model_validate(item.get("status") or {})
        except ValidationError:
            continue
        meta = item.get("metadata", {})
        owners = [r for r in meta.get("ownerReferences") or [] if r.get("kind") == "RLJob"]
        if (
            spec.job == job
            and (meta.get("labels") or {}).get(JOB_LABEL) == job
            and meta.get("name") == version_name(job, spec.version)
            and all(r.get("name") == job and (not uid or r.get("uid") == uid) for r in owners)
        ):
            out.append(Seen(meta["name"], spec, status))
    return sorted(out, key=lambda s: s.spec.version, reverse=True)


def summarize(versions: list[Seen]) -> VersionSummary:
    """``versions`` newest first (as ``parse`` returns them)."""
    if not versions:
        return VersionSummary()
    ready = next((v for v in versions if v.status.phase == READY), None)
    failed = next((v for v in versions if v.status.phase == FAILED), None)
    return VersionSummary(
        current=ready.spec.version if ready else None,
        current_step=ready.spec.step if ready else None,
        replicas_loaded=ready.status.replicas_loaded if ready else 0,
        replicas_failed=ready.status.replicas_failed if ready else 0,
        last_sync_seconds=ready.status.phase_seconds.total if ready else None,
        last_failed=failed.spec.version if failed else None,
        last_failed_message=failed.status.message if failed else "",
        newest=versions[0].spec.version,
        newest_phase=versions[0].status.phase,
    )


def beyond_retention(versions: list[Seen], retention: int) -> list[str]:
    """Names to delete: older than the newest ``retention``, except the current one and Staging ones."""
    current = summarize(versions).current
    return [v.name for v in versions[retention:] if v.spec.version != current and v.status.phase != STAGING]


def events(old_current: int | None, old_failed: int | None, now: VersionSummary) -> list[tuple[str, str, str]]:
    """(type, reason, message) for what changed since the last status: a new current or failed version."""
    out = []
    if now.current is not None and now.current != old_current:
        seconds = f" in {now.last_sync_seconds:.3f} s" if now.last_sync_seconds is not None else ""
        out.append(
            (
                "Normal",
                "VersionReady",
                f"version {now.current} (step {now.current_step}) is Ready on {now.replicas_loaded} replicas{seconds}",
            )
        )
    if now.last_failed is not None and now.last_failed != old_failed:
        out.append(("Warning", "VersionFailed", f"version {now.last_failed} failed: {now.last_failed_message}"))
    return out
