"""What the security tests share: a throwaway PKI made with the openssl CLI at test time, the
tenants' tokens, and one drafter call that says which status refused it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc

from pardec.runtime.security import ClientTLS, open_channel
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import drafter_pb2, drafter_pb2_grpc

TOKEN_A = "token-of-tenant-a-0123456789"
TOKEN_B = "token-of-tenant-b-9876543210"
TOKEN_C = "token-of-tenant-c-5555555555"  # only the shared-memory test uses it
PROMPT = "Write a Python function that reverses a string."


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str  # CN=localhost, SAN 127.0.0.1 + localhost, serverAuth + clientAuth
    server_key: str
    client_a_cert: str  # CN=tenant-a
    client_a_key: str
    client_b_cert: str  # CN=tenant-b
    client_b_key: str
    other_ca: str  # an unrelated CA ...
    rogue_cert: str  # ... and a client certificate it signed (CN=tenant-a)
    rogue_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)


def _make_cert(directory: Path, ca: str, name: str, common_name: str) -> None:
    ext = directory / f"{name}.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={common_name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", ext.name, "-out", f"{name}.pem", cwd=directory)


def make_pki(directory: Path) -> Pki:
    """A CA, a server certificate and two tenants' client certificates; another CA and a rogue
    client certificate it signed."""
    _make_ca(directory, "ca")
    _make_ca(directory, "other-ca")
    _make_cert(directory, "ca", "server", "localhost")
    _make_cert(directory, "ca", "client-a", "tenant-a")
    _make_cert(directory, "ca", "client-b", "tenant-b")
    _make_cert(directory, "other-ca", "rogue", "tenant-a")
    path = lambda name: str(directory / name)  # noqa: E731
    return Pki(
        path("ca.pem"), path("server.pem"), path("server.key"), path("client-a.pem"), path("client-a.key"),
        path("client-b.pem"), path("client-b.key"), path("other-ca.pem"), path("rogue.pem"), path("rogue.key"),
    )


def start_and_end(address: str, tls: ClientTLS | None) -> grpc.StatusCode:
    """One StartSession + EndSession; OK or the status that refused it."""
    with open_channel(address, tls, CHANNEL_OPTIONS) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        try:
            stub.StartSession(drafter_pb2.StartSessionRequest(session_id="tls-probe", prompt_token_ids=[1, 2, 3]),
                              timeout=10)
            stub.EndSession(drafter_pb2.EndSessionRequest(session_id="tls-probe"), timeout=10)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK
