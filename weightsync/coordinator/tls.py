"""TLS material for the server and the client, read from PEM files.

TLS is on unless a caller says ``insecure``: the server needs a certificate and
key, and becomes mutual TLS when given a client CA (clients must then present a
certificate that CA signed). A client trusts the given CA file, or the system
roots when none is given. Files are read once, at start, with errors naming the
file and the option that set it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc  # type: ignore[import-untyped,unused-ignore]  # types-grpcio is not a dependency yet

from weightsync.errors import PermanentError


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise PermanentError(f"{what} {path!r} cannot be read ({e.strerror}); check the path and permissions") from None


@dataclass(frozen=True)
class ServerTls:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    """Set to require client certificates signed by this CA (mutual TLS)."""

    def credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key_file, "--tls-key"), _read(self.cert_file, "--tls-cert")
        assert key is not None and cert is not None
        ca = _read(self.client_ca_file, "--tls-client-ca")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class TlsConfig:
    """Client side: the CA that signed the server's certificate, and our own cert/key for mutual TLS."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None
    """Override the name checked against the server certificate (when dialling an IP)."""

    def credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert_file) != bool(self.key_file):
            raise PermanentError("TLS client: give both cert_file and key_file for mutual TLS, or neither")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "CA file"),
            private_key=_read(self.key_file, "client key"),
            certificate_chain=_read(self.cert_file, "client certificate"),
        )
