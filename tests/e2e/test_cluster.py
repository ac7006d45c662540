"""Smoke test of the e2e control plane: GPU node pool, scheduling, KWOK."""

from __future__ import annotations

import ipaddress
import os
import time
from typing import TYPE_CHECKING

import pytest
from kubernetes import client

from tests.e2e import node as e2e_node

if TYPE_CHECKING:
    from tests.e2e.conftest import ClusterInfo, Kube, Timeouts

pytestmark = pytest.mark.e2e

GPU = "nvidia.com/gpu"
GPU_TOLERATION = client.V1Toleration(key=GPU, operator="Exists", effect="NoSchedule")


def gpu_pod(name: str, gpus: int | None, tolerate_gpu: bool = True) -> client.V1Pod:
    limits = {"cpu": "1", "memory": "1Gi"}
    if gpus:
        limits[GPU] = str(gpus)
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels={"app": name}),
        spec=client.V1PodSpec(
            # KWOK fakes the containers: the image is never pulled.
            containers=[
                client.V1Container(
                    name="main",
                    image="registry.k8s.io/pause:3.10",
                    resources=client.V1ResourceRequirements(limits=limits, requests=limits),
                )
            ],
            tolerations=[GPU_TOLERATION] if tolerate_gpu else None,
            termination_grace_period_seconds=0,
        ),
    )


def test_node_pool(kube: Kube) -> None:
    nodes = {n.metadata.name: n for n in kube.core.list_node().items}
    gpu_nodes = [n for n in nodes.values() if n.metadata.labels.get(f"{GPU}.present") == "true"]
    cpu_nodes = [n for n in nodes.values() if n.metadata.labels.get(f"{GPU}.present") != "true"]
    assert len(gpu_nodes) == 2, sorted(nodes)
    assert len(cpu_nodes) >= 1, sorted(nodes)
    for node in nodes.values():
        assert node.metadata.annotations.get("kwok.x-k8s.io/node") == "fake"
        ready = [c for c in node.status.conditions or [] if c.type == "Ready"]
        assert ready and ready[0].status == "True", (
            node.metadata.name,
            node.status.conditions,
        )
    for node in gpu_nodes:
        assert node.status.capacity[GPU] == "8"
        assert node.status.allocatable[GPU] == "8"
        assert node.metadata.labels[f"{GPU}.product"] == "NVIDIA-H100-80GB-HBM3"
        taints = [(t.key, t.value, t.effect) for t in node.spec.taints or []]
        assert (GPU, "present", "NoSchedule") in taints


def test_gpu_pod_runs_on_gpu_node(kube: Kube, namespace: str, timeouts: type[Timeouts]) -> None:
    kube.core.create_namespaced_pod(namespace, gpu_pod("two-gpus", 2))
    pod = kube.wait_pod_phase(namespace, "two-gpus", "Running", timeouts.POD_RUNNING)
    node = kube.core.read_node(pod.spec.node_name)
    assert node.metadata.labels.get(f"{GPU}.present") == "true", pod.spec.node_name
    scheduled = kube.pod_condition(pod, "PodScheduled")
    assert scheduled is not None and scheduled.status == "True"
    kube.wait_pod_condition(namespace, "two-gpus", "Ready", "True", timeouts.POD_RUNNING)


def test_pod_without_toleration_avoids_gpu_nodes(kube: Kube, namespace: str, timeouts: type[Timeouts]) -> None:
    kube.core.create_namespaced_pod(namespace, gpu_pod("cpu-only", None, tolerate_gpu=False))
    pod = kube.wait_pod_phase(namespace, "cpu-only", "Running", timeouts.POD_RUNNING)
    node = kube.core.read_node(pod.spec.node_name)
    assert node.metadata.labels.get(f"{GPU}.present") != "true", pod.spec.node_name


def test_oversized_gpu_pod_stays_pending(kube: Kube, namespace: str, timeouts: type[Timeouts]) -> None:
    kube.core.create_namespaced_pod(namespace, gpu_pod("sixteen-gpus", 16))
    pod = kube.wait_pod_condition(
        namespace,
        "sixteen-gpus",
        "PodScheduled",
        "False",
        timeouts.POD_UNSCHEDULABLE,
        reason="Unschedulable",
    )
    cond = kube.pod_condition(pod, "PodScheduled")
    assert cond is not None and "nvidia.com/gpu" in (cond.message or ""), cond
    time.sleep(timeouts.STAYS_PENDING)
    pod = kube.core.read_namespaced_pod("sixteen-gpus", namespace)
    assert pod.status.phase == "Pending"
    assert not pod.spec.node_name
    events = kube.core.list_namespaced_event(
        namespace,
        field_selector="involvedObject.name=sixteen-gpus,reason=FailedScheduling",
    )
    assert events.items, "scheduler recorded no FailedScheduling event"


def _listening_addresses(pid: int) -> set[str]:
    """host:port of every TCP socket in LISTEN state that process ``pid`` holds."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state != "0A" or inode not in inodes:  # 0A = LISTEN
                    continue
                host_hex, port_hex = local.split(":")
                raw = bytes.fromhex(host_hex)
                if width == 8:
                    host = str(ipaddress.IPv4Address(raw[::-1]))
                else:
                    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                    host = str(ipaddress.IPv6Address(b"".join(words)))
                found.add(f"{host}:{int(port_hex, 16)}")
    return found


def test_components_listen_on_loopback_only(e2e_cluster: ClusterInfo) -> None:
    pid_dir = e2e_cluster.state_dir / "pids"
    pids = {p.stem: int(p.read_text()) for p in pid_dir.glob("*.pid") if p.stem not in e2e_node.COMPONENTS}
    assert set(pids) >= {"kine", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kwok"}
    for name, pid in pids.items():
        addresses = _listening_addresses(pid)
        assert addresses, f"{name} listens nowhere?"
        for addr in addresses:
            assert addr.startswith("127.0.0.1:"), f"{name} listens on {addr}"
