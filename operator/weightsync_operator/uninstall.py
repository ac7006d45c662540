"""Helm's pre-delete hook: refuse to uninstall the chart while RLJobs exist.

A live RLJob carries the operator's finalizer, and its coordinator's RoleBinding names the
chart's ClusterRole. With the operator gone, nothing would remove the finalizer: deleting the
job, or its namespace, would hang. So the chart's hook runs this before helm deletes anything;
it names the jobs and fails, and the release stays whole until they are deleted (which the
operator, still running, finishes at once).
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync_operator.kubeapi import Api

SHOWN = 10


def live_jobs(api: Api, namespaces: Sequence[str]) -> list[str]:
    """``namespace/name`` of every RLJob in ``namespaces`` (every namespace when empty)."""
    found = []
    for namespace in namespaces or [""]:
        for job in api.list("RLJob", namespace, ""):
            found.append(f"{job['metadata']['namespace']}/{job['metadata']['name']}")
    return sorted(found)


def refusal(jobs: Sequence[str]) -> str:
    """Why the uninstall may not go on, or empty when it may."""
    if not jobs:
        return ""
    shown = ", ".join(jobs[:SHOWN]) + (f" and {len(jobs) - SHOWN} more" if len(jobs) > SHOWN else "")
    return (
        f"{len(jobs)} RLJob(s) still exist: {shown}. Uninstalling the operator now would leave them undeletable "
        "(their finalizer needs it). Delete them first (kubectl delete rljobs --all -A) and run helm uninstall "
        "again."
    )
