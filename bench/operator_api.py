"""What the operator costs the API server, and how fast it answers a spec change, on the real control plane.

    python bench/operator_api.py --jobs 1 10 50 --window 60 --json operator.json

On the e2e control plane (``e2e/cluster.sh``: kube-apiserver, kine, scheduler,
controller-manager, KWOK GPU nodes; brought up if it is not), the chart is helm-installed and
the operator runs under the chart's ServiceAccount as in the e2e tests (``tests/e2e/chart.py``).
For each job count, that many copies of ``examples/rljob.yaml`` (without GPUs and with small requests, so
50 jobs fit the fake nodes) run in one namespace; once every
job is Running and quiet, ``apiserver_request_total`` (summed over every verb and resource) is
read before and after a window with the operator running, then with it stopped: the difference
per second, divided by the jobs, is what an idle RLJob costs. The remaining load (the
controller-manager, the scheduler, KWOK's node heartbeats, this script's own reads) is in both
windows and cancels out.

At the largest count it then patches ``spec.suspend`` on every job at once (from a thread pool)
and times, per job, the patch until the job's status says Suspended with no trainer pods left
(p50, p99), and the same for resuming; it reads the operator's resident memory and CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.chart import Operator, example, installed  # noqa: E402
from tests.e2e.conftest import Kube, _bring_up  # noqa: E402


def requests_total(kube: Kube) -> float:
    text = kube.kubectl("get", "--raw", "/metrics").stdout
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("apiserver_request_total{")
    )


def rate(kube: Kube, window: float) -> float:
    before = requests_total(kube)
    time.sleep(window)
    return (requests_total(kube) - before) / window


def wait_all(kube: Kube, namespace: str, names: list[str], phase: str, timeout: float) -> dict[str, float]:
    """When each job first showed ``phase`` (monotonic seconds), from a watch: polling lists of 50 jobs ten times
    a second loaded the API server this measures (2 cores) as much as a share of the operator's own writes."""
    from kubernetes import watch

    group = ("weightsync.io", "v1alpha1", namespace, "rljobs")
    listed = kube.custom.list_namespaced_custom_object(*group)
    seen = {
        j["metadata"]["name"]: time.monotonic() for j in listed["items"] if j.get("status", {}).get("phase") == phase
    }
    deadline = time.monotonic() + timeout
    version = listed["metadata"]["resourceVersion"]
    while len(seen.keys() & set(names)) < len(names):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(set(names) - seen.keys())} jobs not {phase} after {timeout:.0f}s")
        stream = watch.Watch().stream(
            kube.custom.list_namespaced_custom_object, *group, resource_version=version, timeout_seconds=int(left) + 1
        )
        for event in stream:
            job = event["object"]
            version = job["metadata"]["resourceVersion"]
            if job.get("status", {}).get("phase") == phase:
                seen.setdefault(job["metadata"]["name"], time.monotonic())
            if len(seen.keys() & set(names)) == len(names):
                break
    return seen


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def spec_change(kube: Kube, namespace: str, names: list[str], suspend: bool) -> dict[str, float]:
    body = {"spec": {"suspend": suspend}}
    started: dict[str, float] = {}

    def patch(name: str) -> None:
        started[name] = time.monotonic()
        kube.custom.patch_namespaced_custom_object("weightsync.io", "v1alpha1", namespace, "rljobs", name, body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(patch, names))
    done = wait_all(kube, namespace, names, "Suspended" if suspend else "Running", 300)
    took = [done[n] - started[n] for n in names]
    return {"p50_s": statistics.median(took), "p99_s": pct(took, 0.99), "max_s": max(took)}


def proc_stats(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, clock ticks (100 Hz)
    return {"rss_mib": rss_kib / 1024, "cpu_seconds": cpu}


def small(name: str) -> dict[str, Any]:
    """examples/rljob.yaml without GPUs and with small requests, so 50 jobs fit the fake nodes (16 GPUs)."""
    body = example(name)
    tiny = {"cpu": "100m", "memory": "256Mi"}
    body["spec"]["trainer"].update(gpusPerWorker=0, resources=tiny)
    body["spec"]["inference"].update(gpusPerReplica=0, resources=tiny)
    return body


def run_count(kube: Kube, operator: Operator, jobs: int, window: float, settle: float, changes: bool) -> dict[str, Any]:
    namespace = f"bench-{jobs}-{uuid.uuid4().hex[:5]}"
    kube.kubectl("create", "namespace", namespace)
    kube.wait_for(lambda: kube.core.read_namespaced_service_account("default", namespace), 60, "default SA")
    names = [f"job-{i}" for i in range(jobs)]
    try:
        for name in names:
            kube.prebind_checkpoint_volume(namespace, name)
            kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(small(name)))
        t0 = time.monotonic()
        wait_all(kube, namespace, names, "Running", 120 + 6 * jobs)
        row: dict[str, Any] = {"jobs": jobs, "all_running_s": time.monotonic() - t0}
        time.sleep(settle)  # the last status patches and events
        assert operator.proc is not None
        row["running_req_per_s"] = rate(kube, window)
        row["operator"] = proc_stats(operator.proc.pid)
        operator.stop()
        time.sleep(2)
        row["stopped_req_per_s"] = rate(kube, window)
        operator.start()
        row["per_idle_job_req_per_s"] = (row["running_req_per_s"] - row["stopped_req_per_s"]) / jobs
        wait_all(kube, namespace, names, "Running", 120)
        if changes:
            time.sleep(settle)
            row["suspend"] = spec_change(kube, namespace, names, True)
            row["resume"] = spec_change(kube, namespace, names, False)
            assert operator.proc is not None
            row["operator_after_changes"] = proc_stats(operator.proc.pid)
        return row
    finally:
        kube.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=true", "--timeout=300s", check=False)
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        for name in names:
            kube.kubectl("delete", "pv", f"{namespace}-{name}", "--wait=false", check=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, nargs="+", default=[1, 10, 50])
    p.add_argument("--window", type=float, default=60.0, help="seconds of each request-rate window")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to wait after the jobs are Running")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    kube = Kube(_bring_up())
    rows = []
    with tempfile.TemporaryDirectory() as tmp, installed(kube, Path(tmp)) as operator:
        time.sleep(3)
        for jobs in args.jobs:
            row = run_count(kube, operator, jobs, args.window, args.settle, jobs == max(args.jobs))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
