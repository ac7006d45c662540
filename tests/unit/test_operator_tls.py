"""The job's TLS material: the certificate's names and lifetime, its CA, the Secret made once, the pods' mounts."""

from __future__ import annotations

import base64
import copy
import datetime
import ipaddress
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from weightsync.cli import main
from weightsync.resources.rljob import RLJobSpec
from weightsync_operator import certs, children, names, podspecs, reconciling, support

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BODY: dict[str, Any] = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
SPEC = RLJobSpec.model_validate(BODY["spec"])
OWNER = children.Owner("grpo", "ml", "uid-1")
SERVICE = "grpo-coordinator"
DNS = ["grpo-coordinator", "grpo-coordinator.ml", "grpo-coordinator.ml.svc", "grpo-coordinator.ml.svc.cluster.local"]
MOUNT = "/etc/weightsync/tls"


@pytest.fixture(scope="module")
def issued() -> certs.Issued:
    return certs.issue(SERVICE, "ml", "grpo")


def _decoded(secret: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


# --------------------------------------------------------------------- the certificates


def test_server_certificate_names_the_service_and_loopback(issued: certs.Issued) -> None:
    cert = x509.load_pem_x509_certificate(issued.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [*DNS, "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert ExtendedKeyUsageOID.SERVER_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign is False


def test_longest_names_fit() -> None:
    """A 63-character namespace and a long job name: common names are capped at 64, SANs carry the full names."""
    namespace, job = "n" * 63, "j" * 50
    service = f"{job}-coordinator"
    cert = x509.load_pem_x509_certificate(certs.issue(service, namespace, job).cert)
    names_ = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert f"{service}.{namespace}.svc.cluster.local" in names_


def test_validity_covers_now_and_the_jobs_life() -> None:
    now = datetime.datetime(2026, 3, 1, 12, 0, tzinfo=datetime.UTC)
    got = certs.issue(SERVICE, "ml", "grpo", now=now)
    for pem in (got.ca_cert, got.cert):
        cert = x509.load_pem_x509_certificate(pem)
        assert cert.not_valid_before_utc == now - certs.BACKDATE
        assert cert.not_valid_after_utc == now + certs.VALIDITY
    assert datetime.timedelta(days=365 * 5) <= certs.VALIDITY
    fresh = x509.load_pem_x509_certificate(certs.issue(SERVICE, "ml", "grpo").cert)
    assert fresh.not_valid_before_utc < datetime.datetime.now(datetime.UTC) < fresh.not_valid_after_utc


def test_ca_signs_the_server_certificate_and_the_key_matches(issued: certs.Issued) -> None:
    ca = x509.load_pem_x509_certificate(issued.ca_cert)
    cert = x509.load_pem_x509_certificate(issued.cert)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca is True and constraints.path_length == 0
    assert ca.subject == ca.issuer and cert.issuer == ca.subject
    cert.verify_directly_issued_by(ca)  # raises if the CA's key did not sign it
    key = serialization.load_pem_private_key(issued.key, password=None)
    assert key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) == cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    other = x509.load_pem_x509_certificate(certs.issue(SERVICE, "ml", "grpo").ca_cert)
    with pytest.raises(Exception):  # noqa: B017 - a second job's CA (a fresh key) did not sign it
        cert.verify_directly_issued_by(other)


def _handshake(issued: certs.Issued, server_name: str, tmp_path: Path) -> None:
    """A TLS handshake (OpenSSL, default client checks) between the issued server cert and a client trusting the CA."""
    (tmp_path / "tls.crt").write_bytes(issued.cert)
    (tmp_path / "tls.key").write_bytes(issued.key)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    client_ctx = ssl.create_default_context(cadata=issued.ca_cert.decode())
    near, far = socket.socketpair()
    near.settimeout(5)
    far.settimeout(5)

    def serve() -> None:
        try:
            with server_ctx.wrap_socket(near, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with client_ctx.wrap_socket(far, server_hostname=server_name) as c:
            c.sendall(b"x")
    finally:
        far.close()
        thread.join(5)


@pytest.mark.parametrize("name", [*DNS, "localhost", "127.0.0.1"])
def test_a_client_trusting_the_ca_accepts_every_service_name(issued: certs.Issued, name: str, tmp_path: Path) -> None:
    _handshake(issued, name, tmp_path)


def test_a_client_rejects_other_names_and_other_cas(issued: certs.Issued, tmp_path: Path) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        _handshake(issued, "grpo-coordinator.other.svc", tmp_path)
    stranger = certs.issue(SERVICE, "ml", "grpo")
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(certs.Issued(stranger.ca_cert, issued.cert, issued.key), DNS[2], tmp_path)


# --------------------------------------------------------------------- the Secret


def test_secret_is_kubernetes_tls_with_the_ca_and_owned_by_the_job() -> None:
    secret = children.tls_secret(OWNER)
    assert secret["kind"] == "Secret" and secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["name"] == "grpo-tls" == names.tls_secret("grpo")
    assert secret["metadata"]["namespace"] == "ml"
    assert secret["metadata"]["ownerReferences"] == [OWNER.reference()]
    data = _decoded(secret)
    assert set(data) == {"tls.crt", "tls.key", "ca.crt"}
    cert = x509.load_pem_x509_certificate(data["tls.crt"])
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(data["ca.crt"]))
    assert "grpo-coordinator.ml.svc" in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)
    assert b"PRIVATE KEY" in data["tls.key"] and b"PRIVATE KEY" not in data["ca.crt"] + data["tls.crt"]


class FakeApi:
    """The operator's Api over a dict: enough for one reconcile."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.created: list[tuple[str, str]] = []

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return []

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = copy.deepcopy(obj)
        return obj

    def create(self, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        if key in self.objects:
            return False
        self.objects[key] = copy.deepcopy(obj)
        self.created.append((obj["kind"], meta["name"]))
        return True

    def delete(self, kind: str, namespace: str, name: str, propagation: str = "Background") -> bool:
        return self.objects.pop((kind, namespace, name), None) is not None

    def patch_status(self, kind: str, namespace: str, name: str, status: Any, resource_version: str | None) -> None:
        pass


def _reconcile(api: FakeApi) -> None:
    body = {"metadata": {"name": "grpo", "namespace": "ml", "uid": "uid-1", "generation": 1}, "spec": BODY["spec"]}
    reconciling.reconcile(api, body, reconciling.Settings())  # type: ignore[arg-type]


def test_secret_is_made_once_and_kept_across_reconciles_and_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi()
    _reconcile(api)
    assert api.created.count(("Secret", "grpo-tls")) == 1
    first = api.get("Secret", "ml", "grpo-tls")
    assert first is not None

    def no_new_material(*_: Any, **__: Any) -> certs.Issued:
        raise AssertionError("TLS material issued while the Secret exists")

    monkeypatch.setattr(certs, "issue", no_new_material)
    for _ in range(3):  # replayed events, a restarted operator: same reads, same Secret
        _reconcile(api)
    assert api.created.count(("Secret", "grpo-tls")) == 1
    assert api.get("Secret", "ml", "grpo-tls") == first


def test_an_existing_secret_is_kept_even_when_a_create_races(monkeypatch: pytest.MonkeyPatch) -> None:
    api = FakeApi()
    theirs = children.tls_secret(OWNER)
    # another reconcile created it between our read and our create: the create answers "exists", theirs stays
    real_get = api.get
    monkeypatch.setattr(api, "get", lambda kind, ns, name: None if kind == "Secret" else real_get(kind, ns, name))
    api.objects[("Secret", "ml", "grpo-tls")] = theirs
    _reconcile(api)
    assert api.objects[("Secret", "ml", "grpo-tls")] is theirs and ("Secret", "grpo-tls") not in api.created


def test_support_secret_is_fresh_each_call() -> None:
    """Why the reconciler must read first: every call issues new material."""
    assert support.tls_secret("grpo", "ml")["data"] != support.tls_secret("grpo", "ml")["data"]


# --------------------------------------------------------------------- the pods


def _pods() -> dict[str, dict[str, Any]]:
    objs = children.desired(OWNER, SPEC, "coord:1", "weightsync-coordinator", parked=False)
    objs += children.trainer_pods(OWNER, SPEC)
    out = {}
    for obj in objs:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            out[obj["metadata"]["name"]] = obj["spec"]["template"]["spec"]
        elif obj["kind"] == "Pod":
            out[obj["metadata"]["name"]] = obj["spec"]
    return out


def _tls_items(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The TLS Secret's items projected into the pod's volumes, by key."""
    out = {}
    for volume in pod["volumes"]:
        for source in volume.get("projected", {}).get("sources", []):
            if source.get("secret", {}).get("name") == "grpo-tls":
                out.update({i["key"]: i | {"volume": volume["name"]} for i in source["secret"]["items"]})
    return out


def _mount(container: dict[str, Any], volume: str) -> dict[str, Any]:
    return next(m for m in container["volumeMounts"] if m["name"] == volume)


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_coordinator_mounts_its_cert_and_key_read_only_and_serves_tls() -> None:
    pod = _pods()["grpo-coordinator"]
    items = _tls_items(pod)
    assert {k: v["path"] for k, v in items.items()} == {
        "tls.crt": "tls/tls.crt",
        "tls.key": "tls/tls.key",
        "ca.crt": "tls/ca.crt",
    }
    assert items["tls.key"]["mode"] == 0o440
    (container,) = pod["containers"]
    mount = _mount(container, items["tls.key"]["volume"])
    assert mount["mountPath"] == "/etc/weightsync" and mount["readOnly"] is True
    command = container["command"]
    assert _flag(command, "--tls-cert") == f"{MOUNT}/tls.crt" and _flag(command, "--tls-key") == f"{MOUNT}/tls.key"
    assert "--insecure" not in command


def test_agent_and_trainer_get_the_ca_and_never_the_key() -> None:
    pods = _pods()
    inference, trainer = pods["grpo-inference"], pods["grpo-trainer-0"]
    for pod in (inference, trainer):
        items = _tls_items(pod)
        assert {k: v["path"] for k, v in items.items()} == {"ca.crt": "tls/ca.crt"}
        assert "tls.key" not in str(pod)
    agent = next(c for c in inference["containers"] if c["name"] == "agent")
    assert _flag(agent["command"], "--tls-ca") == f"{MOUNT}/ca.crt" and "--insecure" not in agent["command"]
    assert _mount(agent, "config")["readOnly"] is True
    (container,) = trainer["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WEIGHTSYNC_TLS_CA"] == f"{MOUNT}/ca.crt" == podspecs.tls_path("ca.crt")
    assert _mount(container, "config")["readOnly"] is True and _mount(container, "config")["mountPath"] == (
        "/etc/weightsync"
    )


def test_the_cli_reads_the_flags_the_operator_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    pods = _pods()
    coordinator = pods["grpo-coordinator"]["containers"][0]
    agent = next(c for c in pods["grpo-inference"]["containers"] if c["name"] == "agent")
    for container in (coordinator, agent):
        for e in container["env"]:
            if "value" in e:
                monkeypatch.setenv(e["name"], e["value"])
    args = main.build_parser().parse_args(coordinator["command"][1:])
    assert (args.tls_cert, args.tls_key, args.insecure) == (f"{MOUNT}/tls.crt", f"{MOUNT}/tls.key", False)
    args = main.build_parser().parse_args(agent["command"][1:])
    assert (args.tls_ca, args.insecure) == (f"{MOUNT}/ca.crt", False)
