"""tests/netns.py: separate hosts on one machine, one network namespace each.

What the helper must guarantee for the tests built on it: hosts reach each other by address and by
resolved name, loopback is private to each host (the property that exposes 127.0.0.1 assumptions),
a link can be cut and restored, and nothing is left behind, even after an exception or a crash.
Helper processes are stdlib-only ``python -I -S -c`` scripts so each starts in tens of milliseconds.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netns

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PORT = 5000  # every namespace is fresh, so a fixed port never collides
PY = [sys.executable, "-I", "-S", "-c"]

# Listens on (argv[1], argv[2]), prints "ready", answers every connection with b"ok".
SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"ok")
    c.close()
"""

# For each "host:port" argument, prints "ok" or the exception's class name (and errno).
CLIENT = """
import socket, sys
timeout = float(sys.argv[1])
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as c:
            print(c.recv(2).decode() or "empty")
    except OSError as e:
        print(type(e).__name__, e.errno)
"""


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    netns.require()


def serve(hosts: netns.Hosts, name: str, bind: str, port: int = PORT) -> subprocess.Popen[str]:
    proc = hosts.popen(name, [*PY, SERVER, bind, str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "ready", (
        f"server in {name} on {bind}:{port} did not start: {proc.stderr.read() if proc.stderr else ''}"
    )
    return proc


def connect(hosts: netns.Hosts, name: str, *targets: str, timeout: float = 1.0) -> list[str]:
    """Connect from host ``name`` to each ``host:port``; one result per target ("ok" or the error)."""
    out = hosts.run(name, [*PY, CLIENT, str(timeout), *targets], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    results: list[str] = out.stdout.split("\n")[: len(targets)]
    return results


def connect_from_root(address: str, port: int = PORT, timeout: float = 1.0) -> str:
    try:
        with socket.create_connection((address, port), timeout=timeout) as c:
            return c.recv(2).decode()
    except OSError as e:
        return f"{type(e).__name__} {e.errno}"


def traces(run_id: str) -> list[str]:
    """What of the run the machine still shows: `ip netns list`, `ip link show`, /etc/netns."""
    found = [line for line in _ip("netns", "list").splitlines() if run_id in line]
    found += [line for line in _ip("link", "show").splitlines() if run_id in line]
    found += [str(p) for p in netns.NETNS_ETC.glob(f"*{run_id}*")]
    return found


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def ip_forward() -> str:
    return Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()


def test_hosts_reach_each_other_by_address_and_by_resolved_name() -> None:
    with netns.Hosts(["server", "client"]) as hosts:
        hosts.resolve({"job-coordinator.team.svc": "server"})
        serve(hosts, "server", hosts.address("server"))
        a = hosts.address("server")
        results = connect(hosts, "client", f"{a}:{PORT}", f"job-coordinator.team.svc:{PORT}", f"server:{PORT}")
        assert results == ["ok", "ok", "ok"], f"{results}; {netns.netfilter_hint()}"

        # The root namespace (the test's host network) reaches the hosts through the bridge ...
        assert connect_from_root(a) == "ok"
        # ... and the hosts reach a server of the root namespace bound on the bridge address.
        with socket.create_server((hosts.bridge_address, 0)) as listener:
            threading.Thread(target=lambda: listener.accept()[0].sendall(b"ok"), daemon=True).start()
            port = listener.getsockname()[1]
            assert connect(hosts, "client", f"{hosts.bridge_address}:{port}") == ["ok"]

        # Inside a host, the machine's hostname means that host; nothing routes outside the /24.
        lookup = "import socket; print(socket.gethostbyname(socket.gethostname()))"
        out = hosts.run("client", [*PY, lookup], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == hosts.address("client")
        routes = _ip("-n", hosts.namespace("client"), "-4", "route", "show").strip().splitlines()
        assert len(routes) == 1 and routes[0].startswith(hosts.subnet), routes


def test_loopback_is_private_to_each_host() -> None:
    with netns.Hosts(["a", "b"]) as hosts:
        serve(hosts, "a", "127.0.0.1")
        assert connect(hosts, "a", f"127.0.0.1:{PORT}") == ["ok"]  # the server is up, on a's loopback
        results = connect(hosts, "b", f"127.0.0.1:{PORT}", f"{hosts.address('a')}:{PORT}", f"a:{PORT}")
        assert all(r.startswith("ConnectionRefusedError") for r in results), results


def test_link_down_cuts_a_host_off_and_link_up_restores_it() -> None:
    with netns.Hosts(["a", "b"]) as hosts:
        target = f"{hosts.address('a')}:{PORT}"
        serve(hosts, "a", hosts.address("a"))
        assert connect(hosts, "b", target) == ["ok"]

        hosts.link_down("a")
        [result] = connect(hosts, "b", target, timeout=0.5)
        assert result != "ok", result
        assert connect_from_root(hosts.address("a"), timeout=0.5) != "ok"

        hosts.link_up("a")
        deadline = time.monotonic() + 10
        while (result := connect(hosts, "b", target)[0]) != "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert result == "ok"


def _assert_gone(hosts: netns.Hosts, procs: list[subprocess.Popen[bytes]]) -> None:
    assert traces(hosts.run_id) == []
    assert hosts.bridge not in _ip("link", "show", "type", "bridge")
    for proc in procs:
        assert proc.wait(timeout=10) is not None


def test_teardown_stops_processes_and_removes_everything() -> None:
    forward = ip_forward()
    with netns.Hosts(["coordinator", "trainer", "replica-0"]) as hosts:
        hosts.resolve({"job-coordinator.team.svc": "coordinator"})
        tracked = hosts.popen("replica-0", ["sleep", "60"])
        untracked = subprocess.Popen(hosts.command("trainer", ["sleep", "60"]))  # as a spawn helper would
        assert len(traces(hosts.run_id)) >= 3 + 3 + 1 + 3  # namespaces, veths, bridge, /etc/netns folders
        assert ip_forward() == forward
    _assert_gone(hosts, [tracked, untracked])
    assert ip_forward() == forward
    hosts.close()  # idempotent


def test_teardown_after_an_exception_in_the_block() -> None:
    with pytest.raises(RuntimeError, match="test failed inside"), netns.Hosts(["a", "b"]) as hosts:
        proc = hosts.popen("a", ["sleep", "60"])
        raise RuntimeError("test failed inside")
    _assert_gone(hosts, [proc])


@pytest.fixture
def crashed_run() -> Iterator[str]:
    """The run id of a Hosts whose process died without teardown (os._exit inside the block)."""
    script = "import os\nfrom tests import netns\nh = netns.Hosts(['a', 'b']).__enter__()\nprint(h.run_id)\nos._exit(0)"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    yield run_id
    netns.cleanup_leftovers()  # if the test failed before cleaning


def test_cleanup_leftovers_removes_crashed_runs_only(crashed_run: str) -> None:
    assert traces(crashed_run), "the crashed run should have left its namespaces behind"
    with netns.Hosts(["live"]) as live:
        removed = netns.cleanup_leftovers()  # a concurrent test run may have removed the crashed run first
        assert live.run_id not in removed
        assert traces(crashed_run) == []
        assert traces(live.run_id), "a live run must survive cleanup"
    assert traces(live.run_id) == []


def test_setup_failing_half_way_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    real_ip = netns._ip
    hosts = netns.Hosts(["a", "b", "c"])

    def failing_ip(*args: str) -> str:
        if args[:2] == ("-n", f"wsnet-{hosts.run_id}-1") and "lo" in args:  # the second host, almost done
            raise netns.NetnsError("injected failure")
        return real_ip(*args)

    monkeypatch.setattr(netns, "_ip", failing_ip)
    with pytest.raises(netns.NetnsError, match="injected failure"), hosts:
        pytest.fail("the block must not run when setup fails")
    assert traces(hosts.run_id) == []
