"""The product as a user installs it, in containers: the chart and examples/rljob.yaml on the real node.

Nothing here plays a pod: ``helm install`` of the chart with the images ``make images`` built (the operator runs
as a container from its image), ``kubectl apply`` of examples/rljob.yaml changed only where a CPU machine must
(the CPU images, the tiny model, resources a 2-core machine has); the test's namespaces send their pods to the
real node (tests/e2e/node.py). The
operator makes the coordinator, trainer and replica pods; the real node's kubelet runs them in containerd from
those images; they find each other by cluster DNS (CoreDNS) and Services (kube-proxy). The one stand-in is the
GPU: the node advertises ``nvidia.com/gpu`` as an extended resource and the images are the CPU variant
(docs/kubernetes.md, "What the e2e cluster runs for real").

The trainer's command is the README's loop (``Publisher.from_env``, ``publish(step)``); it keeps its pod alive
after its last step until the test releases it, so the replicas are still serving when the test compares them
with transformers (a finished job parks its replicas). Checked:

- every version is Ready with both replicas loaded (per-replica state in the WeightVersion);
- a replica pod deleted mid-job (``kubectl delete pod``) comes back under its name and catches up;
- greedy tokens through the ``<job>-openai`` Service (a ClusterIP, routed by kube-proxy) equal transformers' on
  the trainer's final weights;
- ``kubectl logs`` of the trainer pod (the API server reaches the kubelet);
- ``helm uninstall`` after the RLJob is deleted leaves none of the chart's or the job's objects behind.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests import support
from tests.e2e import node
from tests.e2e import test_real_sync as real_sync
from tests.e2e.conftest import Kube, Timeouts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400), support.needs_images]

REPO = Path(__file__).resolve().parents[2]
JOB = "grpo-qwen"  # examples/rljob.yaml's name
GROUP, API = "weightsync.io", "v1alpha1"
REPLICAS = 2
STEPS = int(os.environ.get("WEIGHTSYNC_E2E_CONTAINER_STEPS", "6"))
STEP_SECONDS = 2.0
FAULT_AT = 2  # the replica pod is deleted when this version is Ready
MODEL = "/checkpoints/model"  # the tiny model on the checkpoint volume (no model hub here)
RELEASE = "/checkpoints/release"  # the trainer exits once this exists
FINAL = "/checkpoints/final"  # the trainer's final weights
# test_real_sync's trainer (the README's loop). It starts once both replicas registered (a real trainer's first step
# samples from them; published before, a version is planned for no replica and fails), and after its last step it
# waits to be released: the replicas serve until then.
_ANCHOR = "publisher = Publisher.from_env(ModuleSource(model))\n"
_FLEET = """
replicas = {f"{os.environ['WEIGHTSYNC_JOB']}-inference-{i}" for i in range(int(os.environ["REPLICAS"]))}
deadline = time.monotonic() + 900
while not replicas <= {m.member_id for m in publisher.client.get_job().members} and time.monotonic() < deadline:
    time.sleep(2)
"""
_HOLD = """
deadline = time.monotonic() + 900
while not Path(os.environ["RELEASE"]).exists() and time.monotonic() < deadline:
    time.sleep(1)
"""
assert _ANCHOR in real_sync.TRAINER
TRAINER = real_sync.TRAINER.replace(_ANCHOR, _ANCHOR + _FLEET) + _HOLD


def _job(images: dict[str, str]) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    spec = body["spec"]
    assert body["metadata"]["name"] == JOB and spec["inference"]["replicas"] == REPLICAS, body
    env = {"STEPS": str(STEPS), "STEP_SECONDS": str(STEP_SECONDS), "RELEASE": RELEASE, "FINAL_WEIGHTS": FINAL,
           "REPLICAS": str(REPLICAS)}  # fmt: skip
    # no requests: the pods share a 2-core machine with everything else; a GPU each, as on the GPU pool
    spec["trainer"].update(
        image=images["trainer"], command=["python", "-c", TRAINER], worldSize=1, resources={},
        env=[{"name": k, "value": v} for k, v in env.items()],
    )  # fmt: skip
    spec["inference"].update(
        image=images["inference"], model=MODEL, resources={}, vllmArgs=support.CONTAINER_VLLM_ARGS
    )  # fmt: skip
    spec["coordinator"] = {"image": images["coordinator"]}
    # every version kept, so the test can read each one's per-replica state at the end
    spec["sync"].update(everySteps=1, channels=["cpu", "volume"], timeoutSeconds=180, transferTimeoutSeconds=60,
                        retention=STEPS)  # fmt: skip
    return body


def _values(images: dict[str, str]) -> dict[str, Any]:
    repository, tag = images["operator"].rsplit(":", 1)
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "operator": {"coordinatorImage": images["coordinator"]},
    }


@pytest.fixture(scope="module")
def real(kube: Kube) -> Iterator[node.RealNode]:
    with node.real_node() as n:
        yield n


def _rljob(kube: Kube, namespace: str) -> dict[str, Any]:
    obj: dict[str, Any] = kube.custom.get_namespaced_custom_object(GROUP, API, namespace, "rljobs", JOB)
    return obj


def _versions(kube: Kube, namespace: str) -> dict[int, dict[str, Any]]:
    items = kube.custom.list_namespaced_custom_object(GROUP, API, namespace, "weightversions")["items"]
    return {o["spec"]["version"]: o for o in items}


def _loaded(version: dict[str, Any]) -> dict[str, str]:
    return {r["name"]: r["state"] for r in version.get("status", {}).get("replicas", [])}


def _greedy_through_service(kube: Kube, real: node.RealNode, namespace: str) -> Any:
    """Greedy generations through the job's OpenAI Service: its ClusterIP, from the node (kube-proxy routes it)."""
    service = kube.core.read_namespaced_service(f"{JOB}-openai", namespace)
    url = f"http://{service.spec.cluster_ip}:{service.spec.ports[0].port}"
    code = (
        "import json, sys, httpx; from weightsync_inference.http_engine import greedy; "
        f"c = httpx.Client(base_url={url!r}, trust_env=False); "
        f"print(json.dumps(greedy(c, {support.PROMPTS!r}, {support.TOKENS})))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = real.run([str(REPO / ".venv" / "bin" / "python"), "-c", code], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(ids, lps) for ids, lps in json.loads(proc.stdout)]


def test_rljob_runs_as_containers_from_the_chart(
    kube: Kube, namespace: str, real: node.RealNode, tmp_path: Path
) -> None:
    import transformers

    from weightsync_trainer import reference

    t0 = time.monotonic()
    images = real.images
    release = f"ws-{uuid.uuid4().hex[:5]}"
    system = f"{release}-system"
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(_values(images)))
    chart = str(REPO / "helm" / "weightsync")
    # both namespaces' pods go to the real node (node.NAMESPACE_ANNOTATIONS), the job's as the example places them
    kube.core.create_namespace({"metadata": {"name": system, "annotations": node.NAMESPACE_ANNOTATIONS}})
    kube.core.patch_namespace(namespace, {"metadata": {"annotations": node.NAMESPACE_ANNOTATIONS}})
    kube.helm("install", release, chart, "-n", system, "-f", str(values), "--wait", "--timeout", "5m")
    uninstalled = False
    volume = Path(f"/tmp/{namespace}-{JOB}")
    try:
        operator = kube.core.list_namespaced_pod(system, label_selector="app.kubernetes.io/component=operator").items
        assert [p.spec.node_name for p in operator] == [real.name], [p.spec.node_name for p in operator]
        assert operator[0].spec.containers[0].image == images["operator"]
        t_operator = time.monotonic()

        # the checkpoint volume (a hostPath on the node) holds the tiny model, as a model cache would
        volume.mkdir(mode=0o777, exist_ok=True)
        shutil.copytree(support.tiny_model(), volume / "model")
        for path in [volume, *volume.rglob("*")]:
            os.chown(path, 1000, 1000)
        kube.prebind_checkpoint_volume(namespace, JOB)
        kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(_job(images)))

        # every pod on the real node, from the images built here
        def pods_running() -> list[Any]:
            pods = kube.core.list_namespaced_pod(namespace, label_selector=f"weightsync.io/job={JOB}").items
            running = [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
            return running if len(running) == 1 + 1 + REPLICAS else []

        pods = kube.wait_for(pods_running, 600, "coordinator, trainer and both replicas Running", interval=2)
        for pod in pods:
            assert pod.spec.node_name == real.name, (pod.metadata.name, pod.spec.node_name)
            assert all(c.image in images.values() for c in pod.spec.containers), pod.spec.containers
        t_pods = time.monotonic()

        # the replica pod deleted once FAULT_AT is Ready; it comes back under its name and catches up
        victim = f"{JOB}-inference-1"
        kube.wait_for(lambda: _versions(kube, namespace).get(FAULT_AT, {}).get("status", {}).get("phase") == "Ready",
                      600, f"v{FAULT_AT} Ready", interval=2)  # fmt: skip
        uid = kube.core.read_namespaced_pod(victim, namespace).metadata.uid
        kube.kubectl("delete", "pod", victim, "-n", namespace, "--wait=false")
        t_fault = time.monotonic()

        # the trainer published every step; its report comes through `kubectl logs` (API server -> kubelet)
        trainer = f"{JOB}-trainer-0"

        def reports() -> list[dict[str, Any]] | None:
            out = kube.kubectl("logs", trainer, "-n", namespace, check=False).stdout
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            return lines if lines and "durable_errors" in lines[-1] else None

        lines = kube.wait_for(reports, 900, "the trainer's last step", interval=5)
        published = [(r["version"], r["state"]) for r in lines[:-1]]
        assert len(published) == STEPS and all(s == "READY" for _, s in published), published
        final = published[-1][0]
        t_trained = time.monotonic()

        # both replicas load the final version, the re-created one included
        def both_loaded() -> dict[str, Any] | None:
            version = _versions(kube, namespace).get(final)
            if version is None:
                return None
            wanted = {f"{JOB}-inference-{i}": "loaded" for i in range(REPLICAS)}
            return version if _loaded(version) == wanted else None

        kube.wait_for(both_loaded, 600, f"v{final} loaded by both replicas", interval=2)
        back = kube.core.read_namespaced_pod(victim, namespace)
        assert back.metadata.uid != uid and back.spec.node_name == real.name, back.metadata
        versions = _versions(kube, namespace)
        for v, obj in sorted(versions.items()):
            assert obj["status"]["phase"] in ("Ready", "Superseded"), (v, obj["status"])
        # the versions before the fault were loaded by both replicas
        wanted = {f"{JOB}-inference-{i}": "loaded" for i in range(REPLICAS)}
        before = [v for v in versions if v <= FAULT_AT]
        assert all(_loaded(versions[v]) == wanted for v in before), {v: _loaded(versions[v]) for v in before}
        t_caught_up = time.monotonic()

        # greedy tokens through the Service equal transformers' on the trainer's final weights
        weights = transformers.AutoModelForCausalLM.from_pretrained(volume / "final", dtype=torch.float32)
        base = support.hf_trainer(volume / "model", steps=0)
        for _ in range(REPLICAS * 2):  # the Service balances over both replicas: ask a few times
            got = _greedy_through_service(kube, real, namespace)
            result = reference.agreement(weights, support.PROMPTS, got, support.LOGPROB_TOLERANCE)
            assert result.ok, "\n".join(result.mismatches)
            assert reference.agreement(base, support.PROMPTS, got, support.LOGPROB_TOLERANCE).ok is False

        # the trainer is released and the job succeeds; deleting it and uninstalling leaves nothing
        (volume / "release").touch()
        kube.wait_for(lambda: _rljob(kube, namespace).get("status", {}).get("phase") == "Succeeded", 300,
                      "RLJob Succeeded", interval=2)  # fmt: skip
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--timeout", "120s")
        kube.wait_for(lambda: not kube.core.list_namespaced_pod(namespace).items, Timeouts.DELETE,
                      "the job's pods gone", interval=2)  # fmt: skip
        kube.helm("uninstall", release, "-n", system, "--wait", "--timeout", "3m")
        uninstalled = True

        # helm deletes the operator's Deployment and returns; its pod goes after it (the garbage collector, then the
        # kubelet's graceful stop on the real node), seconds later. What is left is reported on timeout.
        def nothing_left() -> bool:
            names = kube.kubectl("get", "all,cm,secret,sa,role,rolebinding,lease", "-n", system, "-o", "name").stdout
            left = [
                n for n in names.split() if not n.startswith(("configmap/kube-root-ca.crt", "serviceaccount/default"))
            ]
            assert left == [], left
            return True

        kube.wait_for(nothing_left, Timeouts.DELETE, "nothing of the release left in its namespace", interval=2)
        cluster = kube.kubectl("get", "clusterrole,clusterrolebinding,validatingadmissionpolicy,"
                               "validatingadmissionpolicybinding", "-o", "name").stdout  # fmt: skip
        assert release not in cluster, cluster
        assert not kube.custom.list_namespaced_custom_object(GROUP, API, namespace, "weightversions")["items"]
        print(
            f"\ntimings: operator Ready {t_operator - t0:.0f}s; pods Running +{t_pods - t_operator:.0f}s; replica "
            f"deleted at v{FAULT_AT} +{t_fault - t_pods:.0f}s; trainer done (v{final}) +{t_trained - t_fault:.0f}s; "
            f"both on v{final} +{t_caught_up - t_trained:.0f}s; total {time.monotonic() - t0:.0f}s"
        )
    finally:
        if not uninstalled:
            kube.helm("uninstall", release, "-n", system, check=False)
        kube.core.delete_namespace(system)
        kube.kubectl("delete", "pv", f"{namespace}-{JOB}", "--wait=false", check=False)
        shutil.rmtree(volume, ignore_errors=True)
