"""Bounds every server puts on its callers: how many calls it runs at once and how large a
message it reads.

- Concurrency: at most ``max_concurrent_rpcs`` calls run at once; one more is refused at once
  with RESOURCE_EXHAUSTED, where gRPC Python would queue it without bound behind calls that may
  each run for minutes. Health checking and reflection are not counted, and the thread pool
  keeps RESERVED_WORKERS threads beyond the limit, so a probe (or a refusal) always finds a
  thread however many generations hold the others: a busy service is not reported dead.
- Message size: the public port reads at most PUBLIC_MAX_MESSAGE_BYTES (``--max-message-bytes``)
  per request; gRPC refuses a larger one RESOURCE_EXHAUSTED, naming the limit, before anything
  parses it. Internal services keep MAX_MESSAGE_BYTES (the verifier's model info carries the
  tokenizer).
"""

from __future__ import annotations

import argparse
import contextlib
import threading
from typing import Callable, Iterator

import grpc

from pardec.runtime.errors import ConfigError
from pardec.runtime.guards import guard_handler
from pardec.runtime.security import is_open

# Model info carries the tokenizer (a few MB of JSON); requests carry long prompts.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A public request is a prompt and a few settings: 1 MiB is about 250,000 tokens of text.
PUBLIC_MAX_MESSAGE_BYTES = 1024 * 1024
# The gateway holds a thread per generation; the verifier and drafters take one call per
# session step from every gateway, so they are sized for several gateways at once.
DEFAULT_MAX_CONCURRENT_RPCS = {"gateway": 64, "drafter": 256, "verifier": 256}
# Threads beyond the limit: health checks, reflection and the refusals of calls over the limit.
RESERVED_WORKERS = 8


def add_limit_flags(parser: argparse.ArgumentParser, service: str, public: bool = False) -> None:
    """--max-concurrent-rpcs on every service; --max-message-bytes on the public one."""
    parser.add_argument(
        "--max-concurrent-rpcs", type=int, default=DEFAULT_MAX_CONCURRENT_RPCS[service],
        help="calls served at once; more are refused RESOURCE_EXHAUSTED (health checks are not counted)",
    )  # fmt: skip
    if public:
        parser.add_argument(
            "--max-message-bytes", type=int, default=PUBLIC_MAX_MESSAGE_BYTES,
            help="largest request accepted, in bytes; larger ones are refused RESOURCE_EXHAUSTED",
        )  # fmt: skip


def check_limits(max_concurrent_rpcs: int, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
    if max_concurrent_rpcs < 1:
        raise ConfigError(f"max_concurrent_rpcs: must be >= 1, got {max_concurrent_rpcs}")
    if not 1024 <= max_message_bytes <= MAX_MESSAGE_BYTES:
        raise ConfigError(f"max_message_bytes: must be in [1024, {MAX_MESSAGE_BYTES}], got {max_message_bytes}")


class ConcurrencyLimit(grpc.ServerInterceptor):
    """Refuses a call RESOURCE_EXHAUSTED while ``limit`` others run (see the module docstring).
    ``on_refused(method)`` hears of each refusal, for services that count requests themselves."""

    def __init__(self, limit: int, what: str = "server", on_refused: Callable[[str], None] = lambda method: None):
        check_limits(limit)
        self.limit = limit
        self._what = what
        self._on_refused = on_refused
        self._lock = threading.Lock()
        self._active = 0

    @property
    def active(self) -> int:
        return self._active

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if is_open(handler_call_details.method):
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        return guard_handler(handler, lambda context: self._slot(context, method))

    def enter(self, method: str, count_refusal: bool = True) -> str | None:
        """Takes a slot (then the caller must ``leave``) and returns None; or, with every slot
        taken, counts the refusal (unless the caller counts its requests itself) and returns the
        message to refuse ``method`` with. Other front ends of the same server (an HTTP API) take
        the same slots."""
        with self._lock:
            admitted = self._active < self.limit
            self._active += admitted
        if admitted:
            return None
        if count_refusal:
            self._on_refused(method)
        return (
            f"{method}: the {self._what} is serving {self.limit} calls, the most it takes at once "
            "(--max-concurrent-rpcs); retry later"
        )

    def leave(self) -> None:
        with self._lock:
            self._active -= 1

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext, method: str) -> Iterator[None]:
        refusal = self.enter(method)
        if refusal is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        try:
            yield
        finally:
            self.leave()
