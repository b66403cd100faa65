"""Request spans exported over OTLP, as vLLM's ``--otlp-traces-endpoint`` exports them.

With an endpoint, the gateway sends one span per generated sequence ("llm_request", kind SERVER)
to an OpenTelemetry collector (Jaeger, Tempo, the OpenTelemetry Collector) over OTLP/gRPC: when
it started and ended, its caller's trace (a W3C ``traceparent`` / ``tracestate`` the HTTP request
or gRPC call carried, so the span joins the client's trace), what was asked and what it cost,
under OpenTelemetry's gen_ai names where they exist and pardec's own for parallel decoding:

    gen_ai.response.model, gen_ai.request.max_tokens, gen_ai.request.temperature,
    gen_ai.request.top_p, gen_ai.usage.prompt_tokens, gen_ai.usage.completion_tokens,
    gen_ai.latency.time_to_first_token, gen_ai.latency.e2e (seconds),
    pardec.decoding_method, pardec.steps, pardec.draft_tokens, pardec.accepted_draft_tokens,
    pardec.mean_accepted_length, pardec.cached_prompt_tokens, pardec.verifier_ms, pardec.drafter_ms

A verifier with an endpoint sends a "prefill" span per Prefill call, a child of the request's
span, which the gateway's client puts in the call's metadata (RequestSpan.current, outgoing).
A request that fails ends its span with status ERROR and the error's class and message. Spans
leave in batches from a thread of their own; an unreachable collector costs log lines, never a
request. Without an endpoint nothing here is imported and a request pays nothing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from urllib.parse import urlsplit

from pardec.runtime.errors import ConfigError

# The W3C Trace Context headers (and gRPC metadata keys) a caller's trace arrives in, and the id
# a caller may give its request (as proxies and vLLM read it), which its log line and span carry.
TRACE_HEADERS = ("traceparent", "tracestate")
REQUEST_ID = "x-request-id"
MAX_REQUEST_ID = 256
SPAN_NAME = "llm_request"  # vLLM's name for the same span
SCHEMES = ("grpc", "http", "https")
EXPORT_TIMEOUT_S = 5  # one batch's export, retries included; and the most a shutdown waits

Trace = tuple[tuple[str, str], ...]  # a caller's trace headers (and request id), as received


def check_endpoint(endpoint: str) -> tuple[str, bool]:
    """"" (off), HOST:PORT, or a URL: grpc:// or http:// (plaintext), https:// (TLS). Returns the
    gRPC target (HOST:PORT, an IPv6 host in brackets) and whether it is TLS; ("", False) when off.

    >>> check_endpoint("grpc://Collector:4317/"), check_endpoint("HTTPS://[::1]:443")
    (('collector:4317', False), ('[::1]:443', True))
    """
    if not endpoint:
        return "", False
    parts = urlsplit(endpoint if "://" in endpoint else f"grpc://{endpoint}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if (parts.scheme not in SCHEMES or not parts.hostname or not port or parts.path not in ("", "/")
            or parts.username is not None or parts.query or parts.fragment):
        raise ConfigError(f"otlp_traces_endpoint: {endpoint[:200]!r} must be HOST:PORT or grpc://, http:// or "
                          "https://HOST:PORT (OTLP over gRPC)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{host}:{port}", parts.scheme == "https"


def trace_of(pairs: Iterable[tuple]) -> Trace:
    """The trace headers and request id among ``pairs`` (gRPC metadata, or ASGI headers as bytes)."""
    found = []
    for key, value in pairs:
        key = key.decode("latin-1") if isinstance(key, bytes) else str(key)
        if key.lower() in TRACE_HEADERS or key.lower() == REQUEST_ID:
            found.append((key.lower(), value.decode("latin-1") if isinstance(value, bytes) else str(value)))
    return tuple(found)


def request_id_of(trace: Trace) -> str:
    """The id a caller gave its request, if it is one line of at most MAX_REQUEST_ID visible
    ASCII characters; else "".

    >>> request_id_of((("traceparent", "00-ab-cd-01"), ("x-request-id", "job-7/step-3")))
    'job-7/step-3'
    >>> request_id_of((("x-request-id", "a b"),))
    ''
    """
    for key, value in trace:
        if key == REQUEST_ID and 0 < len(value) <= MAX_REQUEST_ID and all("!" <= c <= "~" for c in value):
            return value
    return ""


# The trace an internal call carries on (as gRPC metadata): the span of the request making it,
# set around the call in the thread that makes it (RequestSpan.current).
_OUTGOING: ContextVar[Trace] = ContextVar("pardec_outgoing_trace", default=())


def outgoing() -> Trace:
    """The trace headers for an internal call made now: the current request span's, or none."""
    return _OUTGOING.get()


class RequestSpan:
    """One sequence's span; `end` closes it (once) with what the request did."""

    def __init__(self, span=None):
        self._span = span

    @contextmanager
    def current(self) -> Iterator[None]:
        """Internal calls made in this block (this thread) carry this span as their parent."""
        if self._span is None:
            yield
            return
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(self._span))
        token = _OUTGOING.set(tuple(carrier.items()))
        try:
            yield
        finally:
            _OUTGOING.reset(token)

    def end(self, attributes: Mapping[str, object], error: BaseException | None = None,
            ended_ns: int | None = None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attributes({key: value for key, value in attributes.items() if value is not None})
        if error is not None:  # the semantic conventions' error.type: the class of error
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {str(error)[:200]}"))
        span.end(end_time=ended_ns)


class Tracer:
    """Spans of one service, sent to ``endpoint`` (check_endpoint) by a batch exporter."""

    def __init__(self, service_name: str, endpoint: str):
        target, secure = check_endpoint(endpoint)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # A provider of its own, not the process-wide one: two gateways in a process stay apart.
        resource = Resource.create({"service.name": service_name,
                                    "service.instance.id": f"{socket.gethostname()}:{os.getpid()}"})
        self._provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=target, insecure=not secure, timeout=EXPORT_TIMEOUT_S)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pardec")
        self._propagator = TraceContextTextMapPropagator()

    def request(self, trace: Trace, started_ns: int | None = None, name: str = SPAN_NAME) -> RequestSpan:
        """A span begun at ``started_ns`` (time.time_ns(); default now) in the caller's trace, if any."""
        from opentelemetry.trace import SpanKind

        parents = [value for key, value in trace if key == "traceparent"]
        # One traceparent or none (several: no parent, as W3C says); tracestate headers joined.
        parent = None
        if len(parents) == 1:
            states = ",".join(value for key, value in trace if key == "tracestate")
            parent = self._propagator.extract({"traceparent": parents[0], "tracestate": states})
        return RequestSpan(self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER,
                                                   start_time=started_ns or time.time_ns()))

    def shutdown(self) -> None:
        """Sends what is queued and stops the exporter's thread, waiting at most EXPORT_TIMEOUT_S:
        the SDK's own shutdown may wait 30 s for a collector that does not answer."""
        closing = threading.Thread(target=self._provider.shutdown, name="trace-shutdown", daemon=True)
        closing.start()
        closing.join(EXPORT_TIMEOUT_S)


NO_SPAN = RequestSpan()
