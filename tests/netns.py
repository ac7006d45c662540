"""Separate "hosts" on one machine for integration and e2e tests: one Linux network namespace per process.

One loopback host hides every hostname, bind-address and shared-path assumption. This module gives
each process of a test (trainer, coordinator, each replica) its own network namespace, so
``127.0.0.1`` in the trainer is not ``127.0.0.1`` in a replica, and a server bound to loopback is
invisible to the other hosts, as on a cluster::

    from tests import netns

    def test_fleet() -> None:
        netns.require()  # skips, naming what is missing, when not root or without `ip`
        with netns.Hosts(["coordinator", "trainer", "replica-0"]) as hosts:
            hosts.resolve({"job-coordinator.ns.svc": "coordinator"})
            bind = hosts.address("coordinator")
            coordinator = hosts.popen("coordinator", [sys.executable, "-m", "...", "--bind", bind])
            replica = hosts.popen("replica-0", [..., "--coordinator", "job-coordinator.ns.svc:50051"])
            ...

Layout of one run (``R`` is a random 6-hex run id, ``X`` a free /24 of 198.18.0.0/15)::

    root namespace ("host network" of the test)
      bridge wsbrR  198.18.X.1/24          <- hosts.bridge_address
        veth wsvR-0 ──── eth0 198.18.X.2/24 in namespace wsnet-R-0   (first host name)
        veth wsvR-1 ──── eth0 198.18.X.3/24 in namespace wsnet-R-1   (second host name)
        ...

- 198.18.0.0/15 is the block reserved for network benchmark tests (RFC 2544); each run takes one
  /24 of it (512 to choose from) that no interface or route on the machine uses yet, chosen under a
  file lock so concurrent runs on one machine do not collide.
- The bridge's own address is the test's "host network": processes outside any namespace (the
  test process itself, a kube-apiserver or etcd started by an e2e test) bind there, and every
  namespace reaches them on the shared /24. Processes in the root namespace bound to 0.0.0.0 are
  reachable from the namespaces through that address too.
- Nothing leaves the machine: namespaces get only the on-link /24 route (no default route), the
  module adds no NAT rule and never touches ``net.ipv4.ip_forward`` (bridging is layer 2 and does
  not need it; with forwarding off, the root namespace would not route a namespace's packets out
  even if a namespace had a route). Connecting to any address outside the /24 from a namespace
  fails at once with "Network is unreachable"; so does a DNS lookup of a name the namespace's hosts
  file does not list (the machine's resolver is unreachable from a namespace).
- Bridge netfilter: with ``br_netfilter`` active and ``net.bridge.bridge-nf-call-iptables=1`` (the
  case on the development machine, checked 2026-11-26: br_netfilter built into the kernel, the
  ip/ip6/arp call sysctls all 1), frames crossing the bridge go through the root namespace's iptables
  FORWARD chain. That machine has no rules (``/proc/net/ip_tables_names`` is empty, no iptables or
  nft binary), so traffic passes; tests/integration/test_netns.py is the check. A machine whose
  FORWARD policy drops (Docker sets DROP) would drop traffic between namespaces: the fix there is
  one rule scoped to the bridge, ``iptables -I FORWARD -i wsbrR -o wsbrR -j ACCEPT``, which this
  module does not add; :func:`netfilter_hint` says what applies and tests put it in their messages.
  The per-bridge ``nf_call_iptables`` option cannot turn the global sysctl off (the kernel ORs them).

Names: ``ip netns exec NS`` bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts`` for the command
it starts. Every namespace gets such a file listing ``localhost``, every host name of the run, the
machine's hostname (``socket.gethostname()`` is the same in all namespaces; in each one it resolves
to that namespace's own address, like the ``<pod-ip> <hostname>`` line of a pod's /etc/hosts), and
the extra names given to :meth:`Hosts.resolve`. The file is rewritten in place (same inode), so
processes already running see later :meth:`Hosts.resolve` calls. Only processes started through
:meth:`Hosts.command` / :meth:`Hosts.popen` / :meth:`Hosts.run` see these names; the root namespace
keeps the machine's /etc/hosts.

Teardown (``__exit__`` or :meth:`Hosts.close`, idempotent, also after a setup that failed half-way)
stops every process still inside the namespaces (SIGTERM, then SIGKILL after ``grace_s``), deletes
the veths, namespaces, ``/etc/netns/<ns>`` folders and the bridge, then checks that none is left.
``/etc/netns`` itself may stay (empty); concurrent runs share it.

Leftovers of a crashed run (a test process killed with SIGKILL, a power cut): the bridge's
interface alias records the owning process (pid, start time, pid namespace); :func:`cleanup_leftovers`
removes only runs whose owner is gone, so it is safe beside concurrent runs. Nothing calls it
automatically; run it by hand or from a CI step::

    .venv/bin/python -m tests.netns cleanup
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

__all__ = [
    "NETNS_ETC",
    "SUPERNET",
    "Hosts",
    "NetnsError",
    "cleanup_leftovers",
    "leftovers",
    "missing",
    "netfilter_hint",
    "require",
]

SUPERNET: Final = ipaddress.IPv4Network("198.18.0.0/15")
"""The block reserved for network testing (RFC 2544); every run takes one /24 of it."""
NETNS_ETC: Final = Path("/etc/netns")
"""Where ``ip netns exec`` looks for per-namespace files bind-mounted over /etc."""
IFNAMSIZ: Final = 15  # Linux's interface name limit (16 bytes with the terminating NUL)
MAX_HOSTS: Final = 253  # .2 .. .254 of the /24; .1 is the bridge

_NS_PREFIX: Final = "wsnet-"  # namespaces: wsnet-<run>-<i>
_BRIDGE_PREFIX: Final = "wsbr"  # bridge: wsbr<run>
_VETH_PREFIX: Final = "wsv"  # root end of each veth: wsv<run>-<i>; the namespace end is eth0
_INSIDE_IF: Final = "eth0"
_NS_RE: Final = re.compile(r"^wsnet-([0-9a-f]{6})-\d+$")
_BRIDGE_RE: Final = re.compile(r"^wsbr([0-9a-f]{6})$")
_VETH_RE: Final = re.compile(r"^wsv([0-9a-f]{6})-\d+$")
_OWNER_RE: Final = re.compile(r"^weightsync-netns pid=(\d+) start=(\d+) pidns=(\d+)$")
_HOSTNAME_RE: Final = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_LOCK: Final = Path("/run/lock/weightsync-netns.lock")


class NetnsError(RuntimeError):
    """An ``ip`` command failed, or teardown left something behind."""


# --- the skip helper --------------------------------------------------------------------------------


def missing() -> str | None:
    """Why namespaces cannot be made here (None when they can): not root, or no ``ip`` binary."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()}); CI runs as root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed: apt-get install iproute2"
    return None


def require() -> None:
    """Skip the calling test, naming what is missing, when namespaces cannot be made here.

    Only root and the ``ip`` binary are checked: on a machine that has both, a failure to create a
    namespace is an error worth seeing, not a skip.
    """
    reason = missing()
    if reason is not None:
        import pytest  # only here: the module is usable outside pytest (cleanup CLI, e2e scripts)

        pytest.skip(f"separate network namespaces unavailable: {reason}")


def netfilter_hint() -> str:
    """One line about bridge netfilter on this machine, for assertion messages of connectivity tests."""
    sysctl = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if not sysctl.exists():
        return "br_netfilter inactive: bridged traffic bypasses iptables"
    value = sysctl.read_text().strip()
    if value == "0":
        return "bridge-nf-call-iptables=0: bridged traffic bypasses iptables"
    return (
        f"bridge-nf-call-iptables={value}: traffic between namespaces crosses the root namespace's iptables FORWARD "
        "chain; if its policy drops (Docker sets DROP), allow the test bridge: iptables -I FORWARD -i wsbrR -o wsbrR "
        "-j ACCEPT"
    )


# --- the hosts of one test --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Host:
    name: str
    namespace: str
    veth: str  # root end, enslaved to the bridge
    address: str


class Hosts:
    """One network namespace per host name, on a private bridge; a context manager.

    ``grace_s`` is how long teardown waits after SIGTERM before it SIGKILLs processes still running
    inside the namespaces.
    """

    def __init__(self, names: Sequence[str], *, grace_s: float = 2.0) -> None:
        names = list(names)
        if not names:
            raise ValueError("Hosts needs at least one host name")
        if len(names) > MAX_HOSTS:
            raise ValueError(f"at most {MAX_HOSTS} hosts fit the run's /24, got {len(names)}")
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {names}")
        for name in names:
            _check_name(name)
        self.run_id: Final = secrets.token_hex(3)
        self.bridge: Final = f"{_BRIDGE_PREFIX}{self.run_id}"
        self.grace_s = grace_s
        self._names: Final = tuple(names)
        self._subnet: ipaddress.IPv4Network | None = None
        self._hosts: dict[str, _Host] = {}
        self._aliases: dict[str, str] = {}  # extra name -> address
        self._procs: list[subprocess.Popen[Any]] = []
        self._entered = False
        self._closed = False
        assert len(self.bridge) <= IFNAMSIZ and len(_veth(self.run_id, MAX_HOSTS)) <= IFNAMSIZ

    # -- lifecycle

    def __enter__(self) -> Hosts:
        if self._entered:
            raise RuntimeError("a Hosts object is entered once; make a new one per test")
        self._entered = True
        try:
            self._setup()
        except BaseException:
            with contextlib.suppress(NetnsError):  # the setup error is the one to see
                self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()
        except NetnsError as error:
            if exc is None:
                raise
            warnings.warn(f"netns teardown after {exc_type.__name__ if exc_type else 'error'}: {error}", stacklevel=2)

    def close(self) -> None:
        """Stop processes inside the namespaces and delete everything this run made. Safe to repeat.

        Raises :class:`NetnsError` naming what could not be removed.
        """
        if self._closed:
            return
        self._closed = True
        namespaces = [_namespace(self.run_id, i) for i in range(len(self._names))]
        veths = [_veth(self.run_id, i) for i in range(len(self._names))]
        _stop_processes(namespaces, self._procs, self.grace_s)
        left = _remove(self.bridge, namespaces, veths)
        if left:
            raise NetnsError(f"netns run {self.run_id} left behind: {', '.join(left)}")

    # -- addresses and names

    @property
    def names(self) -> tuple[str, ...]:
        """The host names, in the order given."""
        return self._names

    @property
    def subnet(self) -> str:
        """The run's /24, e.g. ``198.18.57.0/24``."""
        return str(self._require_subnet())

    @property
    def bridge_address(self) -> str:
        """The root namespace's address on the run's /24: the test's "host network".

        Processes outside any namespace (the test itself, a kube-apiserver) listen here to be
        reachable from every host; the root namespace reaches the hosts through the bridge.
        """
        return str(self._require_subnet().network_address + 1)

    def address(self, name: str) -> str:
        """The IPv4 address of host ``name`` (its namespace's eth0)."""
        return self._host(name).address

    def namespace(self, name: str) -> str:
        """The network namespace playing host ``name`` (for ``ip netns exec`` / ``ip -n`` by hand)."""
        return self._host(name).namespace

    def resolve(self, names: Mapping[str, str]) -> None:
        """Make extra DNS names resolve, in every namespace, to the host playing them.

        ``names`` maps a name (e.g. a Service's ``<job>-coordinator.<ns>.svc``) to a host name of
        this run, or to :attr:`bridge_address` for something on the test's host network. Later calls
        add to (and override) earlier ones; running processes see the change (glibc rereads
        /etc/hosts on each lookup).
        """
        resolved: dict[str, str] = {}
        for alias, target in names.items():
            _check_name(alias)
            if target in self._hosts:
                resolved[alias] = self._hosts[target].address
            elif target == self.bridge_address:
                resolved[alias] = target
            else:
                raise ValueError(f"{alias!r} -> {target!r}: not a host of this run ({self._names}) nor the bridge")
        self._aliases.update(resolved)
        self._write_hosts_files()

    # -- processes

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside host ``name``: pass it to ``subprocess.Popen`` or a spawn helper.

        ``ip netns exec`` execs the command itself (no extra process in between), keeps the
        environment and working directory, and binds the host's hosts file over /etc/hosts.
        """
        return ["ip", "netns", "exec", self._host(name).namespace, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``name`` (keyword arguments go to ``subprocess.Popen``).

        Teardown stops it if it still runs and reaps it.
        """
        proc: subprocess.Popen[Any] = subprocess.Popen(self.command(name, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside host ``name`` to completion (keyword arguments go to ``subprocess.run``)."""
        return subprocess.run(self.command(name, argv), **kwargs)

    # -- partitions

    def link_down(self, name: str) -> None:
        """Cut host ``name`` off the bridge (pull its cable).

        The namespace keeps its address and loopback; its eth0 loses carrier, and packets to and from
        it are dropped, so new connections time out and open ones stall.
        """
        _ip("link", "set", "dev", self._host(name).veth, "down")

    def link_up(self, name: str) -> None:
        """Plug host ``name`` back into the bridge (STP is off: it forwards at once)."""
        _ip("link", "set", "dev", self._host(name).veth, "up")

    # -- internals

    def _host(self, name: str) -> _Host:
        if name not in self._hosts:
            raise KeyError(f"no host {name!r} in this run (hosts: {self._names}; entered: {self._entered})")
        return self._hosts[name]

    def _require_subnet(self) -> ipaddress.IPv4Network:
        if self._subnet is None:
            raise RuntimeError("Hosts is not set up yet: use it as a context manager")
        return self._subnet

    def _setup(self) -> None:
        with _locked():  # choose a free /24 and claim it (the bridge's address) atomically
            subnet = _free_subnet()
            _ip("link", "add", "name", self.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
            _ip("link", "set", "dev", self.bridge, "alias", _owner_mark())
            _ip("addr", "add", f"{subnet.network_address + 1}/{subnet.prefixlen}", "dev", self.bridge)
            self._subnet = subnet
        _ip("link", "set", "dev", self.bridge, "up")
        for i, name in enumerate(self._names):
            host = _Host(name, _namespace(self.run_id, i), _veth(self.run_id, i), str(subnet.network_address + 2 + i))
            _ip("netns", "add", host.namespace)
            self._hosts[name] = host
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", _INSIDE_IF, "netns", host.namespace)
            _ip("link", "set", "dev", host.veth, "master", self.bridge, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev", _INSIDE_IF)
            _ip("-n", host.namespace, "link", "set", "dev", _INSIDE_IF, "up")
            _ip("-n", host.namespace, "link", "set", "dev", "lo", "up")
        self._write_hosts_files()

    def _write_hosts_files(self) -> None:
        machine = socket.gethostname()
        for host in self._hosts.values():
            lines = [
                f"# {NETNS_ETC / host.namespace / 'hosts'}: written by tests/netns.py for host {host.name!r},",
                "# bind-mounted over /etc/hosts by `ip netns exec`",
                "127.0.0.1\tlocalhost",
                "::1\tlocalhost ip6-localhost ip6-loopback",
                f"{host.address}\t{machine}",  # gethostname() is shared: here it means this host
            ]
            by_address: dict[str, list[str]] = {}
            for other in self._hosts.values():
                by_address.setdefault(other.address, []).append(other.name)
            for alias, address in self._aliases.items():
                by_address.setdefault(address, []).append(alias)
            lines += [f"{address}\t{' '.join(names)}" for address, names in by_address.items()]
            folder = NETNS_ETC / host.namespace
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "hosts", "w") as f:  # in place: a bind mount keeps the old inode on rename
                f.write("\n".join(lines) + "\n")


# --- leftovers of crashed runs ----------------------------------------------------------------------


def leftovers() -> list[str]:
    """Every namespace, bridge, veth and /etc/netns folder of this module on the machine, live runs included."""
    found = [f"netns {n}" for n in _namespaces() if _NS_RE.match(n)]
    found += [f"link {n}" for n in _links() if _BRIDGE_RE.match(n) or _VETH_RE.match(n)]
    if NETNS_ETC.is_dir():
        found += [f"folder {p}" for p in sorted(NETNS_ETC.iterdir()) if _NS_RE.match(p.name)]
    return found


def cleanup_leftovers() -> list[str]:
    """Remove the runs whose owning process is gone; return their run ids.

    A run is live while its bridge exists and the process named in the bridge's alias runs (same
    pid and start time). Runs owned from another pid namespace are left alone (their owner cannot
    be checked from here). Pieces with no bridge are orphans: a run creates its bridge first and
    deletes it last. Safe beside concurrent runs; never called automatically.
    """
    with _locked():
        bridges = {m.group(1): name for name in _links() if (m := _BRIDGE_RE.match(name))}
        dead: set[str] = set()
        for run, bridge in bridges.items():
            if not _owner_alive(_alias(bridge)):
                dead.add(run)
        for name in [*_namespaces(), *_links(), *(p.name for p in _etc_folders())]:
            m = _NS_RE.match(name) or _VETH_RE.match(name)
            if m and m.group(1) not in bridges:
                dead.add(m.group(1))
        for run in sorted(dead):
            namespaces = [
                n for n in {*_namespaces(), *(p.name for p in _etc_folders())} if n.startswith(f"wsnet-{run}-")
            ]
            veths = [n for n in _links() if _VETH_RE.match(n) and n.startswith(f"{_VETH_PREFIX}{run}-")]
            _stop_processes(namespaces, [], grace_s=1.0)
            left = _remove(f"{_BRIDGE_PREFIX}{run}", namespaces, veths)
            if left:
                raise NetnsError(f"could not remove crashed netns run {run}: {', '.join(left)}")
        return sorted(dead)


# --- helpers ----------------------------------------------------------------------------------------


def _namespace(run_id: str, index: int) -> str:
    return f"{_NS_PREFIX}{run_id}-{index}"


def _veth(run_id: str, index: int) -> str:
    return f"{_VETH_PREFIX}{run_id}-{index}"


def _check_name(name: str) -> None:
    if len(name) > 253 or not _HOSTNAME_RE.match(name):
        raise ValueError(f"{name!r} is not a usable host name (letters, digits, '-', '.')")


def _ip(*args: str) -> str:
    """Run ``ip ARGS``; raise :class:`NetnsError` with its stderr on failure."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def _try_ip(*args: str) -> None:
    """Best effort (teardown): what still exists afterwards is checked separately."""
    subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def _namespaces() -> list[str]:
    # lines look like "wsnet-abc123-0 (id: 3)" or "wsnet-abc123-0"
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _links() -> list[str]:
    return [str(link["ifname"]) for link in json.loads(_ip("-j", "link", "show") or "[]")]


def _alias(link: str) -> str:
    try:
        info = json.loads(_ip("-j", "link", "show", "dev", link) or "[]")
    except NetnsError:
        return ""
    return str(info[0].get("ifalias", "")) if info else ""


def _etc_folders() -> list[Path]:
    return [p for p in NETNS_ETC.iterdir() if _NS_RE.match(p.name)] if NETNS_ETC.is_dir() else []


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network assigned or routed on the machine (root namespace)."""
    used: list[ipaddress.IPv4Network] = []
    for entry in json.loads(_ip("-j", "-4", "addr", "show") or "[]"):
        for info in entry.get("addr_info", []):
            used.append(ipaddress.IPv4Network(f"{info['local']}/{info['prefixlen']}", strict=False))
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = str(route.get("dst", ""))
        if dst and dst != "default" and not dst.startswith("fe80"):
            with contextlib.suppress(ValueError):
                used.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
    return used


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    candidates = list(SUPERNET.subnets(new_prefix=24))
    random.shuffle(candidates)
    for candidate in candidates:
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise NetnsError(f"no free /24 left in {SUPERNET}: clean leftovers with `python -m tests.netns cleanup`")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise subnet choice and leftover cleanup between runs on this machine."""
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counting from the one after "(comm)"


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _owner_mark() -> str:
    pid = os.getpid()
    return f"weightsync-netns pid={pid} start={_start_time(pid)} pidns={_pid_namespace()}"


def _owner_alive(mark: str) -> bool:
    m = _OWNER_RE.match(mark)
    if m is None:
        return False  # a bridge with no owner mark: its run died between creating and marking it
    pid, start, pidns = (int(g) for g in m.groups())
    if pidns != _pid_namespace():
        return True  # cannot tell from here: leave it to its own pid namespace
    return _start_time(pid) == start


def _netns_pids(namespaces: Iterable[str]) -> set[int]:
    pids: set[int] = set()
    for ns in namespaces:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30, check=False)
        pids.update(int(p) for p in out.stdout.split() if p.isdigit())
    pids.discard(os.getpid())
    return pids


def _stop_processes(namespaces: Sequence[str], procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> None:
    """SIGTERM everything inside ``namespaces`` (and ``procs``), SIGKILL what outlives ``grace_s``, reap ``procs``."""

    def running() -> set[int]:
        return _netns_pids(namespaces) | {p.pid for p in procs if p.poll() is None}

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = running()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while running() and time.monotonic() < deadline:
            time.sleep(0.02)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=1)


def _remove(bridge: str, namespaces: Sequence[str], veths: Sequence[str]) -> list[str]:
    """Delete veths (root ends first: namespace destruction is asynchronous), namespaces, folders, bridge.

    Best effort for each; returns what still exists.
    """
    existing_links = set(_links())
    for veth in veths:
        if veth in existing_links:
            _try_ip("link", "del", "dev", veth)
    existing_ns = set(_namespaces())
    for ns in namespaces:
        if ns in existing_ns:
            _try_ip("netns", "del", ns)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    if bridge in existing_links:
        _try_ip("link", "del", "dev", bridge)
    links, nss = set(_links()), set(_namespaces())
    left = [f"link {v}" for v in [*veths, bridge] if v in links]
    left += [f"netns {n}" for n in namespaces if n in nss]
    left += [f"folder {NETNS_ETC / n}" for n in namespaces if (NETNS_ETC / n).exists()]
    return left


def main(argv: Sequence[str]) -> int:
    """``python -m tests.netns cleanup`` removes crashed runs; ``python -m tests.netns list`` shows what exists."""
    if list(argv) == ["cleanup"]:
        removed = cleanup_leftovers()
        print(f"removed crashed runs: {' '.join(removed) or 'none'}")
        return 0
    if list(argv) == ["list"]:
        print("\n".join(leftovers()) or "nothing")
        return 0
    print("usage: python -m tests.netns {cleanup|list}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
