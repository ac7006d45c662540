"""Each component runs with only its own extra installed: what its image runs works in a clean virtualenv.

Every image installs the weightsync wheel, built from the files its Dockerfile copies
(``pyproject.toml``, ``README.md`` and the four package folders), with its component's
extra and nothing else. Here each extra gets its own virtualenv outside the repository,
installed the same way (not editable: the packaged files alone must suffice), and runs
from a folder outside the repository, so nothing is imported from the source tree:

- coordinator: torch is not installed; ``weightsync coordinator --help`` works, and the
  modules its in-cluster command loads (the Kubernetes store) import. A short real run:
  the test writes two durable versions onto a volume as the trainer does, then
  ``weightsync coordinator --volume`` with a job config recovers both from their
  manifests alone (manifest parsing needs no torch), checked through the real gRPC
  client and its /metrics;
- operator: torch is not installed; ``weightsync operator --help`` works, everything
  ``weightsync operator`` does before it dials the API server runs (the kopf registry
  with its handlers and metrics, the children of ``examples/rljob.yaml``), and the CRDs
  it serves generate as the dev environment generates them. Running it against a real
  control plane is the e2e tier's (tests/e2e).
- trainer and inference (torch, vLLM: gigabytes) only with ``WEIGHTSYNC_EXTRAS=all``
  (``make extras``): their entry points' ``--help`` and the publisher / vLLM plugin
  imports.

The virtualenvs are cached under ``$WEIGHTSYNC_CACHE/extras/<extra>-<hash of
pyproject.toml>`` (default ``~/.cache/weightsync``); weightsync itself is rebuilt from
this tree and reinstalled into them every session.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_coordinator_restart import write_version
from weightsync.cli._localfleet import free_port
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import JobPolicy
from weightsync.jobconfig import JobConfig
from weightsync.vocabulary import Channel, VersionState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("WEIGHTSYNC_CACHE", Path.home() / ".cache" / "weightsync")) / "extras"
CONTEXT = ("pyproject.toml", "README.md", "weightsync", "trainer", "inference", "operator")
"""What each image's wheel stage copies from the repository (images/*/Dockerfile)."""
COMPLETE = ".weightsync-complete"
HEAVY = pytest.mark.skipif(
    os.environ.get("WEIGHTSYNC_EXTRAS") != "all",
    reason="installs torch / vLLM (gigabytes) into a fresh virtualenv: set WEIGHTSYNC_EXTRAS=all (make extras)",
)
JOB = "extras-job"


def _uv(*args: str, timeout: float = 1200) -> None:
    subprocess.run([sys.executable, "-m", "uv", *args], check=True, timeout=timeout)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One pytest session at a time builds or updates a cached virtualenv."""
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@dataclass(frozen=True)
class Venv:
    root: Path
    cwd: Path
    """Outside the repository: ``python -c`` would otherwise import weightsync from the source tree."""

    def bin(self, name: str) -> str:
        return str(self.root / "bin" / name)

    def env(self) -> dict[str, str]:
        drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}
        return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONUNBUFFERED": "1"}

    def run(self, *argv: str, timeout: float = 120) -> str:
        """Run ``bin/argv[0]``; its stdout. Fails the test with its output when it exits non-zero."""
        command = [self.bin(argv[0]), *argv[1:]]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=self.cwd, env=self.env(), timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def python(self, code: str, timeout: float = 120) -> str:
        return self.run("python", "-c", code, timeout=timeout)

    def assert_without_torch(self) -> None:
        """weightsync comes from this virtualenv, and torch cannot be imported there at all."""
        where = self.python("import weightsync; print(weightsync.__file__)").strip()
        assert Path(where).is_relative_to(self.root), where
        proc = subprocess.run(
            [self.bin("python"), "-c", "import torch"], capture_output=True, text=True, cwd=self.cwd, env=self.env()
        )
        assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr, proc.stderr


def _venv(extra: str, source: Path, cwd: Path) -> Venv:
    """A virtualenv with ``weightsync[extra]`` from ``source``: dependencies cached per pyproject.toml, weightsync
    itself reinstalled from ``source`` every time (uv would otherwise reuse a wheel it built from older files)."""
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    root = CACHE / f"{extra}-{key}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with _locked(CACHE / f"{extra}-{key}.lock"):
        if not (root / COMPLETE).exists():
            shutil.rmtree(root, ignore_errors=True)
            _uv("venv", "--quiet", "--python", "3.11", str(root))
        python = str(root / "bin" / "python")
        _uv("pip", "install", "--quiet", "--python", python, "--reinstall-package", "weightsync", f"{source}[{extra}]")
        (root / COMPLETE).write_text(f"weightsync[{extra}] for pyproject.toml {key}\n")
    return Venv(root, cwd)


@pytest.fixture(scope="session")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Venv]:
    """``venvs(extra)``: that extra's virtualenv (built once per session)."""
    source = tmp_path_factory.mktemp("image-context")
    for name in CONTEXT:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, source / name)
    cwd = tmp_path_factory.mktemp("outside-repo")
    built: dict[str, Venv] = {}

    def get(extra: str) -> Venv:
        if extra not in built:
            built[extra] = _venv(extra, source, cwd)
        return built[extra]

    return get


def _startup_record(proc: subprocess.Popen[bytes], stdout: Path, stderr: Path, timeout_s: float = 60) -> dict[str, Any]:
    """The coordinator's ``--json`` startup record: it prints it once it serves (and has recovered)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = stdout.read_text()
        if text.endswith("\n"):
            record: dict[str, Any] = json.loads(text.splitlines()[0])
            return record
        assert proc.poll() is None, f"the coordinator exited {proc.returncode}:\n{stderr.read_text()}"
        time.sleep(0.1)
    raise AssertionError(f"the coordinator did not start within {timeout_s}s:\n{stderr.read_text()}")


def test_coordinator_extra_recovers_versions_from_manifests_without_torch(
    venvs: Callable[[str], Venv], tmp_path: Path
) -> None:
    venv = venvs("coordinator")
    venv.assert_without_torch()
    assert "--volume" in venv.run("weightsync", "coordinator", "--help")
    venv.python("import weightsync.coordinator.kubestore")  # what --kubernetes-namespace (its pod's command) loads

    volume = tmp_path / "ckpt"
    written = {v: write_version(volume, v, step=10 * v) for v in (1, 2)}  # in this process, which has torch
    config = JobConfig(JOB, (Channel.VOLUME, Channel.CPU), timeout_s=60, transfer_timeout_s=30, retention=2)
    (tmp_path / "job.json").write_text(json.dumps(config.to_json()))
    port, metrics_port = free_port(), free_port()
    stdout, stderr = tmp_path / "coordinator.out", tmp_path / "coordinator.err"
    argv = [venv.bin("weightsync"), "coordinator", "--insecure", "--port", str(port), "--json"]
    argv += ["--metrics-port", str(metrics_port), "--volume", str(volume), "--job-config", str(tmp_path / "job.json")]
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, cwd=venv.cwd, env=venv.env())
    try:
        record = _startup_record(proc, stdout, stderr)
        assert record["jobs"] == {JOB: {"newest_ready": 2}}, record
        with CoordinatorClient(f"127.0.0.1:{port}", insecure=True, timeout_s=20) as client:
            job = client.get_job(JOB)
            assert (job.newest_ready, job.newest_durable_ready) == (2, 2)
            assert job.policy == JobPolicy.of(config)
            versions = {
                v.version: (v.step, v.state, v.durable, v.manifest_path, v.manifest_checksum)
                for v in client.list_versions(JOB)
            }
        path1, checksum1, _ = written[1]
        path2, checksum2, _ = written[2]
        assert versions == {  # as the manifests alone tell it (no journal): both READY, the newest is the one served
            1: (10, VersionState.READY, True, path1, checksum1),
            2: (20, VersionState.READY, True, path2, checksum2),
        }
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as answer:
            assert 'weightsync_versions{state="READY"} 2.0' in answer.read().decode()
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, stderr.read_text()  # SIGTERM stops it cleanly


OPERATOR_START = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
import yaml
from kubernetes import client
from weightsync.metrics import OperatorMetrics
from weightsync.resources.rljob import RLJobSpec
from weightsync_operator import Options, Settings, build_registry, children
from weightsync_operator.kubeapi import Api

# what weightsync_operator.running.run builds before kopf dials the API server (no credentials loaded)
build_registry(Api(client.ApiClient()), Options(Settings()), OperatorMetrics.create(), ThreadPoolExecutor(1))
# what its first reconcile of examples/rljob.yaml would apply
spec = RLJobSpec.model_validate(yaml.safe_load(open(sys.argv[1]).read())["spec"])
owner = children.Owner("grpo", "ml", "uid-1")
objs = children.desired(owner, spec, "coord:1", "weightsync-coordinator", False)
objs += [*children.trainer_pods(owner, spec), children.token_secret(owner), children.tls_secret(owner)]
print(json.dumps(sorted([o["kind"], o["metadata"]["name"]] for o in objs)))
"""


def test_operator_extra_starts_without_torch(venvs: Callable[[str], Venv], tmp_path: Path) -> None:
    from weightsync.resources import crds

    venv = venvs("operator")
    venv.assert_without_torch()
    assert "--namespace" in venv.run("weightsync", "operator", "--help")
    venv.python("import weightsync_operator.running")  # the module `weightsync operator` runs

    script, example = tmp_path / "start.py", str(ROOT / "examples" / "rljob.yaml")
    script.write_text(OPERATOR_START)
    children = json.loads(venv.run("python", str(script), example))
    assert ["Deployment", "grpo-coordinator"] in children and ["StatefulSet", "grpo-inference"] in children
    dev = subprocess.run([sys.executable, str(script), example], capture_output=True, text=True, check=True)
    assert children == json.loads(dev.stdout)  # the same children as in the dev environment

    out = tmp_path / "generated"
    venv.run("weightsync", "crds", "--repo", str(out))
    assert {p: p.read_text() for p in out.rglob("*") if p.is_file()} == crds.outputs(out)  # CRDs and job.json's docs


@HEAVY
def test_trainer_extra_runs_the_publisher_imports(venvs: Callable[[str], Venv]) -> None:
    venv = venvs("trainer")
    assert "coordinator" in venv.run("weightsync", "--help")
    venv.python("import weightsync_trainer.publisher, weightsync_trainer.sources, weightsync_trainer.grpo", 300)


@HEAVY
def test_inference_extra_runs_agent_proxy_and_plugin(venvs: Callable[[str], Venv]) -> None:
    venv = venvs("inference")
    for command in ("agent", "proxy"):  # the two weightsync containers of an inference pod
        venv.run("weightsync", command, "--help")
    venv.python(
        "from importlib.metadata import entry_points\n"
        "(plugin,) = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'weightsync']\n"
        "assert callable(plugin.load())\n"
        "import weightsync_inference.agent, weightsync_inference.worker",
        300,
    )
