"""An ASGI app served by uvicorn on a thread of its own, beside a gRPC server in one process.

The socket is bound here, before uvicorn starts, so that port 0 works and the bound port can be
reported (ready files, tests); uvicorn skips its signal handlers off the main thread, so the
process's own SIGTERM handling (runtime/serving.py) stays in charge and stops this server.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

import uvicorn

from pardec.runtime.errors import ConfigError
from pardec.runtime.security import ServerTLS
from pardec.runtime.serving import is_loopback_address

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0


def bind(address: str) -> socket.socket:
    """A listening TCP socket on HOST:PORT (IPv6 hosts in brackets; port 0: any free port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--http-addr: {address!r} must be HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(1024)
    except OSError as error:
        raise ConfigError(f"--http-addr: cannot listen on {address}: {error.strerror or error}") from error
    listener.set_inheritable(True)
    return listener


class HttpServer:
    """Serves ``app`` on ``address`` (TLS with ``tls``; a client certificate required when it names
    a client CA) until ``stop``; ``address`` is then the bound HOST:PORT. Beyond
    ``max_connections`` connections at once, uvicorn answers 503. It bounds neither how slowly a
    client sends its headers nor idle keep-alive beyond its defaults: on an untrusted network,
    put a proxy in front (docs/http-api.md)."""

    def __init__(self, app, address: str, tls: ServerTLS | None = None, max_connections: int | None = None):
        listener = bind(address)
        host = address.rpartition(":")[0]
        self.address = f"{host}:{listener.getsockname()[1]}"
        if tls is None and not is_loopback_address(address):
            log.warning(
                "serving HTTP in plaintext on %s: any host that reaches it can call it (see --tls-cert)", address
            )
        tls_options = {}
        if tls is not None:
            tls_options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
            if tls.mutual:
                tls_options.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=10,
            server_header=False, limit_concurrency=max_connections, **tls_options,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [listener]}, name="http-front", daemon=True
        )
        self._listener = listener
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                listener.close()
                raise ConfigError(f"--http-addr: the HTTP server did not start on {self.address}")
            time.sleep(0.01)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stops accepting, lets requests in flight finish for up to ``grace_s``, then ends them."""
        # At least a moment: with none, uvicorn reports its (empty) task list as cut short.
        self._server.config.timeout_graceful_shutdown = max(0.5, grace_s)
        self._server.should_exit = True
        self._thread.join(grace_s + 5.0)
        self._listener.close()
