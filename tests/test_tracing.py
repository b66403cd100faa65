"""Request spans over OTLP (`--otlp-traces-endpoint`): a real collector on loopback (an OTLP/gRPC
TraceService server) receives one span per request from a gateway, in the trace its caller named
(gRPC metadata or an HTTP header), with what the request did, and the verifier's prefill span as
its child; a collector that does not answer costs no request."""

from __future__ import annotations

import doctest
import json
import threading
import time
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import start_gateway
from pardec.runtime.errors import ConfigError
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.runtime import tracing
from pardec.runtime.tracing import check_endpoint
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from pardec.verifier.service import VerifierServicer
from tests.openai_front import gateway_config

GRPC_TRACE, GRPC_PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
HTTP_TRACE, HTTP_PARENT = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """What an OpenTelemetry collector receives: (service name, span) pairs."""

    def __init__(self):
        self.spans, self._lock = [], threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
                self.spans += [(service, span) for scope in resource_spans.scope_spans for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def add_to(self, server: grpc.Server) -> None:
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)


def attributes(span) -> dict:
    values = {}
    for attribute in span.attributes:
        value = attribute.value
        values[attribute.key] = getattr(value, value.WhichOneof("value"))
    return values


@pytest.fixture()
def collector():
    collector = Collector()
    server, address = start_server([collector.add_to], "127.0.0.1:0")
    yield collector, address
    server.stop(None)


def test_each_request_is_a_span_in_its_callers_trace(stack, engine, collector):
    received, address = collector
    verifier_tracer = tracing.Tracer("pardec-verifier", address)
    verifier, verifier_address = start_server([VerifierServicer(engine, (), verifier_tracer).add_to], "127.0.0.1:0")
    running = start_gateway(GatewayConfig(verifier_target=verifier_address, drafter_target=stack.addresses["drafter"],
                                          otlp_traces_endpoint=address), "127.0.0.1:0", http_address="127.0.0.1:0")
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            gateway = gateway_pb2_grpc.GatewayStub(channel)
            traced = gateway.Generate(gateway_pb2.GenerateRequest(prompt="Count: one two three", max_new_tokens=24),
                                      metadata=(("traceparent", f"00-{GRPC_TRACE}-{GRPC_PARENT}-01"),
                                                ("x-request-id", "grpc-7")), timeout=120)
            untraced = gateway.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=4), timeout=120)
        body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}).encode()
        http = urllib.request.Request(f"http://{running.http_address}/v1/chat/completions", data=body, headers={
            "Content-Type": "application/json", "traceparent": f"00-{HTTP_TRACE}-{HTTP_PARENT}-01"})
        with urllib.request.urlopen(http, timeout=120) as response:
            chat = json.loads(response.read())
    finally:
        running.stop()  # sends what is queued
        verifier.stop(None)
        verifier_tracer.shutdown()
    prefills = [span for service, span in received.spans if service == "pardec-verifier"]
    spans = {span.trace_id.hex(): (service, span) for service, span in received.spans if service == "pardec-gateway"}
    assert len(spans) == 3 and len(prefills) == 3
    # Each prefill is a child of its request's span, in its trace.
    by_id = {span.span_id: span for _, span in spans.values()}
    for prefill in prefills:
        assert prefill.name == "prefill" and by_id[prefill.parent_span_id].trace_id == prefill.trace_id

    service, span = spans[GRPC_TRACE]
    assert span.name == "llm_request" and span.parent_span_id.hex() == GRPC_PARENT and span.kind == 2  # SERVER
    said = attributes(span)
    assert said["gen_ai.usage.completion_tokens"] == len(traced.token_ids)
    assert said["gen_ai.usage.prompt_tokens"] == traced.stats.prompt_tokens
    assert said["gen_ai.response.model"] == traced.model and said["gen_ai.request.max_tokens"] == 24
    assert said["gen_ai.request.id"] == "grpc-7"  # the caller's id for its request
    assert said["pardec.decoding_method"] == "memory_decoding" and said["pardec.steps"] == traced.stats.steps
    assert said["pardec.accepted_draft_tokens"] == traced.stats.accepted_draft_tokens
    assert 0 < said["gen_ai.latency.time_to_first_token"] <= said["gen_ai.latency.e2e"]
    assert span.end_time_unix_nano > span.start_time_unix_nano and span.status.code != 2  # not ERROR

    (prefill,) = [p for p in prefills if p.trace_id.hex() == GRPC_TRACE]
    assert attributes(prefill)["pardec.prompt_tokens"] == traced.stats.prompt_tokens
    assert attributes(prefill)["pardec.compute_ms"] > 0

    _, span = spans[HTTP_TRACE]
    assert span.parent_span_id.hex() == HTTP_PARENT
    assert attributes(span)["gen_ai.usage.completion_tokens"] == chat["usage"]["completion_tokens"]

    (_, alone), = [pair for trace, pair in spans.items() if trace not in (GRPC_TRACE, HTTP_TRACE)]
    assert not alone.parent_span_id and attributes(alone)["gen_ai.usage.completion_tokens"] == len(untraced.token_ids)
    assert len(attributes(alone)["gen_ai.request.id"]) == 32  # none given: a new one


def test_a_refused_request_is_an_error_span_saying_why(stack, collector):
    received, address = collector
    running = start_gateway(GatewayConfig(verifier_target=stack.addresses["verifier"],
                                          drafter_target=stack.addresses["drafter"], otlp_traces_endpoint=address),
                            "127.0.0.1:0")
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                gateway_pb2_grpc.GatewayStub(channel).Generate(
                    gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=10 ** 6),
                    metadata=(("traceparent", f"00-{GRPC_TRACE}-{GRPC_PARENT}-01"),), timeout=60)
    finally:
        running.stop()  # sends what is queued
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (span,) = [span for service, span in received.spans if service == "pardec-gateway"]
    assert span.trace_id.hex() == GRPC_TRACE and span.parent_span_id.hex() == GRPC_PARENT
    assert span.status.code == 2 and "max_new_tokens" in span.status.message  # ERROR, naming the field
    assert attributes(span)["error.type"] == "InvalidArgument"


def test_a_collector_that_does_not_answer_costs_no_request(stack):
    running = start_gateway(gateway_config(stack, otlp_traces_endpoint="127.0.0.1:1"), "127.0.0.1:0")
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=4), timeout=120)
        assert len(reply.token_ids) > 0
    finally:
        started = time.monotonic()
        running.stop()
        assert time.monotonic() - started < 20  # the exporter gives up within its own timeout


@pytest.mark.parametrize("endpoint", ["localhost", "ftp://collector:4317", "collector:port", "http://c:4317/v1/traces",
                                      "grpc://user@c:4317", "grpc://c:4317?x=1", "c:0"])
def test_an_endpoint_that_is_not_one_is_named(endpoint):
    with pytest.raises(ConfigError, match="otlp_traces_endpoint: .* must be HOST:PORT"):
        check_endpoint(endpoint)
    assert doctest.testmod(tracing).failed == 0
    for good, target in (("", ("", False)), ("127.0.0.1:4317", ("127.0.0.1:4317", False)),
                         ("grpc://collector:4317/", ("collector:4317", False)),
                         ("HTTPS://collector.example:443", ("collector.example:443", True))):
        assert check_endpoint(good) == target


def test_the_callers_trace_is_read_as_w3c_says(collector):
    """Two traceparents: none is the parent; tracestate headers are joined; a caller that says
    "not sampled" gets no span."""
    received, address = collector
    tracer = tracing.Tracer("t", address)
    parent = f"00-{GRPC_TRACE}-{GRPC_PARENT}-01"
    tracer.request(tracing.trace_of([("traceparent", parent), ("Traceparent", parent)])).end({})
    joined = tracer.request(tracing.trace_of([(b"traceparent", parent.encode()), (b"tracestate", b"a=1"),
                                              (b"tracestate", b"b=2")]))
    assert joined._span.get_span_context().trace_state.to_header() == "a=1,b=2"
    joined.end({"x": 1, "y": None})
    tracer.request((("traceparent", f"00-{HTTP_TRACE}-{HTTP_PARENT}-00"),)).end({})
    tracer.shutdown()
    (first, _), (second, _) = sorted(((s.parent_span_id.hex(), s.trace_id.hex()) for _, s in received.spans))
    assert len(received.spans) == 2 and first == "" and second == GRPC_PARENT
    assert [attributes(s) for _, s in received.spans if s.parent_span_id] == [{"x": 1}]
