"""gRPC servicer of the public API: converts messages and maps errors over the core."""

from __future__ import annotations

import grpc

from gateway.clients import Sampling
from gateway.generation import Generation, Generator, Request
from pardec.serving import maps_errors
from pardec.v1 import gateway_pb2, gateway_pb2_grpc


def request_from_proto(message: gateway_pb2.GenerateRequest) -> Request:
    params = message.sampling
    return Request(
        prompt=message.prompt,
        max_new_tokens=message.max_new_tokens,
        plain=message.decoding == gateway_pb2.DECODING_MODE_PLAIN,
        sampling=Sampling(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed if params.HasField("seed") else None,
            repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else None,
        ),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        n=message.n,
        best_of=message.best_of,
        use_beam_search=message.use_beam_search,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        stop=tuple(message.stop),
        session_id=message.session_id,
    )


def response_to_proto(generation: Generation) -> gateway_pb2.GenerateResponse:
    stats = generation.stats
    return gateway_pb2.GenerateResponse(
        text=generation.text,
        token_ids=generation.token_ids,
        finish_reason=generation.finish_reason,
        stats=gateway_pb2.DecodingStats(
            prompt_tokens=stats.prompt_tokens,
            steps=stats.steps,
            draft_tokens=stats.draft_tokens,
            accepted_draft_tokens=stats.accepted_draft_tokens,
            mean_accepted_length=stats.mean_accepted_length,
            decoding_method=stats.decoding_method,
            ttft_ms=stats.ttft_ms,
            total_ms=stats.total_ms,
            gateway_ms=stats.gateway_ms,
            drafter_ms=stats.drafter_ms,
            verifier_ms=stats.verifier_ms,
            verifier_compute_ms=stats.verifier_compute_ms,
        ),
    )


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, generator: Generator):
        self.generator = generator

    def add_to(self, server: grpc.Server) -> None:
        gateway_pb2_grpc.add_GatewayServicer_to_server(self, server)

    @maps_errors
    def Generate(self, request, context):
        return response_to_proto(self.generator.generate(request_from_proto(request)))
