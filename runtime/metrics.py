"""Prometheus plumbing every service can share: a registry per service, an HTTP endpoint on an
address (port 0 allowed, the bound address read back), and request counting by gRPC status.

A registry per service object (not prometheus_client's global one) lets several services, or
several instances in one test process, each export their own metrics without name clashes.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from pardec.runtime.errors import PardecError

# Seconds; spans a fast gRPC hop (about a millisecond) to a long generation (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def serve_metrics(registry: CollectorRegistry, address: str):
    """Serves ``registry`` at http://address/metrics; returns (server, "host:port" bound).
    Stop it with ``server.shutdown(); server.server_close()``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"metrics address must be HOST:PORT, got {address!r}")
    server, _thread = start_http_server(int(port), host.strip("[]"), registry=registry)
    return server, f"{host}:{server.server_port}"


class RequestMetrics:
    """``<prefix>_requests_total{method,status}`` and ``<prefix>_request_duration_seconds{method}``."""

    def __init__(self, registry: CollectorRegistry, prefix: str):
        self.requests = Counter(
            f"{prefix}_requests", "Requests handled, by RPC method and final gRPC status",
            ("method", "status"), registry=registry,
        )
        self.duration = Histogram(
            f"{prefix}_request_duration_seconds", "Wall time of handled requests, by RPC method",
            ("method",), buckets=LATENCY_BUCKETS, registry=registry,
        )

    def refused(self, method: str, status: grpc.StatusCode) -> None:
        """Counts a call answered before it reached the servicer (an authentication refusal)."""
        self.requests.labels(method, status.name).inc()

    @contextlib.contextmanager
    def track(self, method: str) -> Iterator[None]:
        """Counts the block as one request: OK, the status of a PardecError, CANCELLED for a
        closed stream (GeneratorExit), INTERNAL for anything else."""
        started = time.perf_counter()
        status = grpc.StatusCode.OK
        try:
            yield
        except PardecError as error:
            status = error.status
            raise
        except GeneratorExit:
            status = grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            status = grpc.StatusCode.INTERNAL
            raise
        finally:
            self.requests.labels(method, status.name).inc()
            self.duration.labels(method).observe(time.perf_counter() - started)


# Probes and tooling are not traffic: counting them would drown the RPCs that matter.
_UNCOUNTED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


class RequestMetricsInterceptor(grpc.ServerInterceptor):
    """Counts every unary and server-streaming RPC of a server into ``RequestMetrics`` by method
    and final status, so a service gets request metrics without touching its servicer."""

    def __init__(self, metrics: RequestMetrics):
        self._metrics = metrics

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        full_name = handler_call_details.method
        if handler is None or full_name.startswith(_UNCOUNTED_PREFIXES):
            return handler
        method = full_name.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._streaming(handler.unary_stream, method))
        return handler

    def _record(self, method: str, context, started: float, failed: bool) -> None:
        code = context.code()
        if code is None:
            code = grpc.StatusCode.INTERNAL if failed else grpc.StatusCode.OK
        self._metrics.requests.labels(method, code.name).inc()
        self._metrics.duration.labels(method).observe(time.perf_counter() - started)

    def _unary(self, behavior, method: str):
        def counted(request, context):
            started, failed = time.perf_counter(), True
            try:
                reply = behavior(request, context)
                failed = False
                return reply
            finally:
                self._record(method, context, started, failed)

        return counted

    def _streaming(self, behavior, method: str):
        def counted(request, context):
            started, failed = time.perf_counter(), True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                self._record(method, context, started, failed)

        return counted
