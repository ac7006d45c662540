"""A fleet for the framework integrations: every process on its own host, the replicas behind one OpenAI URL.

The hosts are ``tests.hostfleet``'s kind (one network namespace each): the coordinator, the
vLLM CPU replicas (``replica-nccl`` takes the NCCL channel over gloo, ``replica-cpu`` the CPU
stream; each with its agent and its proxy), ``openai`` playing the job's OpenAI Service (one
URL, each connection to the next replica's proxy: ``weightsync.cli._endpoint``), the trainer,
and Atropos's trajectory API and environment. ``REPLICAS`` is the full fleet (``make
frameworks``); ``SMALL`` is the smallest that still crosses hosts (one replica: what ``make
test`` starts, since each vLLM CPU server costs CI minutes on 2 cores). The trainer runs the examples under
``examples/integrations/`` as a user would, with the environment the operator gives a trainer
pod (``WEIGHTSYNC_OPENAI_URL`` names the Service by its DNS name).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests import hostfleet, netns, support

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "integrations"
REPLICAS = ("replica-nccl", "replica-cpu")
SMALL = ("replica-cpu",)
OPENAI, OPENAI_NAME, OPENAI_PORT = "openai", "fleet-openai.test.svc", 8000
ATROPOS_API, ATROPOS_API_NAME, ATROPOS_PORT = "atropos-api", "atropos-api.test.svc", 8000
ATROPOS_ENV = "atropos-env"
OTHER_HOSTS = ("coordinator", "trainer", OPENAI, ATROPOS_API, ATROPOS_ENV)


@dataclass
class FrameworkFleet:
    fleet: hostfleet.Fleet
    replicas: tuple[str, ...]

    @property
    def work(self) -> Path:
        return self.fleet.work

    def env(self, **extra: str) -> dict[str, str]:
        """A trainer pod's environment (docs/kubernetes.md), on the trainer host."""
        return self.fleet.env(
            WEIGHTSYNC_COORDINATOR=f"{hostfleet.COORDINATOR}:{hostfleet.PORT}",
            WEIGHTSYNC_INSECURE="1",
            WEIGHTSYNC_CHECKPOINT_DIR=str(self.fleet.mount("trainer")),
            WEIGHTSYNC_OPENAI_URL=f"http://{OPENAI_NAME}:{OPENAI_PORT}",
            WEIGHTSYNC_MODEL=str(self.fleet.model),
            POD_NAME="trainer-0",
            POD_IP=self.fleet.hosts.address("trainer"),
            NODE_NAME="node-trainer",
            RANK="0",
            OMP_NUM_THREADS="1",
            TRL_EXPERIMENTAL_SILENCE="1",
            **extra,
        )

    def run(
        self, name: str, argv: Sequence[str], timeout_s: float, host: str = "trainer", python: str = sys.executable
    ) -> subprocess.CompletedProcess[str]:
        """Run ``python argv`` on ``host`` to completion; its output goes to ``<name>.log``."""
        log = self.work / f"{name}.log"
        with log.open("w") as out:
            done = self.fleet.hosts.run(
                host, [python, *argv], env=self.env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s
            )
        return subprocess.CompletedProcess(done.args, done.returncode, log.read_text(errors="replace"), "")

    def example(
        self, script: str, *args: str, timeout_s: float = 1200, name: str = "", python: str = sys.executable
    ) -> tuple[dict[str, Any], Path]:
        """Run ``examples/integrations/<script>`` on the trainer host; its report and its final weights' folder."""
        name = name or Path(script).stem
        report, save = self.work / f"{name}.json", self.work / f"{name}-final"
        argv = [str(EXAMPLES / script), "--report", str(report), "--save", str(save), *args]
        done = self.run(name, argv, timeout_s, python=python)
        assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-6000:]}"
        return json.loads(report.read_text()), save

    def serves(self, model_dir: Path, version: int) -> None:
        """Every replica's engine serves ``version``, and its greedy tokens through its own proxy are what
        transformers gives for the weights in ``model_dir``."""
        import torch
        import transformers

        from weightsync_inference.http_engine import greedy
        from weightsync_trainer import reference

        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for host in self.replicas:
            assert self.fleet.engine(host) == (version, False), host
            with self.fleet.proxy(host) as client:
                got = greedy(client, support.PROMPTS, support.TOKENS)
            result = reference.agreement(model, support.PROMPTS, got, support.LOGPROB_TOLERANCE)
            assert result.ok, f"{host}: " + "\n".join(result.mismatches)

    def reset_weights(self) -> int:
        """Publish the model's initial weights (a baseline run without syncing starts from them); the version."""
        code = (
            "import json, os, torch, transformers\n"
            "from weightsync_trainer.publisher import Publisher\n"
            "from weightsync_trainer.sources import ModuleSource\n"
            "path = os.environ['WEIGHTSYNC_MODEL']\n"
            "m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)\n"
            "p = Publisher.from_env(ModuleSource(m)); r = p.publish(0); p.close()\n"
            "print(json.dumps(r.to_json()))\n"
        )
        done = self.run("reset", ["-c", code], timeout_s=600)
        assert done.returncode == 0, done.stdout[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["state"] == "READY", report
        return int(report["version"])

    @contextlib.contextmanager
    def atropos(self, steps: int) -> Iterator[str]:
        """Atropos's trajectory API and the example environment, each on its host; yields the API's URL."""
        api = self.fleet.spawn(
            ATROPOS_API,
            [sys.executable, "-m", "atroposlib.cli.run_api", "--host", self.fleet.hosts.address(ATROPOS_API),
             "--port", str(ATROPOS_PORT)],
            "atropos-api",
        )  # fmt: skip
        url = f"http://{ATROPOS_API_NAME}:{ATROPOS_PORT}"
        _wait_http(f"http://{self.fleet.hosts.address(ATROPOS_API)}:{ATROPOS_PORT}/info", api, 300)
        pod = self.env(ATROPOS_TOTAL_STEPS=str(steps))
        env = self.fleet.spawn(
            ATROPOS_ENV,
            [sys.executable, str(EXAMPLES / "atropos_env.py"), "serve", "--env.rollout_server_url", url,
             "--slurm", "false"],
            "atropos-env",
            **{k: v for k, v in pod.items() if k.startswith(("WEIGHTSYNC_", "ATROPOS_", "OMP_"))},
        )  # fmt: skip
        try:
            yield url
        finally:
            for proc in (env, api):
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)


def _wait_http(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{url} not up within {timeout_s:.0f}s (process exit code {proc.poll()})")
        time.sleep(1)


@contextlib.contextmanager
def running(work: Path, replicas: tuple[str, ...] = REPLICAS) -> Iterator[FrameworkFleet]:
    """The fleet up: coordinator, the replicas serving through the OpenAI Service; all removed after."""
    netns.require()
    with netns.Hosts((*OTHER_HOSTS, *replicas)) as hosts:
        hosts.resolve({hostfleet.COORDINATOR: "coordinator", OPENAI_NAME: OPENAI, ATROPOS_API_NAME: ATROPOS_API})
        fleet = hostfleet.Fleet(hosts, work, support.tiny_model())
        try:
            fleet.make_volume()
            fleet.start_coordinator()
            for host in replicas:
                fleet.start_replica(host)
            fleet.wait_serving(replicas)
            upstreams = [f"{hosts.address(r)}:{hostfleet.PROXY_PORT}" for r in replicas]
            endpoint = [sys.executable, "-m", "weightsync.cli._endpoint", f"{hosts.address(OPENAI)}:{OPENAI_PORT}"]
            fleet.spawn(OPENAI, [*endpoint, *upstreams], "openai")
            yield FrameworkFleet(fleet, replicas)
        finally:
            for name in ("coordinator", *(f"{r}-agent" for r in replicas)):
                print(f"----- {name}.log\n{fleet.tail(name)}")
            hosts.close()
            fleet.release_volume()
