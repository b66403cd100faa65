"""What the fuzz tests share (test_fuzz_public.py, test_fuzz_internal.py): hypothesis settings,
calls that return a status instead of raising, status checks, and hand-built wire messages,
which no protobuf client would send."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings

from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import drafter_pb2, gateway_pb2, verifier_pb2
from tests.prompts import CODE_PROMPTS

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
TIMEOUT_S = 120
BYSTANDER_PROMPT = CODE_PROMPTS[0]
BYSTANDER_TOKENS = 16


def call(method, request):
    """(status, reply or details) of a unary call or of a whole stream."""
    try:
        reply = method(request, timeout=TIMEOUT_S)
        return grpc.StatusCode.OK, list(reply) if hasattr(reply, "__next__") else reply
    except grpc.RpcError as error:
        return error.code(), error.details()


def assert_invalid(code, details, fields):
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, fields)
    assert any(name in details for name in fields), (details, fields)


def assert_serving(stack):
    for address in stack.addresses.values():
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, address


# ---- raw wire messages ------------------------------------------------------------------------


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def raw_method(address: str, path: str, response_class, streaming: bool):
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(path, request_serializer=lambda data: data, response_deserializer=response_class.FromString)


def assert_unparseable_is_invalid(stack, service: str, method: str, message: bytes, field_name: str):
    """A message that does not parse gets INVALID_ARGUMENT naming the broken field (gRPC's own
    answer would be INTERNAL)."""
    response = {"gateway": gateway_pb2.GenerateResponse, "verifier": verifier_pb2.VerifyResponse,
                "drafter": drafter_pb2.EndSessionResponse}[service]
    code, details = call(raw_method(stack.addresses[service], f"/pardec.v1.{method}", response, False), message)
    assert_invalid(code, details, {field_name})
