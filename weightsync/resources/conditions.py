"""metav1.Condition, the shape every Kubernetes status uses, and the one function that sets one.

A condition's ``lastTransitionTime`` moves only when its ``status`` flips, so a
reconcile that observes the same world writes the same conditions: that is what
lets the operator patch status only when something really changed.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Sequence

from pydantic import Field

from weightsync.resources._base import Model


class ConditionStatus(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Model):
    """The metav1.Condition shape (type, status, reason, message, times, observedGeneration)."""

    type: str = Field(
        description="CamelCase condition type, e.g. Running.",
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="CamelCase reason for the last transition.",
        max_length=1024,
        min_length=1,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
    )
    message: str = Field(default="", description="Human-readable details.", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int | None = Field(default=None, ge=0, description="metadata.generation it was set for.")


def now() -> str:
    """The current time in the RFC 3339 form Kubernetes uses (seconds, UTC, Z)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: Sequence[Condition],
    type: str,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    generation: int | None = None,
) -> list[Condition]:
    """Return ``conditions`` with ``type`` set; the transition time moves only when ``status`` changes."""
    out: list[Condition] = []
    found = False
    for cond in conditions:
        if cond.type != type:
            out.append(cond)
            continue
        found = True
        when = cond.last_transition_time if cond.status == status else now()
        out.append(
            Condition(
                type=type,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=when,
                observed_generation=generation,
            )
        )
    if not found:
        out.append(
            Condition(
                type=type,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=now(),
                observed_generation=generation,
            )
        )
    return out


def find(conditions: Sequence[Condition], type: str) -> Condition | None:
    """The condition of ``type``, or None."""
    return next((c for c in conditions if c.type == type), None)


def is_true(conditions: Sequence[Condition], type: str) -> bool:
    cond = find(conditions, type)
    return cond is not None and cond.status == ConditionStatus.TRUE
