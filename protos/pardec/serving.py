"""Server plumbing shared by the three services: start on an address (port 0 allowed),
report the bound address, map core errors to gRPC statuses, stop cleanly on a signal."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import Callable, Iterable

import grpc

from pardec.errors import PardecError

log = logging.getLogger(__name__)

# Model info carries the tokenizer (a few MB of JSON); requests carry long prompts.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def start_server(
    register: Iterable[Callable[[grpc.Server], None]], address: str, max_workers: int = 32
) -> tuple[grpc.Server, str]:
    """Starts a server with the given servicers on ``address`` and returns it with the
    address actually bound (``host:0`` picks a free port, read back from the socket)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS
    )
    for add in register:
        add(server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    server.start()
    host = address.rsplit(":", 1)[0]
    return server, f"{host}:{port}"


def write_ready_file(path: str | None, address: str) -> None:
    """Atomically writes the bound address, so a supervisor never reads half a line."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(address + "\n")
    os.replace(tmp, path)


def wait_for_termination(server: grpc.Server, grace_s: float = 10.0) -> None:
    """Blocks until SIGINT or SIGTERM, then stops accepting calls and lets in-flight ones
    finish for up to ``grace_s``."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down (grace %.0fs)", grace_s)
    server.stop(grace_s).wait()


def maps_errors(method):
    """Servicer-method decorator: a core ``PardecError`` becomes its gRPC status."""

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
