"""Run the containers of real Pod objects as processes, each pod on its own network namespace.

KWOK schedules pods and marks them Running but runs no container. For an e2e test that must move
real bytes, :class:`Kubelet` plays the kubelet for the pods it is given: each pod is one host of a
:class:`tests.netns.Hosts` run (its network namespace, named after the pod), and each container of it
a process started from the Pod object as the API server returned it:

- command: ``command + args`` as written; the container image cannot run here, so ``weightsync``
  becomes ``python -m weightsync.cli.main`` and ``python`` this interpreter (the packages of this
  repository are what the images hold);
- environment: literal values, ``secretKeyRef`` / ``configMapKeyRef`` read from the API server, and
  the downward API (``metadata.name``, ``metadata.namespace``, ``spec.nodeName`` as the scheduler
  bound it, ``status.podIP`` = the address of the pod's namespace, ``spec.serviceAccountName``);
- volumes: each pod gets its own folder per volume: ``configMap`` / ``secret`` / ``downwardAPI`` /
  ``projected`` volumes are written out (items, paths and modes as the spec says; a
  ``serviceAccountToken`` source is a TokenRequest token bound to the pod, so the
  ``kube-api-access-*`` volume the ServiceAccount admission adds holds the pod's in-cluster
  credentials as in a pod), ``emptyDir`` is an empty
  folder, and a ``persistentVolumeClaim`` is a symlink to its bound PersistentVolume's ``hostPath``
  (so every pod reaches the same files under its own path). A command argument or environment
  value that names a path under a container's ``mountPath`` is rewritten to that pod's folder:
  the only rewriting there is. Ports, addresses and DNS names are the pod's own.

Pods can also be handed over later (:meth:`Kubelet.add`: e.g. a pod its controller created again under the same
name, or a Deployment's new pod under a new name, played on a spare host of the run), :meth:`Kubelet.terminate` does
what a kubelet does when a pod is deleted (SIGTERM to its containers, SIGKILL after the grace period; the pod is
then gone for DNS and its host free), and :meth:`Kubelet.report_exit` writes the end of a pod's containers to the
API server as a kubelet does (phase, conditions, ``state.terminated`` with the exit code); KWOK itself only ever
marks pods Running, and its pod-delete stage removes a deleted pod's object at once.

:meth:`Kubelet.service_names` gives the DNS names a cluster's DNS would serve for the namespace's
Services (``<svc>.<ns>.svc`` of a Service that selects one pod, ``<hostname>.<subdomain>.<ns>.svc``
of a headless Service's pods), for :meth:`tests.netns.Hosts.resolve`; after a pod was terminated or another one
added, calling both again points the names at the pods now played (running processes see the change: the hosts
files are rewritten in place).

:class:`TcpForwarder` forwards a port on the bridge address (the namespaces' way to the test's host
network) to a loopback-only server, e.g. the kube-apiserver.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tests import netns

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where a pod's ServiceAccount token and the cluster's CA are mounted (the ``kube-api-access-*`` volume)."""
IMAGE_COMMANDS: dict[str, list[str]] = {
    "weightsync": [sys.executable, "-m", "weightsync.cli.main"],
    "python": [sys.executable],
    "python3": [sys.executable],
}
"""What a container's first word runs here (the images are this repository's packages)."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _base_env() -> dict[str, str]:
    """The environment every container starts from: this machine's, less proxies and anything of the test's own
    (an admin KUBECONFIG, WEIGHTSYNC_* settings), which a pod would not have."""
    drop = ("KUBECONFIG",)
    return {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and k not in drop and not k.startswith("WEIGHTSYNC_")
    }


@dataclass
class Proc:
    """One container's process, in its own session (so its children stop with it)."""

    pod: str
    container: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    uid: str = ""  # of the pod it ran for (a pod re-created under its name has another)
    started_at: str = ""  # RFC 3339, as a container status says it
    stopped: bool = False  # stopped on purpose (stop(), a deleted pod): its exit is no crash

    @property
    def name(self) -> str:
        return f"{self.pod}/{self.container}"

    def running(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        self.stopped = True
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
                self.popen.wait(timeout_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout_s)
        self.log.close()

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else "(no log)"


@dataclass
class _PodState:
    pod: Any
    root: Path
    host: str  # the Hosts host that plays it
    volumes: dict[str, Path] = field(default_factory=dict)
    gone: bool = False  # terminated: deleted from the API server, its processes ended


class Kubelet:
    """Starts containers of ``pods`` (V1Pod objects of ``namespace``; more with :meth:`add`), each pod in the
    ``hosts`` host named after it (or the host :meth:`add` was given)."""

    def __init__(self, kube: Any, namespace: str, hosts: netns.Hosts, pods: Sequence[Any], work: Path) -> None:
        self.kube, self.namespace, self.hosts, self.work = kube, namespace, hosts, work
        self.procs: list[Proc] = []
        self._created: list[Path] = []  # hostPath folders made here (removed by close)
        self._pods: dict[str, _PodState] = {}
        try:
            for pod in pods:
                self.add(pod)
        except BaseException:
            self.close()
            raise

    def add(self, pod: Any, host: str | None = None) -> None:
        """Take one more pod (a V1Pod bound to a node), e.g. one its controller created after this kubelet started.

        ``host`` is the host of ``hosts`` that plays it: by default the one named after the pod, or, for a name
        played before, the host that played it. A pod re-created under a name played before (a new uid: a
        controller deleted the old pod and made it again) takes the old one's place once the old one's processes
        have ended. A pod under a new name (a Deployment's replacement pod) can be given a spare host of the run,
        one that plays no pod or only pods whose processes have ended (:meth:`terminate`). Every pod gets fresh
        volumes under ``<work>/<name>.<n>`` (the first pod of a name has ``<work>/<name>``).
        """
        name, uid = pod.metadata.name, pod.metadata.uid
        previous = self._pods.get(name)
        host = host or (previous.host if previous is not None else name)
        assert host in self.hosts.names, f"no host {host} to play pod {name} (hosts: {self.hosts.names})"
        assert pod.spec.node_name, f"pod {name} is not bound to a node yet"
        if previous is not None:
            assert previous.pod.metadata.uid != uid, f"pod {name} ({uid}) is played already"
        others = {n for n, s in self._pods.items() if s.host == host}
        running = [p.name for p in self.procs if p.pod in others | {name} and p.running()]
        assert not running, f"{running} still run on host {host}"
        live = [n for n in others - {name} if not self._pods[n].gone]
        assert not live, f"host {host} plays pod(s) {live} already"
        root, n = self.work / name, 1
        while root.exists():
            n += 1
            root = self.work / f"{name}.{n}"
        root.mkdir(parents=True)
        state = _PodState(pod, root, host)
        self._pods[name] = state  # before the volumes: the downward API reads its host's address
        try:
            for volume in pod.spec.volumes or []:
                state.volumes[volume.name] = self._materialize(state, volume)
        except BaseException:
            if previous is not None:
                self._pods[name] = previous
            else:
                del self._pods[name]
            raise

    def pod(self, name: str) -> Any:
        """The V1Pod this kubelet plays under ``name`` (the newest one given that name)."""
        return self._pods[name].pod

    def host(self, pod: str) -> str:
        """The host of ``hosts`` that plays pod ``pod``."""
        return self._pods[pod].host

    def address(self, pod: str) -> str:
        """Pod ``pod``'s IP: the address of the host playing it (``status.podIP``)."""
        return self.hosts.address(self.host(pod))

    # -- volumes

    def volume(self, pod: str, name: str) -> Path:
        """Pod ``pod``'s folder for its volume ``name``."""
        return self._pods[pod].volumes[name]

    def _materialize(self, state: _PodState, volume: Any) -> Path:
        path: Path = state.root / "volumes" / str(volume.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        if volume.persistent_volume_claim is not None:
            path.symlink_to(self._claim_path(volume.persistent_volume_claim.claim_name))
            return path
        path.mkdir()
        if volume.empty_dir is not None:
            return path
        if volume.config_map is not None:
            self._project(path, "configMap", volume.config_map.name, volume.config_map.items)
        elif volume.secret is not None:
            self._project(path, "secret", volume.secret.secret_name, volume.secret.items)
        elif volume.downward_api is not None:
            self._downward(path, state, volume.downward_api.items)
        elif volume.projected is not None:
            for source in volume.projected.sources:
                if source.config_map is not None:
                    self._project(path, "configMap", source.config_map.name, source.config_map.items)
                elif source.secret is not None:
                    self._project(path, "secret", source.secret.name, source.secret.items)
                elif source.downward_api is not None:
                    self._downward(path, state, source.downward_api.items)
                elif source.service_account_token is not None:
                    self._token(path, state, source.service_account_token)
                else:
                    raise NotImplementedError(f"projected source {source} of volume {volume.name}")
        else:
            raise NotImplementedError(f"volume {volume.name}: {volume} cannot be played here")
        return path

    def _claim_path(self, claim: str) -> Path:
        """The hostPath of the PersistentVolume bound to ``claim`` (made if missing, as the kubelet's hostPath
        type DirectoryOrCreate would)."""
        pvc = self.kube.core.read_namespaced_persistent_volume_claim(claim, self.namespace)
        assert pvc.status.phase == "Bound" and pvc.spec.volume_name, f"claim {claim} is not bound: {pvc.status}"
        pv = self.kube.core.read_persistent_volume(pvc.spec.volume_name)
        assert pv.spec.host_path is not None, f"{pv.metadata.name}: only hostPath volumes can be played here"
        target = Path(pv.spec.host_path.path)
        if not target.exists():
            target.mkdir(parents=True)
            self._created.append(target)
        return target

    def _token(self, folder: Path, state: _PodState, source: Any) -> None:
        """A ServiceAccount token bound to the pod, from the TokenRequest API (what the kubelet projects)."""
        from kubernetes import client

        pod = state.pod
        spec = client.V1TokenRequestSpec(
            audiences=[source.audience] if source.audience else [],
            expiration_seconds=source.expiration_seconds or 3600,
            bound_object_ref=client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=pod.metadata.name, uid=pod.metadata.uid
            ),
        )
        account = pod.spec.service_account_name or "default"
        request = client.AuthenticationV1TokenRequest(spec=spec)
        token = self.kube.core.create_namespaced_service_account_token(account, self.namespace, request).status.token
        file = folder / source.path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(token)

    def _downward(self, folder: Path, state: _PodState, items: Sequence[Any]) -> None:
        for item in items:
            assert item.field_ref is not None, f"downward API item {item}: only fieldRef"
            file = folder / item.path
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(self._field(state.pod, item.field_ref.field_path))

    def _field(self, pod: Any, path: str) -> str:
        """A downward API field of ``pod``; ``status.podIP`` is the address of its namespace."""
        fields = {
            "metadata.name": pod.metadata.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": pod.metadata.uid,
            "spec.nodeName": pod.spec.node_name,
            "spec.serviceAccountName": pod.spec.service_account_name or "default",
            "status.podIP": self.address(pod.metadata.name),
        }
        if path not in fields:
            raise NotImplementedError(f"downward API field {path}")
        return str(fields[path])

    def _project(self, folder: Path, kind: str, name: str, items: Sequence[Any] | None) -> None:
        if kind == "configMap":
            cm = self.kube.core.read_namespaced_config_map(name, self.namespace)
            data = {k: v.encode() for k, v in (cm.data or {}).items()}
            data |= {k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()}
        else:
            secret = self.kube.core.read_namespaced_secret(name, self.namespace)
            data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
        chosen = [(i.key, i.path, i.mode) for i in items] if items else [(k, k, None) for k in data]
        for key, rel, mode in chosen:
            file = folder / rel
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(data[key])
            if mode is not None:
                file.chmod(mode)

    # -- what a container runs

    def _mounts(self, pod: str, container: Any) -> list[tuple[str, Path]]:
        """(mountPath, local folder) of the container's mounts, longest path first."""
        state = self._pods[pod]
        mounts = []
        for m in container.volume_mounts or []:
            local = state.volumes[m.name] / (m.sub_path or "")
            mounts.append((m.mount_path.rstrip("/") or "/", local))
        return sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    @staticmethod
    def _rewrite(value: str, mounts: Sequence[tuple[str, Path]]) -> str:
        for mount, local in mounts:
            if value == mount or value.startswith(mount + "/"):
                return str(local) + value[len(mount) :]
        return value

    def local_path(self, pod: str, container: str, path: str) -> Path:
        """Where ``path`` inside container ``container`` of ``pod`` is on this machine."""
        local = self._rewrite(path, self._mounts(pod, self.container(pod, container)))
        assert local != path, f"{path} is under no mount of {pod}/{container}"
        return Path(local)

    def in_cluster_kubeconfig(self, pod: str, container: str, path: Path, apiserver_port: int) -> Path:
        """What in-cluster config reads, as a kubeconfig at ``path``: the token and CA of the pod's ServiceAccount
        volume (a TokenRequest token bound to the pod), the API server by its in-cluster name. In-cluster config
        itself reads fixed paths and a ClusterIP from the environment, which a process here cannot have; a
        container started with ``extra_env={"KUBECONFIG": ...}`` of this file talks to the API server as the pod's
        ServiceAccount (through a :class:`TcpForwarder` on the bridge address)."""
        import yaml

        account = self.local_path(pod, container, SERVICE_ACCOUNT_DIR)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "in-cluster",
                    "cluster": {
                        "server": f"https://kubernetes.default.svc:{apiserver_port}",
                        "certificate-authority": str(account / "ca.crt"),
                    },
                }
            ],
            "users": [{"name": "pod", "user": {"tokenFile": str(account / "token")}}],
            "contexts": [{"name": "pod", "context": {"cluster": "in-cluster", "user": "pod"}}],
            "current-context": "pod",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def env(self, pod: str, container: Any) -> dict[str, str]:
        """The container's environment as the kubelet resolves it, mount paths rewritten."""
        p = self._pods[pod].pod
        out: dict[str, str] = {}
        for e in container.env or []:
            src = e.value_from
            if src is None:
                out[e.name] = e.value or ""
            elif src.secret_key_ref is not None:
                secret = self.kube.core.read_namespaced_secret(src.secret_key_ref.name, self.namespace)
                out[e.name] = base64.b64decode(secret.data[src.secret_key_ref.key]).decode()
            elif src.config_map_key_ref is not None:
                cm = self.kube.core.read_namespaced_config_map(src.config_map_key_ref.name, self.namespace)
                out[e.name] = cm.data[src.config_map_key_ref.key]
            elif src.field_ref is not None:
                out[e.name] = self._field(p, src.field_ref.field_path)
            else:
                raise NotImplementedError(f"{pod}/{container.name}: env {e.name} from {src}")
        mounts = self._mounts(pod, container)
        return {k: self._rewrite(v, mounts) for k, v in out.items()}

    def command(self, pod: str, container: Any) -> list[str]:
        """The container's command and args, its image's first word mapped here, mount paths rewritten."""
        argv = [*(container.command or []), *(container.args or [])]
        assert argv, f"{pod}/{container.name} has no command (the image's entrypoint cannot run here)"
        mounts = self._mounts(pod, container)
        head = IMAGE_COMMANDS.get(argv[0], argv[:1])
        return head + [self._rewrite(a, mounts) for a in argv[1:]]

    def container(self, pod: str, name: str) -> Any:
        return next(c for c in self._pods[pod].pod.spec.containers if c.name == name)

    def start(
        self,
        pod: str,
        container: str,
        *,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ) -> Proc:
        """Start container ``container`` of pod ``pod`` in the pod's namespace; ``extra_*`` are the test's additions
        (say which in the caller: a debug flag, credentials a laptop holds elsewhere)."""
        c = self.container(pod, container)
        env = {**_base_env(), **self.env(pod, c), **(extra_env or {})}
        tmp = self._pods[pod].root / "cwd"
        tmp.mkdir(exist_ok=True)
        log_path = self._pods[pod].root / f"{container}.log"
        log = log_path.open("ab")
        popen = self.hosts.popen(
            self.host(pod),
            self.command(pod, c) + list(extra_args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=tmp,
            start_new_session=True,
        )
        proc = Proc(pod, container, popen, log_path, log, self._pods[pod].pod.metadata.uid, _now())
        self.procs.append(proc)
        return proc

    def start_pod(self, pod: str) -> list[Proc]:
        """Every container of the pod (they share its namespace, as a pod's containers share its network)."""
        return [self.start(pod, c.name) for c in self._pods[pod].pod.spec.containers]

    def proc(self, pod: str, container: str) -> Proc:
        """The newest process of that container."""
        return [p for p in self.procs if p.pod == pod and p.container == container][-1]

    def report_exit(self, pod: str) -> Any:
        """Tell the API server that every container of ``pod`` exited, as a kubelet's status manager does
        (:func:`report_end` with each container's exit code; 128 + the signal for a killed one). Each container's
        newest process for this pod must have exited. Returns the patched V1Pod."""
        state = self._pods[pod]
        spec, uid = state.pod.spec, state.pod.metadata.uid
        ends = []
        for c in spec.containers:
            procs = [p for p in self.procs if p.pod == pod and p.container == c.name and p.uid == uid]
            assert procs, f"{pod}/{c.name} was never started"
            code = procs[-1].popen.poll()
            assert code is not None, f"{pod}/{c.name} still runs"
            ends.append(End(c.name, 128 - code if code < 0 else code, procs[-1].started_at, procs[-1].popen.pid))
        return report_end(self.kube, self.namespace, state.pod, ends)

    def terminate(self, pod: str, grace_s: float | None = None) -> list[Proc]:
        """What a kubelet does when pod ``pod`` is deleted: SIGTERM to every running container of it at once, SIGKILL
        to those still running after the grace period (``grace_s``, by default the pod's
        ``terminationGracePeriodSeconds``, 30 when unset), each in its whole process group. Returns the processes
        it stopped, all ended.

        The pod is gone afterwards: :meth:`service_names` no longer answers for it, its containers' exits are no
        crash, and its host may play another pod (:meth:`add`). The API server's side is not played here: KWOK's
        pod-delete stage removes the deleted object without waiting for the processes to end.
        """
        state = self._pods[pod]
        if grace_s is None:
            period = state.pod.spec.termination_grace_period_seconds
            grace_s = float(30 if period is None else period)
        procs = [p for p in self.procs if p.pod == pod and p.uid == state.pod.metadata.uid and p.running()]
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 15.0)):
            for p in procs:
                p.stopped = True
                if p.running():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.popen.pid, sig)
            deadline = time.monotonic() + wait_s
            while any(p.running() for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
        left = [p.name for p in procs if p.running()]
        assert not left, f"{left} outlived SIGKILL"
        for p in procs:
            p.stop()  # reaps, closes the log
        state.gone = True
        return procs

    def crashed(self) -> list[Proc]:
        """Containers whose newest process exited with an error (a trainer that finished is not one, nor a process
        stopped on purpose: :meth:`Proc.stop`, :meth:`terminate`)."""
        newest = {p.name: p for p in self.procs}
        return [p for p in newest.values() if not p.stopped and p.popen.poll() not in (None, 0)]

    def tails(self, chars: int = 3000) -> str:
        """The tail of every process's log, for a failure report."""
        return "\n".join(f"===== {p.name} (exit {p.popen.poll()})\n{p.tail(chars)}" for p in self.procs)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        for path in self._created:
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> Kubelet:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Print every process's log tail when the block failed (always with ``WEIGHTSYNC_E2E_PRINT_LOGS=1``),
        then stop the pods' processes."""
        if exc_type is not None or os.environ.get("WEIGHTSYNC_E2E_PRINT_LOGS") == "1":
            print(self.tails())
        self.close()

    # -- DNS

    def service_names(self) -> dict[str, str]:
        """DNS name -> the host playing the pod it names, for the namespace's Services, as cluster DNS would answer
        them here (for :meth:`tests.netns.Hosts.resolve`).

        A Service that selects one of these pods gets ``<svc>.<ns>.svc`` (its ports must reach the same port
        of the pod, since the name resolves to the pod itself here); a headless Service gets
        ``<hostname>.<svc>.<ns>.svc`` for each selected pod whose subdomain it is. A Service over several pods
        (a load balancer) is left out. Terminated pods are not selected (their endpoints are gone).
        """
        names: dict[str, str] = {}
        pods = [s.pod for s in self._pods.values() if not s.gone]
        for svc in self.kube.core.list_namespaced_service(self.namespace).items:
            selector = svc.spec.selector or {}
            if not selector:
                continue
            chosen = [p for p in pods if selector.items() <= (p.metadata.labels or {}).items()]
            base = f"{svc.metadata.name}.{self.namespace}.svc"
            if svc.spec.cluster_ip == "None":
                for p in chosen:
                    if p.spec.hostname and p.spec.subdomain == svc.metadata.name:
                        names[f"{p.spec.hostname}.{base}"] = self.host(p.metadata.name)
                        names[f"{p.spec.hostname}.{base}.cluster.local"] = self.host(p.metadata.name)
            elif len(chosen) == 1:
                for port in svc.spec.ports or []:
                    assert self._target_port(chosen[0], port.target_port) == port.port, (
                        f"Service {svc.metadata.name} maps port {port.port} to {port.target_port}: "
                        "resolving its name to the pod would skip that mapping"
                    )
                names[base] = self.host(chosen[0].metadata.name)
                names[f"{base}.cluster.local"] = self.host(chosen[0].metadata.name)
        return names

    @staticmethod
    def _target_port(pod: Any, target: int | str | None) -> int | None:
        if target is None or isinstance(target, int) or str(target).isdigit():
            return int(target) if target is not None else None
        for c in pod.spec.containers:
            for p in c.ports or []:
                if p.name == target:
                    return int(p.container_port)
        return None


@dataclass(frozen=True)
class End:
    """How one container of a pod ended."""

    container: str
    exit_code: int
    started_at: str
    pid: int = 0


def report_end(kube: Any, namespace: str, pod: Any, ends: Sequence[End]) -> Any:
    """Write the end of ``pod``'s containers to the API server as a kubelet's status manager does.

    A strategic-merge patch of the pod's ``status`` subresource with ``metadata.uid`` as a precondition (a pod
    re-created under the name is never patched by mistake): phase ``Succeeded`` when every container exited 0, else
    ``Failed`` (``restartPolicy: Never`` only: other policies restart the container instead); conditions Ready and
    ContainersReady False with reason PodCompleted; each container's ``state.terminated`` with its exit code and
    reason ``Completed`` or ``Error``. Returns the patched V1Pod."""
    assert pod.spec.restart_policy == "Never", f"pod {pod.metadata.name}: restartPolicy {pod.spec.restart_policy}"
    now = _now()
    images = {c.name: c.image for c in pod.spec.containers}
    statuses = [
        {
            "name": end.container,
            "image": images[end.container],
            "imageID": "",
            "ready": False,
            "started": False,
            "restartCount": 0,
            "state": {
                "terminated": {
                    "exitCode": end.exit_code,
                    "reason": "Completed" if end.exit_code == 0 else "Error",
                    "startedAt": end.started_at,
                    "finishedAt": now,
                    "containerID": f"weightsync-e2e://{end.pid}",
                }
            },
        }
        for end in ends
    ]
    conditions = [
        {"type": t, "status": "False", "reason": "PodCompleted", "lastTransitionTime": now}
        for t in ("Ready", "ContainersReady")
    ]
    body = {
        "metadata": {"uid": pod.metadata.uid},
        "status": {
            "phase": "Failed" if any(end.exit_code for end in ends) else "Succeeded",
            "conditions": conditions,
            "containerStatuses": statuses,
        },
    }
    return kube.core.patch_namespaced_pod_status(
        pod.metadata.name, namespace, body, _content_type="application/strategic-merge-patch+json"
    )


class TcpForwarder:
    """Forward TCP connections on ``listen`` (host, port) to ``target`` (host, port); a context manager.

    The test's stand-in for a route to a loopback-only server: bound to a ``Hosts`` run's bridge address,
    it lets processes in the namespaces reach e.g. the kube-apiserver on 127.0.0.1. Bytes are copied as
    they are (TLS passes through end to end).
    """

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self.connections = 0
        self._server: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> TcpForwarder:
        self._server = socket.create_server(self.listen)
        self._server.settimeout(0.2)
        self._spawn(self._accept)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()
        with self._lock:
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(5)

    def _spawn(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            self.connections += 1
            with self._lock:
                self._open.update((client, upstream))
            halves = [2]  # directions still copying; the last one to finish closes both sockets
            self._spawn(self._pump, client, upstream, halves)
            self._spawn(self._pump, upstream, client, halves)

    def _pump(self, src: socket.socket, dst: socket.socket, halves: list[int]) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            halves[0] -= 1
            if halves[0] == 0:
                for s in (src, dst):
                    s.close()
                    self._open.discard(s)
