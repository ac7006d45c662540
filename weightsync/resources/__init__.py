"""Typed models of weightsync's Kubernetes resources (RLJob, WeightVersion) and the CRDs made from them.

The models are the one source of truth: the operator parses RLJob bodies with
them, the coordinator writes WeightVersion objects with them, and ``crds/`` plus
the chart's copy are generated from them (``weightsync crds``). Group
``weightsync.io``, version ``v1alpha1``.
"""

from weightsync.resources._base import API_VERSION, GROUP, VERSION
from weightsync.resources.conditions import Condition, ConditionStatus
from weightsync.resources.rljob import ConditionType, JobPhase, RLJob, RLJobSpec, RLJobStatus
from weightsync.resources.weightversion import (
    JOB_LABEL,
    WeightVersion,
    WeightVersionSpec,
    WeightVersionStatus,
    version_name,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "JOB_LABEL",
    "VERSION",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "JobPhase",
    "RLJob",
    "RLJobSpec",
    "RLJobStatus",
    "WeightVersion",
    "WeightVersionSpec",
    "WeightVersionStatus",
    "version_name",
]
