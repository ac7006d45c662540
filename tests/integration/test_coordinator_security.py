"""TLS, mutual TLS, the bearer token, size limits and validation, over real gRPC on loopback.

Certificates are minted per test session with ``cryptography`` (a CA, a server
certificate for localhost/127.0.0.1, a client certificate, and a rogue CA's
client certificate). Every rejection is checked for its status and for a message
that says what to fix.
"""

from __future__ import annotations

import ipaddress
import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from tests import pki as pki_mod
from tests import simulation
from weightsync.channels.base import Offer
from weightsync.coordinator import faults, server
from weightsync.coordinator._proto import coordinator_pb2 as pb
from weightsync.coordinator.client import CoordinatorClient
from weightsync.coordinator.models import Capabilities, TableSummary
from weightsync.coordinator.tls import ServerTls, TlsConfig
from weightsync.errors import PermanentError
from weightsync.vocabulary import Channel, VersionState

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
TOKEN = "s3cret-token"
CAPS = Capabilities(host="n", channels=(Channel.CPU,))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca_key, rogue_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    pki_mod.write(d / "ca", pki_mod.cert("weightsync-test-ca", ca_key, "weightsync-test-ca", ca_key, ca=True))
    pki_mod.write(d / "rogue-ca", pki_mod.cert("rogue", rogue_key, "rogue", rogue_key, ca=True))
    sk, ck, rk = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    sans: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    pki_mod.write(d / "server", pki_mod.cert("localhost", sk, "weightsync-test-ca", ca_key, sans=sans), sk)
    pki_mod.write(d / "client", pki_mod.cert("replica-0", ck, "weightsync-test-ca", ca_key), ck)
    pki_mod.write(d / "rogue-client", pki_mod.cert("intruder", rk, "rogue", rogue_key), rk)
    return d


@pytest.fixture(scope="module")
def mtls_server(pki: Path) -> Iterator[server.CoordinatorServer]:
    config = server.ServerConfig(
        port=0,
        token=TOKEN,
        max_message_bytes=4096,
        tls=ServerTls(str(pki / "server.crt"), str(pki / "server.key"), client_ca_file=str(pki / "ca.crt")),
    )
    s = server.CoordinatorServer(config).start()
    yield s
    s.stop(0.5)


def client(
    s: server.CoordinatorServer, pki: Path, who: str = "client", token: str | None = TOKEN, **kw: Any
) -> CoordinatorClient:
    tls = TlsConfig(ca_file=str(pki / "ca.crt"), cert_file=str(pki / f"{who}.crt"), key_file=str(pki / f"{who}.key"))
    return CoordinatorClient(s.target, token=token, tls=tls, timeout_s=kw.pop("timeout_s", 5.0), **kw)


def open_request(trainer: CoordinatorClient, **fields: Any) -> pb.OpenVersionRequest:
    """A raw OpenVersion request at step 8 of job ``secure`` (the fields given replace the valid defaults)."""
    valid: dict[str, Any] = {
        "lease_id": trainer.lease.lease_id,
        "job": "secure",
        "incarnation": trainer.incarnation,
        "step": 8,
        "table": pb.TableSummary(tensor_count=1, total_bytes=10, layout_digest=simulation.LAYOUT),
    }
    return pb.OpenVersionRequest(**{**valid, **fields})


def test_mtls_and_token_let_a_replica_process_in(mtls_server: server.CoordinatorServer, pki: Path) -> None:
    ctx = mp.get_context("spawn")
    events: Any = ctx.Queue()
    member = simulation.Member(
        mtls_server.target,
        "secure",
        "replica-0",
        token=TOKEN,
        ca_file=str(pki / "ca.crt"),
        cert_file=str(pki / "client.crt"),
        key_file=str(pki / "client.key"),
    )
    proc = ctx.Process(target=simulation.replica_main, args=(member, events), daemon=True)
    proc.start()
    try:
        assert events.get(timeout=30)[0] == "registered"
        with client(mtls_server, pki) as c:
            assert [m.member_id for m in c.get_job("secure").members] == ["replica-0"]
    finally:
        proc.kill()
        proc.join(5)


def test_missing_and_wrong_tokens_are_unauthenticated(mtls_server: server.CoordinatorServer, pki: Path) -> None:
    with client(mtls_server, pki, token=None) as c, pytest.raises(faults.Unauthenticated, match="missing bearer token"):
        c.register_replica("secure", "x", CAPS)
    with (
        client(mtls_server, pki, token="wrong") as c,
        pytest.raises(faults.Unauthenticated, match=r"bearer token rejected.*--token-file"),
    ):
        c.get_job("secure")


def test_clients_without_a_trusted_certificate_cannot_connect(mtls_server: server.CoordinatorServer, pki: Path) -> None:
    with client(mtls_server, pki, who="rogue-client", timeout_s=1.5) as c, pytest.raises(faults.Unavailable):
        c.register_replica("secure", "x", CAPS)
    no_cert = CoordinatorClient(
        mtls_server.target, token=TOKEN, tls=TlsConfig(ca_file=str(pki / "ca.crt")), timeout_s=1.5
    )
    with no_cert, pytest.raises(faults.Unavailable):
        no_cert.register_replica("secure", "x", CAPS)
    plaintext = CoordinatorClient(mtls_server.target, token=TOKEN, insecure=True, timeout_s=1.5)
    with plaintext, pytest.raises(faults.Unavailable):
        plaintext.register_replica("secure", "x", CAPS)


def test_malformed_calls_get_clear_statuses(mtls_server: server.CoordinatorServer, pki: Path) -> None:
    with client(mtls_server, pki) as c:
        with pytest.raises(faults.InvalidArgument, match="role is 0 \\(unset or unknown\\); valid values: trainer"):
            c._call("Register", lambda: pb.RegisterRequest(job="secure", member_id="m", incarnation="i"))
        with pytest.raises(faults.InvalidArgument, match="capabilities is missing"):
            c._call(
                "Register",
                lambda: pb.RegisterRequest(job="secure", role=pb.ROLE_REPLICA, member_id="m", incarnation="i"),
            )
        with pytest.raises(faults.InvalidArgument, match="job 'Not A Job' is not a valid name"):
            c.register_replica("Not A Job", "m", CAPS)
        with pytest.raises(faults.NotFound, match="job 'missing' is unknown"):
            c.get_job("missing")
        with pytest.raises(faults.ResourceExhausted, match=r"over the limit of 4096.*--max-message-bytes"):
            c.register_replica("secure", "big", Capabilities(host="x" * 8000, channels=(Channel.CPU,)))
        with pytest.raises(faults.InvalidArgument, match=r"timeout_s is 0.0"):
            c._call("WaitVersion", lambda: pb.WaitVersionRequest(job="secure", version=1, until=pb.WAIT_FOR_SETTLED))
    with client(mtls_server, pki) as trainer:
        trainer.register_trainer("secure", "trainer", CAPS)
        table = TableSummary(1, 10, simulation.LAYOUT)
        trainer.open_version(7, table)
        with pytest.raises(faults.FailedPrecondition, match="step 6 goes backwards"):
            trainer.open_version(6, table)
        with pytest.raises(faults.InvalidArgument, match=r"table.tensor_count must be >= 1"):
            trainer._call(
                "OpenVersion",
                lambda: open_request(trainer, table=pb.TableSummary(tensor_count=0, layout_digest=simulation.LAYOUT)),
            )
        with pytest.raises(faults.InvalidArgument, match=r"table: table.layout_digest 'abc' is not sha256:<64 hex>"):
            trainer._call(
                "OpenVersion", lambda: open_request(trainer, table=pb.TableSummary(tensor_count=1, layout_digest="abc"))
            )
        wildcard = pb.SenderOffer(channel=pb.CHANNEL_CPU, host="0.0.0.0", port=29500)
        with pytest.raises(faults.InvalidArgument, match=r"offers\[0\]: endpoint host '0.0.0.0' is not one address"):
            trainer._call("OpenVersion", lambda: open_request(trainer, offers=[wildcard]))
        with pytest.raises(faults.InvalidArgument, match=r"manifest_checksum 'a{64}' is not sha256:<64 hex>"):
            trainer.mark_durable(1, "/x/manifest.json", "a" * 64)
        with pytest.raises(faults.NotFound, match="has no version 99"):
            trainer.mark_durable(99, "/x/manifest.json", "sha256:" + "a" * 64)
        with pytest.raises(faults.InvalidArgument, match=r"wait_s is -1.0; send a wait between 0 and 3600s"):
            trainer.report_sent(1, "", {}, wait_s=-1)


def test_the_server_is_secure_by_default() -> None:
    with pytest.raises(PermanentError, match=r"TLS is on by default.*--insecure"):
        server.CoordinatorServer(server.ServerConfig(port=0))
    with pytest.raises(PermanentError, match="bearer token is required"):
        server.CoordinatorServer(server.ServerConfig(port=0, tls=ServerTls("a", "b")))


def test_every_field_from_a_client_is_bounded() -> None:
    """Within the message limit, no field may grow what the coordinator keeps and repeats to every member."""
    s = server.CoordinatorServer(server.ServerConfig(port=0, insecure=True)).start()
    try:
        with CoordinatorClient(s.target, insecure=True, timeout_s=5.0) as c:
            # a 3.9 MB member id used to make every later GetJob answer too large for anyone
            with pytest.raises(faults.InvalidArgument, match=r"member_id is 3900000 characters, over the limit of 253"):
                c.register_replica("bounded", "r" * 3_900_000, CAPS)
            with pytest.raises(faults.InvalidArgument, match=r"member_id 'r0\\nv2 READY' is not a valid id"):
                c.register_replica("bounded", "r0\nv2 READY", CAPS)
            many_gpus = Capabilities(host="n", channels=(Channel.NCCL,), gpu_uuids=tuple(f"GPU-{i}" for i in range(17)))
            with pytest.raises(faults.InvalidArgument, match=r"capabilities.gpu_uuids has 17 entries, over the limit"):
                c.register_replica("bounded", "r0", many_gpus)
            # a list's bound counts its entries; each entry keeps its type's bound (a real UUID is 40 characters)
            uuid = "GPU-90366200-70e0-d047-6d22-5eabb65b01c2"
            c.register_replica("bounded", "r-gpu", Capabilities(host="n", channels=(Channel.NCCL,), gpu_uuids=(uuid,)))
            long_uuid = Capabilities(host="n", channels=(Channel.NCCL,), gpu_uuids=("G" * 254,))
            with pytest.raises(faults.InvalidArgument, match=r"capabilities.gpu_uuids\[0\] is 254 characters"):
                c.register_replica("bounded", "r1", long_uuid)
            with pytest.raises(faults.InvalidArgument, match=r"offers\[0\].metadata is 1048577 bytes"):
                c.register_trainer(
                    "bounded", "t", CAPS, offers=[Offer(Channel.NIXL, agent="a", metadata=b"m" * ((1 << 20) + 1))]
                )
            c.register_trainer("bounded", "t", CAPS)
            table = TableSummary(1, 10, simulation.LAYOUT)
            v = c.open_version(1, table).version
            # a long failure text is cut on the client's side, not refused: the failure still reaches the record
            info = c.report_sent(v, "", {"gone": "x" * 100_000})
            assert info.state is VersionState.FAILED, info
            assert {m.member_id for m in c.get_job("bounded").members} == {"t", "r-gpu"}
    finally:
        s.stop(0.5)
