"""Server plumbing shared by the three services: start on an address (port 0 allowed),
report the bound address, grpc.health.v1 and server reflection on every server (grpcurl and
Kubernetes gRPC probes work), map core errors to gRPC statuses, stop cleanly on a signal."""

from __future__ import annotations

import argparse
import functools
import inspect
import ipaddress
import logging
import os
import signal
import threading
import weakref
from concurrent import futures
from pathlib import Path
from typing import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pardec.runtime.errors import ConfigError, PardecError
from pardec.runtime.limits import MAX_MESSAGE_BYTES, RESERVED_WORKERS, ConcurrencyLimit, check_limits
from pardec.runtime.security import ServerTLS

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)

# Calls in flight on a connection past its age keep it this long: as long as the gateway's longest
# drafter deadline (StartSession, EndSession), so that closing a connection never cuts a call short.
CONNECTION_AGE_GRACE_S = 10.0

# Each started server's health servicer, so that shutdown can report NOT_SERVING first.
_HEALTH: "weakref.WeakKeyDictionary[grpc.Server, tuple[health.HealthServicer, tuple[str, ...]]]" = (
    weakref.WeakKeyDictionary())


class _Recorder:
    """Stands in for the server while servicers register, to learn their service names (the
    generated ``add_*_to_server`` functions name them) for health and reflection."""

    def __init__(self, server: grpc.Server):
        self._server = server
        self.names: list[str] = []

    def add_registered_method_handlers(self, service_name, method_handlers):
        self.names.append(service_name)
        self._server.add_registered_method_handlers(service_name, method_handlers)

    def add_generic_rpc_handlers(self, handlers):
        for handler in handlers:
            name = getattr(handler, "service_name", lambda: None)()
            if name and name not in self.names:
                self.names.append(name)
        self._server.add_generic_rpc_handlers(handlers)

    def __getattr__(self, name):
        return getattr(self._server, name)


def start_server(
    register: Iterable[Callable[[grpc.Server], None]],
    address: str,
    tls: ServerTLS | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_concurrent_rpcs: int = 64,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    on_busy: Callable[[str], None] = lambda method: None,
    what: str = "server",
    limit: ConcurrencyLimit | None = None,
    max_connection_age_s: float = 0.0,
) -> tuple[grpc.Server, str]:
    """Starts a server with the given servicers on ``address`` and returns it with the
    address actually bound (``host:0`` picks a free port, read back from the socket).
    Every server also answers grpc.health.v1 (SERVING for "" and each service) and reflection.
    With ``tls`` the port speaks only TLS (mutual TLS when it names a client CA).
    At most ``max_concurrent_rpcs`` calls run at once (more: RESOURCE_EXHAUSTED, told to
    ``on_busy(method)``), requests over ``max_message_bytes`` are refused (runtime/limits.py).
    ``limit``, when given, is that bound shared with another front end of the same service.
    ``max_connection_age_s`` (0: never) closes each client connection after about that long (see
    ``add_connection_age_flag``)."""
    check_limits(max_concurrent_rpcs, max_message_bytes)
    limit = limit or ConcurrencyLimit(max_concurrent_rpcs, what, on_busy)
    options = (
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_message_bytes),
    )
    if max_connection_age_s > 0:
        options += (
            ("grpc.max_connection_age_ms", round(max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", round(CONNECTION_AGE_GRACE_S * 1000)),
        )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_concurrent_rpcs + RESERVED_WORKERS), options=options,
        # Inside the caller's interceptors: authentication refuses before a slot is taken, and a
        # service's request metrics count the calls the limit refuses.
        interceptors=(*interceptors, limit),
        # A backstop on what gRPC queues: the limit's own refusals come first, with a clearer message.
        maximum_concurrent_rpcs=2 * max_concurrent_rpcs + RESERVED_WORKERS,
    )
    recorder = _Recorder(server)
    for add in register:
        add(recorder)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = [*recorder.names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(services, server)
    if tls is None:
        port = server.add_insecure_port(address)
        if not is_loopback_address(address):
            log.warning("serving plaintext on %s: any host that reaches it can call it (see --tls-cert)", address)
    else:
        port = server.add_secure_port(address, tls.credentials())
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    server.start()
    for name in ("", *recorder.names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _HEALTH[server] = (health_servicer, ("", *recorder.names))
    if address.startswith("unix:"):  # a socket's path is its address (the port grpc returns is 1)
        return server, address
    host = address.rsplit(":", 1)[0]
    return server, f"{host}:{port}"


def listening(flag: str, address: str, start):
    """``start()``, which binds ``address``: a bind that fails (taken, malformed) is a ConfigError
    naming ``flag``, so that a service says it in one line and exits 2 as for any setting."""
    try:
        return start()
    except ConfigError:
        raise
    except (RuntimeError, OSError, ValueError) as error:
        raise ConfigError(f"{flag}: cannot listen on {address!r} ({error})") from None


def add_connection_age_flag(parser: argparse.ArgumentParser, default_s: float) -> None:
    """--max-connection-age-s. A gRPC client keeps the connections it opened first: one that
    resolves a DNS name (dns:///drafter:50052, a headless Service) learns of replicas added later
    only when it resolves again, which it does when a connection closes. Closing each connection
    after an age (a GOAWAY: calls in flight finish, new ones go to the client's other connections
    while it reconnects) makes it re-resolve, so added replicas take their share of calls."""

    def seconds(text: str) -> float:
        value = float(text)
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"must be >= 0 (0 = never), got {text}")
        return value

    parser.add_argument(
        "--max-connection-age-s", type=seconds, default=default_s,
        help="close each client connection after about this long (calls in flight finish) so that clients "
             "resolving a DNS name re-resolve it and spread over replicas added since; 0 = never",
    )  # fmt: skip


def is_loopback_address(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if address.startswith("unix:") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def write_ready_file(path: str | None, address: str) -> None:
    """Atomically writes the bound address, so a supervisor never reads half a line."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(address + "\n")
    os.replace(tmp, path)


def set_serving(server: grpc.Server, serving: bool) -> None:
    """Reports every service of ``server`` SERVING or NOT_SERVING (a gateway none of whose
    verifiers answers: gateway/backend_health.py); a server shutting down stays NOT_SERVING."""
    found = _HEALTH.get(server)
    if found is not None:
        servicer, names = found
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in names:
            servicer.set(name, status)


def stop_gracefully(server: grpc.Server, grace_s: float = 10.0) -> None:
    """Reports NOT_SERVING (load balancers stop sending), refuses new calls, and lets in-flight
    ones finish for up to ``grace_s`` before cancelling them."""
    found = _HEALTH.get(server)
    if found is not None:
        found[0].enter_graceful_shutdown()
    server.stop(grace_s).wait()


def wait_for_termination(
    server: grpc.Server, grace_s: float = 10.0, also_stop: Callable[[float], None] | None = None
) -> None:
    """Blocks until SIGINT or SIGTERM, then stops gracefully (see ``stop_gracefully``);
    ``also_stop(grace_s)``, another front end of the process, drains at the same time."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down (grace %.0fs)", grace_s)
    other = threading.Thread(target=also_stop, args=(grace_s,), daemon=True) if also_stop else None
    if other is not None:
        other.start()
    stop_gracefully(server, grace_s)
    if other is not None:
        other.join(grace_s + 5.0)


def maps_errors(method):
    """Servicer-method decorator: a core ``PardecError`` becomes its gRPC status. Works for
    unary methods and for server-streaming ones written as generators."""

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            try:
                yield from method(self, request, context)
            except PardecError as error:
                context.abort(error.status, str(error))

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except PardecError as error:
            context.abort(error.status, str(error))

    return wrapper


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
