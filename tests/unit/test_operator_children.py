"""The children an RLJob turns into: GPUs, placement, security, the vLLM port fence, ownership."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from weightsync import jobconfig
from weightsync.coordinator.models import JobPolicy
from weightsync.errors import PermanentError
from weightsync.resources.rljob import PlacementMode, RLJobSpec
from weightsync.vocabulary import PauseMode, SyncMode
from weightsync_operator import children, names, reconciling

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BODY_SPEC = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())["spec"]
SPEC = RLJobSpec.model_validate(BODY_SPEC)
OWNER = children.Owner("grpo", "ml", "uid-1")


def _by_kind(parked: bool = False, spec: RLJobSpec = SPEC) -> dict[tuple[str, str], dict[str, Any]]:
    objs = children.desired(OWNER, spec, "coord:1", "weightsync-coordinator", parked)
    objs += [*children.trainer_pods(OWNER, spec), children.token_secret(OWNER), children.tls_secret(OWNER)]
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _containers(obj: dict[str, Any]) -> dict[str, Any]:
    pod = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    return {c["name"]: c for c in pod["containers"]}


def test_every_child_is_owned_labelled_and_hashed() -> None:
    for obj in _by_kind().values():
        meta = obj["metadata"]
        assert meta["namespace"] == "ml" and meta["labels"]["weightsync.io/job"] == "grpo"
        assert meta["ownerReferences"] == [OWNER.reference()]
        assert meta["annotations"][names.HASH_ANNOTATION] == children.spec_hash(obj)


def test_gpu_requests_and_gpu_pool_placement() -> None:
    objs = _by_kind()
    vllm = _containers(objs[("StatefulSet", "grpo-inference")])["vllm"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    trainer = objs[("Pod", "grpo-trainer-1")]
    assert _containers(trainer)["trainer"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert trainer["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert trainer["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert trainer["spec"]["subdomain"] == "grpo-trainer"
    env = {e["name"]: e.get("value") for e in _containers(trainer)["trainer"]["env"]}
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"].startswith("grpo-trainer-0.")
    coordinator = objs[("Deployment", "grpo-coordinator")]["spec"]["template"]["spec"]
    assert "nodeSelector" not in coordinator and "nvidia.com/gpu" not in str(coordinator)
    command = coordinator["containers"][0]["command"]
    assert command[command.index("--kubernetes-namespace") + 1] == "ml"  # it writes the job's WeightVersions


def test_spread_and_colocate() -> None:
    sts = _by_kind()[("StatefulSet", "grpo-inference")]["spec"]["template"]["spec"]
    assert sts["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    colocated = SPEC.model_copy(deep=True)
    colocated.placement.mode = PlacementMode.COLOCATE
    objs = _by_kind(spec=colocated)
    for key in (("StatefulSet", "grpo-inference"), ("Pod", "grpo-trainer-0")):
        obj = objs[key]
        pod = obj["spec"]["template"]["spec"] if key[0] == "StatefulSet" else obj["spec"]
        term = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term == {
            "labelSelector": {"matchLabels": {"weightsync.io/job": "grpo"}},
            "topologyKey": "kubernetes.io/hostname",
        }


def test_vllm_dev_routes_stay_inside_the_pod() -> None:
    objs = _by_kind()
    pod = _containers(objs[("StatefulSet", "grpo-inference")])
    vllm = pod["vllm"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in vllm["env"]
    host = vllm["command"][vllm["command"].index("--host") + 1]
    assert host == "127.0.0.1" and "ports" not in vllm
    assert "--weight-transfer-config" in vllm["command"] and '"weightsync-nccl"' in " ".join(vllm["command"])
    assert pod["agent"]["command"][:2] == ["weightsync", "agent"]
    assert pod["proxy"]["command"][:2] == ["weightsync", "proxy"]
    openai = objs[("Service", "grpo-openai")]["spec"]
    assert [p["targetPort"] for p in openai["ports"]] == ["openai"] and openai["ports"][0]["port"] == 8000
    exposed = {p["containerPort"] for c in pod.values() for p in c.get("ports", [])}
    assert names.VLLM_PORT not in exposed


def test_trainer_pods_are_told_the_jobs_openai_endpoint() -> None:
    """Rollout code in a trainer pod (TRL, Atropos: weightsync_trainer.integrations) finds the replicas through the
    OpenAI Service: its name, the job's namespace and the Service's port."""
    objs = _by_kind()
    service = objs[("Service", "grpo-openai")]["spec"]
    url = f"http://grpo-openai.ml.svc:{service['ports'][0]['port']}"
    for rank in range(SPEC.trainer.world_size):
        env = {e["name"]: e.get("value") for e in _containers(objs[("Pod", f"grpo-trainer-{rank}")])["trainer"]["env"]}
        assert env["WEIGHTSYNC_OPENAI_URL"] == url
    other = SPEC.model_copy(update={"inference": SPEC.inference.model_copy(update={"port": 9100})})
    env = _containers(_by_kind(spec=other)[("Pod", "grpo-trainer-0")])["trainer"]["env"]
    assert {"name": "WEIGHTSYNC_OPENAI_URL", "value": "http://grpo-openai.ml.svc:9100"} in env


def test_the_trl_examples_trainer_runs_the_trl_integration_against_its_jobs_endpoint() -> None:
    """examples/rljob-trl.yaml: its trainer command is examples/integrations/trl_grpo.py (copied into the image), and
    that trainer pod is told the grpo-trl job's OpenAI Service."""
    body = yaml.safe_load((REPO / "examples" / "rljob-trl.yaml").read_text())
    spec = RLJobSpec.model_validate(body["spec"])
    pod = children.trainer_pods(children.Owner(body["metadata"]["name"], "ml", "uid-2"), spec)[0]
    trainer = _containers(pod)["trainer"]
    script = Path(trainer["command"][1])
    assert trainer["command"][0] == "python" and (REPO / "examples" / "integrations" / script.name).is_file()
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["WEIGHTSYNC_OPENAI_URL"] == "http://grpo-trl-openai.ml.svc:8000"
    assert env["WEIGHTSYNC_MODEL"] == spec.inference.model


def test_pods_run_as_non_root_with_shm() -> None:
    objs = _by_kind()
    for key in (("StatefulSet", "grpo-inference"), ("Deployment", "grpo-coordinator"), ("Pod", "grpo-trainer-0")):
        obj = objs[key]
        pod = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    sts = objs[("StatefulSet", "grpo-inference")]["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in sts["volumes"]


def test_network_policies_admit_the_job_and_public_ports_only() -> None:
    policy = _by_kind()[("NetworkPolicy", "grpo-inference")]["spec"]
    from_job, public = policy["ingress"]
    assert from_job["from"] == [{"podSelector": {"matchLabels": {"weightsync.io/job": "grpo"}}}]
    assert "from" not in public and {p["port"] for p in public["ports"]} == {8000, names.METRICS_PORT}


def test_parked_scales_to_zero_and_hash_changes() -> None:
    running, parked = _by_kind(), _by_kind(parked=True)
    for key in (("StatefulSet", "grpo-inference"), ("Deployment", "grpo-coordinator")):
        assert parked[key]["spec"]["replicas"] == 0 and running[key]["spec"]["replicas"] >= 1
        assert children.current_hash(parked[key]) != children.current_hash(running[key])
    assert children.current_hash(running[("ConfigMap", "grpo-config")]) == children.current_hash(
        _by_kind()[("ConfigMap", "grpo-config")]
    )


def test_operator_never_imports_torch_or_vllm() -> None:
    code = (
        "import sys, weightsync_operator.running, weightsync.cli.operator; "
        "bad = [m for m in ('torch', 'vllm') if m in sys.modules]; sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_job_s_sync_choices_reach_every_process() -> None:
    """job.json carries the channels, timeouts, ack policy and NCCL domain; the coordinator mounts the volume it
    hashes and prunes; the trainer's rendezvous binds its pod IP; vLLM runs the worker extension the agent asks."""

    objs = _by_kind()
    config = json.loads(objs[("ConfigMap", "grpo-config")]["data"]["job.json"])
    assert config["sync"]["channels"] == ["nccl", "volume"] and config["ncclDomain"] == "grpo"
    assert config["sync"]["timeoutSeconds"] == 300 and config["sync"]["ackPolicy"] == "All"
    coordinator = objs[("Deployment", "grpo-coordinator")]["spec"]["template"]["spec"]
    command = coordinator["containers"][0]["command"]
    assert command[command.index("--volume") + 1] == names.CHECKPOINT_MOUNT
    mounts = {m["mountPath"]: m for m in coordinator["containers"][0]["volumeMounts"]}
    assert mounts[names.CHECKPOINT_MOUNT].get("readOnly") is False
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in _containers(
        objs[("Pod", "grpo-trainer-0")]
    )["trainer"]["env"]
    inference = _containers(objs[("StatefulSet", "grpo-inference")])
    vllm = inference["vllm"]["command"]
    assert vllm[vllm.index("--worker-extension-cls") + 1] == "weightsync_inference.worker.WorkerExtension"
    agent_env = {e["name"] for e in inference["agent"]["env"]}
    assert {"WEIGHTSYNC_CONFIG", "WEIGHTSYNC_COORDINATOR", "NODE_NAME", "POD_NAME"} <= agent_env
    no_nccl = SPEC.model_copy(update={"sync": SPEC.sync.model_copy(update={"channels": ["cpu", "volume"]})})
    config = json.loads(_by_kind(spec=no_nccl)[("ConfigMap", "grpo-config")]["data"]["job.json"])
    assert config["ncclDomain"] == ""
    # the pause mode reaches each replica's agent through the same file; a wrong one is refused there by name
    waits = SPEC.model_copy(update={"sync": SPEC.sync.model_copy(update={"pause_mode": PauseMode.WAIT})})
    config = json.loads(_by_kind(spec=waits)[("ConfigMap", "grpo-config")]["data"]["job.json"])
    assert jobconfig.JobConfig.parse(config).pause_mode is PauseMode.WAIT
    assert jobconfig.JobConfig.parse({"job": "j"}).pause_mode is PauseMode.KEEP
    atomic = {"mode": SyncMode.STAGED, "all_or_nothing": True}
    staged = SPEC.model_copy(update={"sync": SPEC.sync.model_copy(update=atomic)})
    config = json.loads(_by_kind(spec=staged)[("ConfigMap", "grpo-config")]["data"]["job.json"])
    parsed = jobconfig.JobConfig.parse(config)
    assert parsed.sync_mode is SyncMode.STAGED and parsed.all_or_nothing
    assert JobPolicy.of(parsed).all_or_nothing  # what the coordinator and the trainer register with
    assert not jobconfig.JobConfig.parse({"job": "j"}).all_or_nothing
    assert jobconfig.JobConfig.parse({"job": "j"}).sync_mode is SyncMode.IN_PLACE
    with pytest.raises(
        PermanentError, match=r"transferTimeoutSeconds \(120\) must be below sync.timeoutSeconds \(60\)"
    ):
        jobconfig.JobConfig.parse({"job": "j", "sync": {"timeoutSeconds": 60}})
    with pytest.raises(PermanentError, match=r"job.json: malformed job config \(ValueError: 'lazy' is not"):
        jobconfig.JobConfig.parse({"job": "j", "sync": {"mode": "lazy"}})
    with pytest.raises(PermanentError, match=r"job.json: malformed job config \(ValueError: 'sometimes' is not"):
        jobconfig.JobConfig.parse({"job": "j", "sync": {"pauseMode": "sometimes"}})


def test_the_join_deadline_reaches_the_job_config_and_the_policy() -> None:
    quick = SPEC.model_copy(update={"sync": SPEC.sync.model_copy(update={"join_timeout_seconds": 4})})
    config = json.loads(_by_kind(spec=quick)[("ConfigMap", "grpo-config")]["data"]["job.json"])
    parsed = jobconfig.JobConfig.parse(config)
    assert parsed.join_timeout_s == 4 and JobPolicy.of(parsed).join_timeout_s == 4
    assert jobconfig.JobConfig.parse({"job": "j"}).join_timeout_s == jobconfig.DEFAULT_JOIN_TIMEOUT_S
    with pytest.raises(PermanentError, match=r"joinTimeoutSeconds \(120\) must be above 0 and below sync.transferT"):
        jobconfig.JobConfig.parse({"job": "j", "sync": {"joinTimeoutSeconds": 120}})


def test_rdma_and_colocated_ipc_get_what_their_channels_need() -> None:
    from weightsync.resources.rljob import Rdma

    plain = _by_kind()
    trainer = plain[("Pod", "grpo-trainer-0")]
    assert "hostIPC" not in trainer["spec"]
    assert "add" not in _containers(trainer)["trainer"]["securityContext"]["capabilities"]

    sync = SPEC.sync.model_copy(update={"channels": ["ipc", "nccl", "volume"], "rdma": Rdma(resource="rdma/ib")})
    placement = SPEC.placement.model_copy(update={"mode": PlacementMode.COLOCATE})
    objs = _by_kind(spec=SPEC.model_copy(update={"sync": sync, "placement": placement}))
    for pod in (
        objs[("Pod", "grpo-trainer-0")]["spec"],
        objs[("StatefulSet", "grpo-inference")]["spec"]["template"]["spec"],
    ):
        assert pod["hostIPC"] is True
    for container in (
        _containers(objs[("Pod", "grpo-trainer-0")])["trainer"],
        _containers(objs[("StatefulSet", "grpo-inference")])["vllm"],
    ):
        assert container["resources"]["limits"]["rdma/ib"] == "1"
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    agent = _containers(objs[("StatefulSet", "grpo-inference")])["agent"]
    assert "add" not in agent["securityContext"]["capabilities"]  # only what registers memory gets IPC_LOCK


def _as_served(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as the API server would hand it back: defaults and bookkeeping added, quantities normalised."""
    import copy

    live = copy.deepcopy(obj)
    live["metadata"] |= {"uid": "u", "resourceVersion": "7", "creationTimestamp": "2026-11-26T00:00:00Z"}
    live["status"] = {"readyReplicas": 0}
    spec = live.get("spec", {})
    template = spec.get("template", {}).get("spec", {})
    for c in template.get("containers", []):
        c |= {"terminationMessagePath": "/dev/termination-log", "imagePullPolicy": "IfNotPresent"}
        for key, value in c.get("resources", {}).get("limits", {}).items():
            c["resources"]["limits"][key] = str(value)
        for mount in c.get("volumeMounts", []):
            if mount.get("readOnly") is False:
                del mount["readOnly"]  # omitempty: the server drops a false it was sent
    for port in spec.get("ports", []):
        port.setdefault("protocol", "TCP")
    return live


def test_a_child_as_the_server_keeps_it_has_not_drifted_and_a_hand_edit_has() -> None:
    by = _by_kind()
    for obj in by.values():
        assert not children.drifted(obj, _as_served(obj)), obj["metadata"]["name"]
    sts = _as_served(by[("StatefulSet", "grpo-inference")])
    assert not children.drifted(by[("StatefulSet", "grpo-inference")], sts)
    scaled = _as_served(by[("StatefulSet", "grpo-inference")])
    scaled["spec"]["replicas"] = 5  # kubectl scale
    assert children.drifted(by[("StatefulSet", "grpo-inference")], scaled)
    patched = _as_served(by[("Deployment", "grpo-coordinator")])
    patched["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"  # kubectl set image
    assert children.drifted(by[("Deployment", "grpo-coordinator")], patched)
    assert children.drifted(by[("Deployment", "grpo-coordinator")], None)


def test_covers_compares_quantities_by_value_and_ignores_what_is_not_set() -> None:
    assert children.covers({"cpu": "1", "memory": "1Gi"}, {"cpu": "1000m", "memory": "1Gi"})
    assert children.covers({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu": 1})
    assert children.covers({"a": 1, "b": 2}, {"a": 1, "c": None})
    assert not children.covers({"image": "a:1"}, {"image": "a:2"})
    assert not children.covers([1, 2, 3], [1, 2])
    assert not children.covers({"enabled": True}, {"enabled": "true"})
    assert children.covers({}, {"readOnly": False, "args": []}) and not children.covers({}, {"readOnly": True})


def test_every_container_with_a_read_only_root_has_a_writable_tmp() -> None:
    """A read-only root leaves Python's tempfile nowhere to write (importing torch asks it): the e2e node's proxy
    container crashed on that until its pod spec mounted /tmp."""
    for obj in _by_kind().values():
        if obj["kind"] not in ("Deployment", "StatefulSet", "Pod"):
            continue
        for name, container in _containers(obj).items():
            if container["securityContext"]["readOnlyRootFilesystem"]:
                mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
                assert "/tmp" in mounts, f"{obj['metadata']['name']}/{name} has a read-only root and no /tmp"


class _CountingApi:
    """An API server that holds ``pods`` alone (it never shows a deletion), takes every write and counts the reads
    and the deletes."""

    def __init__(self, pods: list[dict[str, Any]] | None = None) -> None:
        self.pods, self.gets, self.deletes = pods or [], list[tuple[str, str]](), list[str]()

    def get(self, kind: str, namespace: str, name: str) -> None:
        self.gets.append((kind, name))

    def list(self, kind: str, namespace: str, label_selector: str, field_selector: str = "") -> list[Any]:
        return self.pods if kind == "Pod" else []

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return obj

    def create(self, obj: dict[str, Any]) -> bool:
        return True

    def delete(self, kind: str, namespace: str, name: str, propagation: str = "Background") -> bool:
        self.deletes.append(name)
        return True

    def patch_status(self, kind: str, namespace: str, name: str, body: dict[str, Any], rv: str | None) -> None:
        pass


def test_a_pass_that_reads_the_api_reads_each_child_once() -> None:
    """The safety-net pass (no indexes) reads the workloads for the status and again to compare them with the spec:
    one GET each, not two."""
    api = _CountingApi()
    body = {"metadata": {"name": "grpo", "namespace": "ml", "uid": "uid-1", "generation": 1}, "spec": BODY_SPEC}
    reconciling.reconcile(api, body, reconciling.Settings())  # type: ignore[arg-type]
    assert ("Deployment", "grpo-coordinator") in api.gets and ("StatefulSet", "grpo-inference") in api.gets
    assert len(api.gets) == len(set(api.gets)), sorted(api.gets)


def test_a_suspended_jobs_ranks_are_deleted_once_though_the_next_pass_still_sees_them() -> None:
    """The pass after a suspend's may be woken by another child's event before the watch brings the ranks'
    deletion: it does not delete them again; a rank re-created under the same name (a new uid) is deleted anew."""
    ranks = children.trainer_pods(OWNER, SPEC)
    for rank, uid in zip(ranks, ("a", "b"), strict=True):
        rank["metadata"]["uid"] = uid
    api, memory = _CountingApi(ranks), reconciling.Memory()
    body = {
        "metadata": {"name": "grpo", "namespace": "ml", "uid": "uid-1", "generation": 2},
        "spec": {**BODY_SPEC, "suspend": True},
    }
    for _ in range(2):
        reconciling.reconcile(api, body, reconciling.Settings(), memory=memory)  # type: ignore[arg-type]
    assert sorted(api.deletes) == ["grpo-trainer-0", "grpo-trainer-1"]
    ranks[1]["metadata"]["uid"] = "c"
    reconciling.reconcile(api, body, reconciling.Settings(), memory=memory)  # type: ignore[arg-type]
    assert sorted(api.deletes) == ["grpo-trainer-0", "grpo-trainer-1", "grpo-trainer-1"]
    assert memory.deleted[("ml", "grpo")] == {"a", "c"}
