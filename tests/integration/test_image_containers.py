"""Each image, as a container: it starts as its non-root user with its documented command on a read-only root,
answers its probe, and fails with a clear message when a mount or variable it needs is missing.

The images are the CPU variant `make images` builds (``images/build.sh``; their names in
``$WEIGHTSYNC_CACHE/images/cpu.env``), run by podman with runc, no network but the container's own loopback
(the probes are asked from inside, ``podman exec``), a read-only root and only the writable paths the chart
mounts (``/tmp``), as the pods of an RLJob run them. Skipped unless ``WEIGHTSYNC_IMAGES`` is ``1``
(``make test``, after building them: the greedy completion is left to ``make container-tests``, whose ``all`` runs
it too); with it, missing podman or images is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests import support
from weightsync.resources.rljob import RLJobSpec
from weightsync_operator import names, workloads

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), support.needs_images]


def _images() -> dict[str, str]:
    if shutil.which("podman") is None:
        pytest.fail("WEIGHTSYNC_IMAGES=1 but podman is not installed: run tools/setup-containers.sh")
    return support.built_images()


def _run_args(*extra: str, read_only: bool = True) -> list[str]:
    """What a pod of the chart gets: no capabilities, no privilege escalation, a read-only root (but for the
    containers the operator lets write theirs), /tmp writable. runc (crun refuses this machine's hybrid cgroups);
    ulimits within the hard limits the VM allows."""
    return [
        "podman", "run", "--runtime", "runc", "--network", "none", *(["--read-only"] if read_only else []),
        "--tmpfs", "/tmp",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", *extra,
    ]  # fmt: skip


def _run(
    image: str, *argv: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    args = _run_args("--rm")
    for key, value in (env or {}).items():
        args += ["--env", f"{key}={value}"]
    return subprocess.run([*args, image, *argv], capture_output=True, text=True, timeout=timeout, check=False)


class Container:
    """A detached container; ``exec`` runs a command inside it (its own network namespace)."""

    def __init__(
        self,
        image: str,
        argv: list[str],
        env: dict[str, str],
        entrypoint: str | None = None,
        extra: tuple[str, ...] = (),
        read_only: bool = True,
    ) -> None:
        self.name = f"weightsync-test-{uuid.uuid4().hex[:8]}"
        args = _run_args("--detach", "--name", self.name, *extra, read_only=read_only)
        if entrypoint is not None:
            args += ["--entrypoint", entrypoint]
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        subprocess.run([*args, image, *argv], check=True, capture_output=True, text=True, timeout=120)

    def exec(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["podman", "exec", self.name, *argv], capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        proc = subprocess.run(["podman", "logs", self.name], capture_output=True, text=True, timeout=60)
        return proc.stdout + proc.stderr

    def running(self) -> bool:
        proc = subprocess.run(
            ["podman", "inspect", "--format", "{{.State.Running}}", self.name], capture_output=True, text=True
        )
        return proc.stdout.strip() == "true"

    def remove(self) -> None:
        subprocess.run(["podman", "rm", "--force", "--time", "2", self.name], capture_output=True, timeout=120)


@contextlib.contextmanager
def _container(
    image: str,
    argv: list[str],
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
    read_only: bool = True,
) -> Iterator[Container]:
    container = Container(image, argv, env or {}, extra=extra, read_only=read_only)
    try:
        yield container
    finally:
        container.remove()


def _wait_probe(container: Container, probe: str, timeout: float = 120) -> None:
    """Run ``python -c probe`` inside the container until it exits 0."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        assert container.running(), f"the container exited:\n{container.logs()}"
        proc = container.exec("python", "-c", probe)
        if proc.returncode == 0:
            return
        last = proc.stderr[-500:]
        time.sleep(1)
    raise AssertionError(f"the probe did not answer within {timeout:.0f}s: {last}\n{container.logs()}")


TCP_PROBE = "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2).close()"
HTTP_PROBE = "import urllib.request as u; assert u.urlopen('http://127.0.0.1:{port}{path}', timeout=2).status == 200"


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    return _images()


@pytest.mark.parametrize("component", ["operator", "coordinator", "trainer", "inference"])
def test_runs_as_its_non_root_user_on_a_read_only_root(images: dict[str, str], component: str) -> None:
    code = "import os; print(os.getuid(), os.getgid(), os.environ['HOME'])"
    proc = subprocess.run([*_run_args("--rm", "--entrypoint", "python"), images[component], "-c", code],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1000", "1000", "/home/weightsync"], proc.stdout
    root = subprocess.run(
        [*_run_args("--rm", "--entrypoint", "python"), images[component], "-c", "open('/etc/x', 'w')"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert root.returncode != 0 and "Read-only file system" in root.stderr, root.stderr


def test_coordinator_answers_its_probe(images: dict[str, str]) -> None:
    """The operator's coordinator command (insecure here: the TLS files are the next test's), probed as its
    Deployment's readinessProbe does: a TCP connection to the gRPC port."""
    argv = ["--host", "0.0.0.0", "--port", "50051", "--insecure", "--job", "j"]
    with _container(images["coordinator"], argv, {"WEIGHTSYNC_TOKEN": "t"}) as container:
        _wait_probe(container, TCP_PROBE.format(port=50051))


def test_coordinator_names_a_missing_tls_mount(images: dict[str, str]) -> None:
    proc = _run(images["coordinator"], "--tls-cert", "/etc/weightsync/tls/tls.crt", "--tls-key",
                "/etc/weightsync/tls/tls.key", env={"WEIGHTSYNC_TOKEN": "t"})  # fmt: skip
    assert proc.returncode != 0
    assert "/etc/weightsync/tls/tls.key' cannot be read" in proc.stderr and "check the path" in proc.stderr, proc.stderr


def test_operator_names_missing_cluster_credentials(images: dict[str, str]) -> None:
    proc = _run(images["operator"], "--liveness-port", "8080")
    assert proc.returncode != 0
    assert "KUBECONFIG" in proc.stderr or "in-cluster" in proc.stderr.lower(), proc.stderr[-2000:]


def test_inference_proxy_answers_health_only_when_vllm_does(images: dict[str, str]) -> None:
    """The replica's `proxy` container: it serves, and its readiness (/health) fails while vLLM is not up."""
    argv = ["weightsync", "proxy", "--listen", "0.0.0.0:8000", "--upstream", "http://127.0.0.1:8001"]
    with _container(images["inference"], argv) as container:
        _wait_probe(container, TCP_PROBE.format(port=8000))
        proc = container.exec("python", "-c", HTTP_PROBE.format(port=8000, path="/health"))
        assert proc.returncode != 0, "/health answered 200 with no vLLM behind the proxy"


def test_inference_agent_names_missing_coordinator(images: dict[str, str]) -> None:
    proc = _run(images["inference"], "weightsync", "agent", "--vllm-url", "http://127.0.0.1:8001")
    assert proc.returncode == 2
    assert "no --coordinator and no $WEIGHTSYNC_COORDINATOR" in proc.stderr, proc.stderr


def test_trainer_publisher_names_missing_job_config(images: dict[str, str]) -> None:
    code = (
        "import torch; from weightsync_trainer.publisher import Publisher; "
        "from weightsync_trainer.sources import ModuleSource; "
        "Publisher.from_env(ModuleSource(torch.nn.Linear(2, 2)))"
    )
    proc = _run(images["trainer"], "python", "-c", code, env={"WEIGHTSYNC_COORDINATOR": "c:50051"})
    assert proc.returncode != 0
    assert "WEIGHTSYNC_CONFIG" in proc.stderr and "names no job config" in proc.stderr, proc.stderr[-2000:]


def test_vllm_server_entrypoint_loads_the_plugin_and_the_cpu_kernels(images: dict[str, str]) -> None:
    """The `vllm` container's interpreter finds vLLM's CPU build, its compiled CPU kernels (they need libnuma from
    the base: without it the engine failed only once its worker started, on the e2e node) and weightsync's plugin."""
    code = (
        "from importlib.metadata import entry_points; import torch, vllm; "
        "from vllm.platforms import current_platform; current_platform.import_kernels(); "
        "assert hasattr(torch.ops._C, 'init_cpu_memory_env'), 'vLLM CPU kernels not loaded'; "
        "(p,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'weightsync']; "
        "p.load(); print(vllm.__version__)"
    )
    proc = _run(images["inference"], "python", "-c", code, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("0.32"), proc.stdout


@support.all_images
def test_vllm_answers_a_greedy_completion_with_logprobs(images: dict[str, str], tmp_path: Path) -> None:
    """The replica's `vllm` container, its command and environment as the operator writes them (the e2e's job), on
    the tiny model, answers the e2e's greedy request: token-id prompts with logprobs. vLLM compiles its sampler's
    logprob ranking with torch.compile even under --enforce-eager, and on the CPU inductor builds it with g++ and
    Python's headers: an image without them started and loaded every version, and its engine died at this first
    completion (``InvalidCxxCompiler``, the e2e's 500 "EngineCore encountered an issue")."""
    spec = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())["spec"]
    spec["inference"].update(model="/checkpoints/model", vllmArgs=support.CONTAINER_VLLM_ARGS)
    statefulset = workloads.inference("j", "ns", RLJobSpec.model_validate(spec), parked=False)
    (vllm,) = [c for c in statefulset["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    model = tmp_path / "model"
    shutil.copytree(support.tiny_model(), model)
    for path in [model, *model.iterdir()]:
        os.chown(path, 1000, 1000)  # the pod's user reads the volume, as the e2e's hostPath is made
    env = {e["name"]: e["value"] for e in vllm["env"]}
    # /dev/shm as the pod's memory emptyDir (podman's default is 64 MiB)
    extra = ("--volume", f"{model}:/checkpoints/model:ro", "--shm-size", "1g")
    read_only = vllm["securityContext"]["readOnlyRootFilesystem"]
    with _container(images["inference"], vllm["command"], env, extra, read_only) as container:
        _wait_probe(container, HTTP_PROBE.format(port=names.VLLM_PORT, path="/health"), timeout=480)
        code = (
            "import json, httpx; from weightsync_inference.http_engine import greedy; "
            f"c = httpx.Client(base_url='http://127.0.0.1:{names.VLLM_PORT}', trust_env=False); "
            f"print(json.dumps(greedy(c, {support.PROMPTS!r}, {support.TOKENS})))"
        )
        proc = container.exec("python", "-c", code, timeout=180)
        assert proc.returncode == 0, f"{proc.stderr[-2000:]}\n{container.logs()[-6000:]}"
        result = json.loads(proc.stdout)
        assert [len(ids) for ids, _ in result] == [support.TOKENS] * len(support.PROMPTS), result
        assert container.running(), f"vLLM exited after answering:\n{container.logs()[-6000:]}"
