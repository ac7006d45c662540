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
windows and cancels out. The operator's own requests are also counted directly (its API Priority and
Fairness flow schema), which the background's swings do not blur: a fixed part, the leader's Lease
renewals, plus what each job adds.

After the window with it stopped, the operator is started again; the row's ``restart`` says how long it took to be
quiet (its own requests back to the Lease's renewals for 5 s) and what its start sent; the changes below wait for
that (a fixed sleep used to let a suspend meet a start still reading the API, and time that).

At each count of ``--suspend-at`` (default: the largest) it then patches ``spec.suspend`` on every job at once
(from a thread pool) and times, per job, the patch until the job's status says Suspended, and until its children
say so too (the inference StatefulSet and coordinator Deployment scaled to 0, every trainer pod deleted or being
deleted) (p50, p99); the same for resuming (status Running: every pod back and ready; ``--no-resume`` leaves it out); it
reads the operator's resident memory and CPU time.

``--resync-spread N`` adds a row for the safety net's reads: the operator restarted with ``--resync-seconds
--resync-period``, N idle jobs, and its own requests counted every second for two periods (from a quarter period
after its start): each job's wait is drawn from 0.5 to 1.5 periods, so the reads should spread over the period
rather than come in one burst.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.chart import Operator, example, installed, request_counts  # noqa: E402
from tests.e2e.conftest import Kube, _bring_up  # noqa: E402
from weightsync.resources import JOB_LABEL  # noqa: E402
from weightsync_operator.names import COMPONENT_LABEL, Component  # noqa: E402

OWN = "flow service-accounts"
"""The key of ``request_counts`` that counts the operator's requests: API Priority and Fairness puts those of
ServiceAccounts outside kube-system in the flow schema ``service-accounts``, and here that is the operator alone
(KWOK runs no pod, so no job's ServiceAccount calls)."""


def by_verb(counts: Counter[str]) -> Counter[str]:
    """``counts`` without the flow schemas' counts: every request the API server answered, once."""
    return Counter({k: v for k, v in counts.items() if not k.startswith("flow ")})


def requests_total(kube: Kube) -> tuple[float, float]:
    """Every request the API server answered, and the operator's own."""
    counts = request_counts(kube)
    return sum(by_verb(counts).values()), counts[OWN]


def rate(kube: Kube, window: float) -> tuple[float, float]:
    """Requests per second over ``window``: every one, the operator's own."""
    before = requests_total(kube)
    time.sleep(window)
    after = requests_total(kube)
    return (after[0] - before[0]) / window, (after[1] - before[1]) / window


Obj = dict[str, Any]


def first_held(
    kube: Kube,
    list_fn: Callable[..., Any],
    args: tuple[Any, ...],
    held: Callable[[dict[str, Obj]], set[str]],
    names: list[str],
    timeout: float,
    listed: threading.Event | None = None,
    label_selector: str = JOB_LABEL,
) -> dict[str, float]:
    """When each of ``names`` first held (monotonic seconds): ``held`` maps the live objects of ``list_fn`` (name ->
    object) to the jobs whose condition holds. One list, then a watch: polling lists of 50 jobs ten times a second
    loaded the API server this measures (2 cores) as much as a share of the operator's own writes. ``listed`` is set
    once the list is read (a change made after it is seen); ``label_selector`` filters on the server (the children
    carry the job label; RLJobs do not)."""
    from kubernetes import watch

    answer = list_fn(*args, label_selector=label_selector, _preload_content=False)
    first = json.loads(answer.data)
    live = {o["metadata"]["name"]: o for o in first["items"]}
    wanted, seen = set(names), dict[str, float]()

    def note() -> None:
        now = time.monotonic()
        for job in held(live) & wanted:
            seen.setdefault(job, now)

    note()
    if listed is not None:
        listed.set()
    deadline = time.monotonic() + timeout
    version = first["metadata"]["resourceVersion"]
    while not wanted <= seen.keys():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(wanted - seen.keys())} jobs not done by {list_fn.__name__} in {timeout:.0f}s")
        stream = watch.Watch().stream(
            list_fn, *args, label_selector=label_selector, resource_version=version, timeout_seconds=int(left) + 1
        )
        for event in stream:
            obj = event["raw_object"]
            version = obj["metadata"]["resourceVersion"]
            if event["type"] == "DELETED":
                live.pop(obj["metadata"]["name"], None)
            else:
                live[obj["metadata"]["name"]] = obj
            note()
            if wanted <= seen.keys():
                break
    return seen


def _component(obj: Obj) -> tuple[str, str]:
    labels = obj["metadata"].get("labels") or {}
    return labels.get(JOB_LABEL, ""), labels.get(COMPONENT_LABEL, "")


def in_phase(phase: str) -> Callable[[dict[str, Obj]], set[str]]:
    return lambda live: {n for n, j in live.items() if j.get("status", {}).get("phase") == phase}


def scaled_to_zero(live: dict[str, Obj]) -> set[str]:
    """Jobs whose workload (a StatefulSet or Deployment: one per job and kind) has no replicas."""
    return {_component(o)[0] for o in live.values() if not o["spec"].get("replicas")}


def trainers_gone(names: list[str]) -> Callable[[dict[str, Obj]], set[str]]:
    """Jobs none of whose trainer pods is still meant to run (each deleted or being deleted)."""
    return lambda live: (
        set(names)
        - {
            _component(p)[0]
            for p in live.values()
            if _component(p)[1] == Component.TRAINER and not p["metadata"].get("deletionTimestamp")
        }
    )


def wait_all(kube: Kube, namespace: str, names: list[str], phase: str, timeout: float) -> dict[str, float]:
    """When each job first showed ``phase`` in its status."""
    group = ("weightsync.io", "v1alpha1", namespace, "rljobs")
    return first_held(kube, kube.custom.list_namespaced_custom_object, group, in_phase(phase), names, timeout, None, "")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def spec_change(kube: Kube, namespace: str, names: list[str], suspend: bool) -> dict[str, Any]:
    """Patch ``spec.suspend`` on every job at once; per job, the time until its status shows the new phase and, for
    a suspend, until its children show it too (inference and coordinator scaled to 0, no trainer pod left running)."""
    phase = "Suspended" if suspend else "Running"
    rljobs = ("weightsync.io", "v1alpha1", namespace, "rljobs")
    watches: dict[str, tuple[Callable[..., Any], tuple[Any, ...], Callable[[dict[str, Obj]], set[str]]]] = {
        "status": (kube.custom.list_namespaced_custom_object, rljobs, in_phase(phase))
    }
    if suspend:
        apps, ns = kube.apps, (namespace,)
        watches["inference"] = (apps.list_namespaced_stateful_set, ns, scaled_to_zero)
        watches["coordinator"] = (apps.list_namespaced_deployment, ns, scaled_to_zero)
        watches["trainer"] = (kube.core.list_namespaced_pod, ns, trainers_gone(names))
    listed = {what: threading.Event() for what in watches}
    with ThreadPoolExecutor(len(watches)) as watching:
        done = {
            what: watching.submit(
                first_held, kube, fn, args, held, names, 300, listed[what], "" if what == "status" else JOB_LABEL
            )
            for what, (fn, args, held) in watches.items()
        }
        for event in listed.values():
            event.wait(60)
        body = {"spec": {"suspend": suspend}}
        started: dict[str, float] = {}

        def patch(name: str) -> None:
            started[name] = time.monotonic()
            kube.custom.patch_namespaced_custom_object(*rljobs, name, body)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(patch, names))
        seen = {what: future.result() for what, future in done.items()}

    def summary(took: list[float]) -> dict[str, float]:
        return {"p50_s": statistics.median(took), "p99_s": pct(took, 0.99), "max_s": max(took)}

    row = summary([seen["status"][n] - started[n] for n in names])
    if suspend:
        row["with_children"] = summary([max(s[n] for s in seen.values()) - started[n] for n in names])
    return row


def own_requests(kube: Kube) -> float:
    """The operator's own requests so far (see ``OWN``)."""
    return request_counts(kube).get(OWN, 0.0)


def settled(kube: Kube, since: float, started: float, timeout: float = 300.0) -> dict[str, float]:
    """Wait until an operator started at ``started`` (monotonic) is quiet: it has made its start's requests (kopf
    lists and watches every kind it indexes: at least 10) and then no more than the Lease's renewals (a PUT every
    2 s) for 5 s. What its start cost: the seconds until quiet and its own requests until then (``since``: its
    count before the start), the Lease's renewals included."""
    last, window = since, list[float]()
    while True:
        time.sleep(1.0)
        now = own_requests(kube)
        window = [*window, now - last][-5:]
        last = now
        elapsed = time.monotonic() - started
        if now - since >= 10 and len(window) == 5 and sum(window) <= 3:
            return {"quiet_after_s": round(elapsed - 5, 1), "requests": round(now - since - sum(window))}
        if elapsed > timeout:
            raise TimeoutError(f"the operator was not quiet {timeout:.0f}s after its start: {window} requests/s")


def resync_spread(kube: Kube, operator: Operator, jobs: int, period: float) -> dict[str, Any]:
    """The operator's own requests per second over two resync periods of ``jobs`` idle jobs (the Lease's renewal,
    one PUT every 2 s, taken out), after its start's first passes."""
    namespace = f"bench-resync-{uuid.uuid4().hex[:5]}"
    names = [f"job-{i}" for i in range(jobs)]
    kube.kubectl("create", "namespace", namespace)
    kube.wait_for(lambda: kube.core.read_namespaced_service_account("default", namespace), 60, "default SA")
    try:
        for name in names:
            kube.prebind_checkpoint_volume(namespace, name)
            kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(small(name)))
        wait_all(kube, namespace, names, "Running", 120 + 6 * jobs)
        operator.stop()
        operator.start(f"--resync-seconds={period:g}")
        time.sleep(10 + period / 4)  # the start's first passes (every job reads the API once) and their events
        counts, last = [], own_requests(kube)
        end = time.monotonic() + 2 * period
        while time.monotonic() < end:
            time.sleep(1.0)
            now = own_requests(kube)
            counts.append(max(now - last - 0.5, 0.0))
            last = now
        operator.stop()
        operator.start()
        fives = [sum(counts[i : i + 5]) for i in range(0, len(counts) - 4)]
        total = sum(counts)
        return {
            "resync_jobs": jobs,
            "resync_period_s": period,
            "window_s": len(counts),
            "reads": round(total),
            "reads_per_job_per_period": round(total / jobs / 2, 1),
            "busiest_1s": round(max(counts)),
            "busiest_5s": round(max(fives)),
            "seconds_with_reads": sum(1 for c in counts if c >= 1),
            "even_share_per_s": round(total / len(counts), 1),
        }
    finally:
        kube.kubectl("delete", "rljobs", "--all", "-n", namespace, "--wait=true", "--timeout=300s", check=False)
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        for name in names:
            kube.kubectl("delete", "pv", f"{namespace}-{name}", "--wait=false", check=False)


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


def run_count(
    kube: Kube, operator: Operator, jobs: int, window: float, settle: float, changes: bool, resume: bool = True
) -> dict[str, Any]:
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
        row["running_req_per_s"], row["operator_own_req_per_s"] = rate(kube, window)
        row["operator"] = proc_stats(operator.proc.pid)
        operator.stop()
        time.sleep(2)
        row["stopped_req_per_s"], row["stopped_own_req_per_s"] = rate(kube, window)
        since, started = own_requests(kube), time.monotonic()
        operator.start()
        row["per_idle_job_req_per_s"] = (row["running_req_per_s"] - row["stopped_req_per_s"]) / jobs
        row["restart"] = settled(kube, since, started)  # the changes below meet an operator done starting
        wait_all(kube, namespace, names, "Running", 120)
        if changes:
            time.sleep(settle)
            before = request_counts(kube)
            row["suspend"] = spec_change(kube, namespace, names, True)
            # what the API server did meanwhile (the operator's writes, the controllers' and KWOK's answers)
            counts = request_counts(kube)
            mix, own = by_verb(counts) - by_verb(before), counts[OWN] - before[OWN]
            row["suspend"]["requests"] = {"total": sum(mix.values()), "operator": own, **dict(mix.most_common(12))}
            try:
                if resume:
                    row["resume"] = spec_change(kube, namespace, names, False)
            except TimeoutError as err:  # resume has no goal; an overloaded machine must not lose the row
                row["resume"] = {"timed_out": str(err)}
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
    p.add_argument("--jobs", type=int, nargs="*", default=[1, 10, 50], help="job counts (none: only --resync-spread)")
    p.add_argument(
        "--suspend-at",
        type=int,
        nargs="*",
        default=None,
        help="job counts to suspend and resume at (default: the largest of --jobs)",
    )
    p.add_argument(
        "--no-resume",
        action="store_true",
        help="suspend only (a resume of 50 jobs takes minutes on a loaded machine: for side-by-side suspend runs)",
    )
    p.add_argument("--resync-spread", type=int, default=0, help="idle jobs for the resync-spread row (0: none)")
    p.add_argument("--resync-period", type=float, default=60.0, help="--resync-seconds of the resync-spread row")
    p.add_argument("--window", type=float, default=60.0, help="seconds of each request-rate window")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to wait after the jobs are Running")
    p.add_argument("--json", default=None)
    p.add_argument("--operator-log", default=None, help="keep the operator's log here (its reconciles, one a line)")
    args = p.parse_args()
    kube = Kube(_bring_up())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        with installed(kube, Path(tmp)) as operator:
            time.sleep(3)
            suspend_at = set(args.suspend_at if args.suspend_at is not None else sorted(args.jobs)[-1:])
            for jobs in args.jobs:
                row = run_count(kube, operator, jobs, args.window, args.settle, jobs in suspend_at, not args.no_resume)
                print(json.dumps(row), flush=True)
                rows.append(row)
            if args.resync_spread:
                row = resync_spread(kube, operator, args.resync_spread, args.resync_period)
                print(json.dumps(row), flush=True)
                rows.append(row)
        if args.operator_log:
            shutil.copyfile(operator.log, args.operator_log)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
