"""The e2e cluster's real node (``e2e/node.sh``) for the tests that run pods as containers.

``real_node`` brings the node up on the session's cluster (kubelet, containerd, runc, CNI,
kube-proxy and CoreDNS in a network namespace of their own), loads the CPU images ``make images``
built into its containerd, and takes it down afterwards, pods, mounts and namespaces included. Pods
land on it only when they ask for it: it carries the GPU pool's taint and labels plus a taint and
label of its own; a namespace annotated with :data:`NAMESPACE_ANNOTATIONS` sends all its pods there.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import support

REPO = Path(__file__).resolve().parents[2]
NODE_SH = REPO / "e2e" / "node.sh"
SELECTOR = {"weightsync.io/node": "real"}
TOLERATIONS = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "weightsync.io/node", "operator": "Equal", "value": "real", "effect": "NoSchedule"},
]
NAMESPACE_ANNOTATIONS = {
    "scheduler.alpha.kubernetes.io/node-selector": ",".join(f"{k}={v}" for k, v in SELECTOR.items()),
    "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps(TOLERATIONS),
}
"""Every pod of a namespace so annotated runs on the real node, whatever its spec says (the API server's
PodNodeSelector and PodTolerationRestriction admission plugins, which e2e/cluster.sh enables): the operator,
the coordinator and the uninstall hook included, which have no GPU placement of their own."""
COMPONENTS = frozenset({"containerd", "kubelet", "kube-proxy", "coredns", "apiserver-link"})
"""The real node's processes (e2e/node.sh's NODE_COMPONENTS): their pid files sit beside the control plane's in the
cluster's state dir, and they listen on the node's own addresses, in its network namespace, by design."""
UP_TIMEOUT = 900  # the first `up` builds kubelet, kube-proxy and CoreDNS when `make e2e-tools` did not
LOAD_TIMEOUT = 1800  # the trainer and inference images are gigabytes each


@dataclass(frozen=True)
class RealNode:
    name: str
    netns: str
    images: dict[str, str]

    def run(
        self, argv: list[str], timeout: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the node's network namespace (a ClusterIP or a pod IP is reachable from there only)."""
        return subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.netns}", *argv],
            capture_output=True, text=True, timeout=timeout, env=env, check=False,
        )  # fmt: skip


def _node_sh(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(NODE_SH), *args], capture_output=True, text=True, timeout=timeout, check=False)


@contextmanager
def real_node() -> Iterator[RealNode]:
    if os.geteuid() != 0:
        pytest.skip("the real node needs root (a network namespace, mounts, cgroups)")
    images = support.built_images()
    up = _node_sh("up", timeout=UP_TIMEOUT)
    try:
        assert up.returncode == 0, f"e2e/node.sh up failed:\n{up.stderr[-6000:]}"
        load = _node_sh("load", *images.values(), timeout=LOAD_TIMEOUT)
        assert load.returncode == 0, f"e2e/node.sh load failed:\n{load.stderr[-4000:]}"
        settings = dict(line.split("=", 1) for line in _node_sh("env", timeout=30).stdout.split() if "=" in line)
        yield RealNode(settings["NODE_NAME"], settings["NODE_NETNS"], images)
    finally:
        if os.environ.get("WEIGHTSYNC_E2E_KEEP") != "1":
            down = _node_sh("down", timeout=300)
            assert down.returncode == 0, f"e2e/node.sh down failed:\n{down.stderr[-4000:]}"
