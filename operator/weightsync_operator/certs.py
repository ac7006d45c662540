"""A per-job certificate authority and the coordinator's server certificate, made with ``cryptography``.

The coordinator serves TLS only (``weightsync coordinator`` refuses to serve
plaintext without ``--insecure``), so the operator issues, once per RLJob, a
self-signed CA and a server certificate it signs for the coordinator Service's
DNS names (``<svc>``, ``<svc>.<ns>``, ``<svc>.<ns>.svc``,
``<svc>.<ns>.svc.cluster.local``) plus ``localhost`` and ``127.0.0.1``: the
agent has no flag to override the name it checks, and a process inside the
coordinator pod (``weightsync coordinator --status``) dials the loopback address.

The CA's private key is discarded once it has signed: nothing can mint another
certificate that the job's clients trust. Keys are ECDSA P-256 (fast to make,
supported by gRPC). Nothing here rotates: the material lives as long as the job
(``VALIDITY``); see support.tls_secret for how it is stored and kept.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=3650)
"""Lifetime of the CA and the server certificate: the job's, since neither is ever re-issued."""
BACKDATE = datetime.timedelta(hours=1)
"""notBefore lies this far in the past, so a node whose clock runs a little behind still accepts the certificate."""
LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1",)


@dataclass(frozen=True)
class Issued:
    """PEM-encoded material: the CA certificate, the server certificate and the server's private key."""

    ca_cert: bytes
    cert: bytes
    key: bytes


def service_names(service: str, namespace: str) -> list[str]:
    """Every DNS name a pod may use for ``service`` in ``namespace``."""
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def issue(service: str, namespace: str, job: str, now: datetime.datetime | None = None) -> Issued:
    """A fresh CA and a server certificate for ``service`` signed by it (the CA key is not returned)."""
    now = now or datetime.datetime.now(datetime.UTC)
    start, end = now - BACKDATE, now + VALIDITY

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "weightsync"),
            x509.NameAttribute(NameOID.COMMON_NAME, _common_name(f"weightsync CA {namespace}/{job}")),
        ]
    )
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    key = ec.generate_private_key(ec.SECP256R1())
    dns = service_names(service, namespace)
    alt_names: list[x509.GeneralName] = [x509.DNSName(n) for n in (*dns, *LOOPBACK_NAMES)]
    alt_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in LOOPBACK_IPS]
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "weightsync"),
                    x509.NameAttribute(NameOID.COMMON_NAME, _common_name(service)),
                ]
            )
        )
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(
        ca_cert=ca_cert.public_bytes(serialization.Encoding.PEM),
        cert=cert.public_bytes(serialization.Encoding.PEM),
        key=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def _common_name(text: str) -> str:
    """X.509 caps a common name at 64 characters; it is informational here (clients check the SANs)."""
    return text[:64]


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )
