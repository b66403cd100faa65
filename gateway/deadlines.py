"""A request's deadline and cancel, which every internal call it makes inherits (and its caller's trace).

A client's deadline and cancel belong to the whole request, not to its public call alone: each
internal call (prefill, verify, propose, the wait for a drafting session's start) gets
min(its own timeout, the time the request has left), and a cancel also cancels the internal
call in flight, so that the verifier and the drafter stop working for a client that is gone and
the request's sessions are released at once. The generation core takes a `Deadline` for unary
and streamed requests alike, so every public front end inherits this by passing one.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator

import grpc

from pardec.runtime.errors import PardecError, Unavailable
from pardec.runtime.tracing import Trace, request_id_of


class DeadlineExceeded(PardecError):
    """The request's own deadline passed: the client has stopped waiting."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(PardecError):
    """The client cancelled the request."""

    status = grpc.StatusCode.CANCELLED


class TimedOut(Unavailable):
    """An internal call got no answer within its own timeout (the service is slow or hung); a
    request whose deadline is what cut the call short gets DeadlineExceeded instead."""


class Deadline:
    """An absolute ``time.monotonic()`` deadline (None: none) and a cancel signal, and the caller's
    trace (its W3C trace headers, runtime/tracing.py), which the request's span joins, and the
    request's id (the caller's X-Request-Id, else a new one), which its log line and span say."""

    def __init__(self, at: float | None = None, trace: Trace = ()):
        self.at = at
        self.trace = trace
        self.request_id = request_id_of(trace) or uuid.uuid4().hex
        self.reported = False  # whether a report of the request (its span, its log line) has begun
        self.arrived_ns = time.time_ns()  # when the request arrived: where its span begins
        self._lock = threading.Lock()
        self._cancelled = False
        self._on_cancel: dict[object, Callable[[], object]] = {}

    @classmethod
    def after(cls, seconds: float | None, trace: Trace = ()) -> "Deadline":
        return cls(None if seconds is None else time.monotonic() + seconds, trace)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Marks the request cancelled and cancels every internal call it has in flight."""
        with self._lock:
            self._cancelled = True
            hooks, self._on_cancel = list(self._on_cancel.values()), {}
        for hook in hooks:
            hook()

    def left(self) -> float | None:
        """Seconds left (None: no deadline); negative once it passed."""
        return None if self.at is None else self.at - time.monotonic()

    @property
    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def check(self) -> None:
        """Raises Cancelled or DeadlineExceeded when the request should stop now."""
        if self._cancelled:
            raise Cancelled("the client cancelled the request")
        if self.expired:
            raise DeadlineExceeded("the request's deadline passed before it finished")

    def timeout(self, own_s: float) -> float:
        """An internal call's timeout: its own, cut to the time left; raises if none is left."""
        self.check()
        left = self.left()
        return own_s if left is None else min(own_s, left)

    def failed(self, error: PardecError) -> PardecError:
        """What an internal call's failure means for the request: Cancelled or DeadlineExceeded
        when the request's own cancel or deadline cut the call short, else ``error`` itself."""
        if self._cancelled:
            return Cancelled(f"the client cancelled the request ({error})")
        if self.expired:
            return DeadlineExceeded(f"the request's deadline passed ({error})")
        return error

    @contextmanager
    def cancelling(self, future) -> Iterator[None]:
        """While the block runs, a cancel of the request also cancels ``future`` (a call in flight)."""
        key = object()
        with self._lock:
            cancelled = self._cancelled
            if not cancelled:
                self._on_cancel[key] = future.cancel
        if cancelled:
            future.cancel()
        try:
            yield
        finally:
            with self._lock:
                self._on_cancel.pop(key, None)


def timeout_for(deadline: Deadline | None, own_s: float) -> float:
    """``own_s`` cut to what ``deadline`` leaves (no deadline: ``own_s``)."""
    return own_s if deadline is None else deadline.timeout(own_s)


def close_when_idle(stream: Iterator, retry_s: float = 0.05) -> None:
    """Closes a request's stream, which releases its sessions at once if it is parked between
    steps; a stream running a step now ("generator already executing") is closed as soon as the
    step returns (a cancelled Deadline makes that soon)."""
    try:
        stream.close()
    except ValueError:
        timer = threading.Timer(retry_s, close_when_idle, (stream, retry_s))
        timer.daemon = True
        timer.start()
