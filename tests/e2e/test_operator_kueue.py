"""Gang admission by Kueue: ten RLJobs on 16 GPUs in a Kueue queue, on the real control plane with real Kueue.

``make e2e-kueue`` (not in ``make test``: Kueue v0.17.0 is built from its Go module once, 20-25 minutes cold on a
busy 2-core machine, cached by version under ``~/.cache/weightsync``). ``e2e/cluster.sh kueue-up`` runs Kueue's
manager beside the control plane (e2e/README.md says how it differs from an install); the chart is installed with
``kueue.enabled`` and the operator runs with ``--kueue``. A ResourceFlavor, a ClusterQueue of 16 GPUs (what the
two GPU nodes hold) and a LocalQueue ``gpu`` in the test's namespace; the ten jobs carry
``kueue.x-k8s.io/queue-name: gpu``. The scenario is ``test_operator_gang``'s: Kueue admits four jobs whole at a time,
the operator keeps the others suspended with no pod (``Admitted`` False, quoting Kueue), and each finished job's
Workload is marked Finished, which lets Kueue admit the next.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.chart import installed
from tests.e2e.conftest import Kube, _cluster_sh
from tests.e2e.test_operator_gang import GPUS, run_ten_jobs

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("WEIGHTSYNC_E2E_KUEUE") != "1",
        reason="needs Kueue (built once, 20-25 min cold): make e2e-kueue",
    ),
]
QUEUE = "gpu"


def _queues(namespace: str) -> list[dict[str, object]]:
    flavor = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "e2e-gpu"}}
    quota = {"cpu": "192", "memory": "3Ti", "nvidia.com/gpu": str(GPUS)}
    cluster_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ClusterQueue",
        "metadata": {"name": f"e2e-{namespace}"},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "resourceGroups": [
                {
                    "coveredResources": list(quota),
                    "flavors": [
                        {"name": "e2e-gpu", "resources": [{"name": r, "nominalQuota": q} for r, q in quota.items()]}
                    ],
                }
            ],
        },
    }
    local_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "LocalQueue",
        "metadata": {"name": QUEUE, "namespace": namespace},
        "spec": {"clusterQueue": f"e2e-{namespace}"},
    }
    return [flavor, cluster_queue, local_queue]


def test_ten_jobs_in_a_kueue_queue_run_whole_or_wait_whole_and_in_turn(
    kube: Kube, namespace: str, tmp_path: Path
) -> None:
    up = _cluster_sh("kueue-up", timeout=3600, check=False)
    assert up.returncode == 0, up.stderr
    queues = _queues(namespace)
    kube.kubectl(
        "apply", "--server-side", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": queues})
    )
    try:
        with installed(kube, tmp_path, "--set", "kueue.enabled=true", operator_args=("--kueue",)):
            run_ten_jobs(kube, namespace, {"kueue.x-k8s.io/queue-name": QUEUE}, "Suspended", "Kueue", in_order=False)
    finally:
        kube.kubectl("delete", "clusterqueue", f"e2e-{namespace}", "--wait=false", check=False)
