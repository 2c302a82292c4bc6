"""TLS for the store and the weight channel: credentials from PEM files, and a throwaway CA for
tests and the secure bench.

Server side (``rollbook serve``, the trainer's weight server): a certificate and its key
(``--tls-cert``/``--tls-key``, env ``ROLLBOOK_TLS_CERT``/``ROLLBOOK_TLS_KEY``) and optionally the CA
that signs client certificates (``--tls-client-ca``, env ``ROLLBOOK_TLS_CLIENT_CA``): with it every
client must present a certificate that CA signed (mutual TLS).

Client side (``StoreClient``, ``NetworkReceiver``, every command that talks to them): the CA that
signed the server's certificate (``--tls-ca``, env ``ROLLBOOK_TLS_CA``) and, for mutual TLS, a client
certificate and key (``--tls-client-cert``/``--tls-client-key``, env ``ROLLBOOK_TLS_CLIENT_CERT``/
``ROLLBOOK_TLS_CLIENT_KEY``). The server's certificate must name the host the client dials (a DNS or
IP subject alternative name); ``ROLLBOOK_TLS_SERVER_NAME`` overrides the name checked.

See docs/security.md.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
from dataclasses import dataclass

import grpc


def _read(path: str | os.PathLike | None) -> bytes | None:
    return None if path is None else pathlib.Path(path).read_bytes()


@dataclass(frozen=True)
class ServerTLS:
    """PEM paths of a server's certificate and key, and optionally of the CA its clients' certificates
    must chain to (set = mutual TLS, a client without a certificate is refused at the handshake)."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca)
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))], root_certificates=ca, require_client_auth=ca is not None
        )

    @classmethod
    def from_env(cls) -> "ServerTLS | None":
        from rollbook import environment as env

        values = env.server_tls()
        cert, key = values["cert"], values["key"]
        if not cert and not key:
            return None
        if not (cert and key):
            raise ValueError("ROLLBOOK_TLS_CERT and ROLLBOOK_TLS_KEY go together")
        return cls(cert, key, values["client_ca"])


@dataclass(frozen=True)
class ClientTLS:
    """PEM paths a client trusts (``ca``: the CA that signed the server's certificate; None = the
    system roots) and presents (``cert``/``key``: for a server that requires client certificates)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key (and the other way round)")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca), private_key=_read(self.key), certificate_chain=_read(self.cert)
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @classmethod
    def from_env(cls) -> "ClientTLS | None":
        from rollbook import environment as env

        values = env.client_tls()
        return cls(**values) if any(values.values()) else None


def channel(target: str, tls: ClientTLS | None, options: list[tuple[str, object]]) -> grpc.Channel:
    """A secure channel when ``tls`` is given, else a plaintext one."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.credentials(), options=[*options, *tls.options()])


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: ServerTLS | None) -> int:
    """Bind ``address`` on a sync or aio gRPC server, with TLS when ``tls`` is given."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


@dataclass(frozen=True)
class ThrowawayCertificates:
    """A throwaway CA and what it signed (paths): a server certificate for localhost / 127.0.0.1 / ::1
    and a client certificate, for tests and ``bench/ingest.py --secure``."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server(self, *, mutual: bool = False) -> ServerTLS:
        return ServerTLS(self.server_cert, self.server_key, self.ca if mutual else None)

    def client(self, *, with_cert: bool = False) -> ClientTLS:
        return ClientTLS(self.ca, self.client_cert if with_cert else None, self.client_key if with_cert else None)


def make_test_certificates(directory: str | os.PathLike, days: int = 2) -> ThrowawayCertificates:
    """Make a CA and a server and a client certificate with the ``openssl`` command (EC P-256)."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        str(days),
        "-subj",
        "/CN=rollbook test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    for name, ext in (
        ("server", "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=rollbook test {name}")
        (d / f"{name}.ext").write_text(ext + "\n")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            str(days),
            "-extfile",
            f"{name}.ext",
        )
    for name in ("ca.key", "server.key", "client.key"):
        (d / name).chmod(0o600)
    return ThrowawayCertificates(
        str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key"), str(d / "client.pem"), str(d / "client.key")
    )
