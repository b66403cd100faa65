"""The gateway keys every Propose by the session's committed length (prompt and every committed
token once the call's are in), so that a resent call records nothing twice (drafter/sessions.lua).
Through a real gateway, drafter and verifier on loopback; the drafter's requests are read by a
server interceptor on the way in."""

from __future__ import annotations

import grpc

from pardec.drafter.config import DrafterConfig
from pardec.drafter.service import DrafterServicer
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import serve as serve_gateway
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.prompts import CODE_PROMPTS


class Recorder(grpc.ServerInterceptor):
    """Keeps every request of the methods it is asked about, then lets the call go on."""

    def __init__(self, methods: tuple[str, ...]):
        self.methods, self.requests = methods, []

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        method = details.method.rsplit("/", 1)[-1]
        if handler is None or method not in self.methods or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        def recorded(request, context):
            self.requests.append((method, request))
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            recorded, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def test_every_propose_carries_the_length_the_session_reaches_with_it(stack, redis_server):
    recorder = Recorder(("StartSession", "Propose"))
    drafter, drafter_address = start_server(
        [DrafterServicer(DrafterConfig(redis_url=redis_server.url)).add_to], "127.0.0.1:0", interceptors=[recorder])
    gateway, gateway_address = serve_gateway(GatewayConfig(stack.addresses["verifier"], drafter_address), "127.0.0.1:0")
    try:
        with grpc.insecure_channel(gateway_address, options=CHANNEL_OPTIONS) as channel:
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(prompt=CODE_PROMPTS[0], max_new_tokens=48), timeout=300)
    finally:
        gateway.stop(None)
        drafter.stop(None)
    assert reply.stats.draft_tokens > 0
    starts = [request for method, request in recorder.requests if method == "StartSession"]
    proposes = [request for method, request in recorder.requests if method == "Propose"]
    assert len(starts) == 1 and proposes
    held = len(starts[0].prompt_token_ids)
    for propose in proposes:  # one session, each call answered: the lengths chain exactly
        assert propose.HasField("committed_length")
        held += len(propose.new_token_ids)
        assert propose.committed_length == held
    assert held <= len(starts[0].prompt_token_ids) + len(reply.token_ids)
