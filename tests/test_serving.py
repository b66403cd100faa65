"""runtime/serving.py's servers report the address a client dials: a TCP port 0 as the port
bound, a Unix socket as its own path."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pardec.runtime.serving import start_server


def test_a_unix_socket_server_reports_its_socket(tmp_path):
    for asked in (f"unix:{tmp_path / 'pardec.sock'}", "127.0.0.1:0"):
        server, address = start_server([], asked)
        try:
            assert address == asked if asked.startswith("unix:") else address.rsplit(":", 1)[1] != "0"
            with grpc.insecure_channel(address) as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            server.stop(None)


def test_a_port_taken_is_a_one_line_configuration_error():
    """A service that cannot bind says so naming the flag and exits 2, as for any setting, not
    with a traceback (the drafter here; the verifier binds the same way)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        for flags, named in ((["--addr", busy], "--addr"), (["--addr", "127.0.0.1:0", "--metrics-addr", busy],
                                                              "--metrics-addr")):
            said = subprocess.run([sys.executable, "-m", "pardec.drafter", *flags, "--redis-url", "redis://127.0.0.1:1"],
                                  capture_output=True, text=True, timeout=120)
            assert said.returncode == 2 and f"configuration error: {named}: cannot listen on" in said.stderr
            assert "Traceback" not in said.stderr
