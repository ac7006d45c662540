"""The weightsync Kubernetes operator: RLJob -> coordinator, trainer ranks, vLLM replicas and their plumbing.

Layers, bottom up: ``names`` (names, labels, ports), ``podspecs`` / ``workloads`` /
``networking`` / ``support`` (pure builders of child manifests), ``children``
(the stamped desired set), ``versions`` and ``status`` (pure: observations ->
status), ``kubeapi`` (the only module that calls the API server),
``reconciling`` (one reconcile), ``handlers`` (kopf wiring), ``leader``
(the Lease only one operator reconciles under), ``running`` (process start).
Never imports torch or vLLM: the operator image has neither.
"""

from weightsync_operator.handlers import Options, build_registry
from weightsync_operator.reconciling import Settings, reconcile

__all__ = ["Options", "Settings", "build_registry", "reconcile"]
