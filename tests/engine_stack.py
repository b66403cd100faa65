"""One verifier setting through the real stack: an engine built from its own VerifierConfig, served
behind a drafter and a gateway on loopback, and the check every numerics setting must pass (parallel
decoding gives plain decoding's tokens)."""

from __future__ import annotations

from contextlib import contextmanager

import grpc

from pardec.drafter.config import DrafterConfig
from pardec.drafter.service import DrafterServicer
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import serve as serve_gateway
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc
from pardec.verifier.config import VerifierConfig
from pardec.verifier.server import build_engine
from pardec.verifier.service import VerifierServicer

PROMPTS = ("Write a Python function that checks whether a string is a palindrome.",
           "Repeat after me: red, green, blue, red, green, blue, red, green, blue.")


@contextmanager
def engine_stack(config: VerifierConfig, redis_url: str):
    """(engine, verifier stub, gateway stub) of ``config``'s engine behind a drafter and a gateway."""
    engine = build_engine(config)
    servers = [start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")]
    servers.append(start_server([DrafterServicer(DrafterConfig(redis_url=redis_url)).add_to], "127.0.0.1:0"))
    # A drafter late under a loaded machine's scheduling must not turn the parallel run into plain
    # steps (the check below wants drafted tokens verified): its per-step deadline is generous here.
    servers.append(serve_gateway(GatewayConfig(verifier_target=servers[0][1], drafter_target=servers[1][1],
                                               propose_timeout_s=30.0), "127.0.0.1:0"))
    channels = [grpc.insecure_channel(servers[i][1], options=CHANNEL_OPTIONS) for i in (0, 2)]
    try:
        yield engine, verifier_pb2_grpc.VerifierStub(channels[0]), gateway_pb2_grpc.GatewayStub(channels[1])
    finally:
        for channel in channels:
            channel.close()
        for server, _ in reversed(servers):
            server.stop(None)
        engine.close()


def assert_parallel_is_plain(gateway, prompts=PROMPTS, max_new_tokens: int = 96) -> None:
    """Each prompt decoded plain and in parallel: the same tokens, and drafted tokens were verified
    (not only plain steps)."""
    accepted = 0
    for prompt in prompts:
        plain, parallel = [
            gateway.Generate(gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, decoding=mode),
                             timeout=300)
            for mode in (gateway_pb2.DECODING_MODE_PLAIN, gateway_pb2.DECODING_MODE_DEFAULT)]
        assert list(parallel.token_ids) == list(plain.token_ids) and len(plain.token_ids) > 16
        assert parallel.stats.decoding_method == "memory_decoding"
        accepted += parallel.stats.accepted_draft_tokens
    assert accepted > 0
