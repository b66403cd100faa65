"""Faults through the real process stack (`pardec up`'s topology): nothing is lost and the
output is exactly what plain decoding gives."""

from __future__ import annotations

import signal
import urllib.request

import grpc
import pytest

from pardec.gateway.mindie import MindieSettings
from pardec.gateway.stack import Stack
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.prompts import CODE_PROMPTS

MAX_NEW_TOKENS = 80


@pytest.fixture(scope="module")
def three_drafters(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("faults"), MindieSettings(), gateway_addr="127.0.0.1:0", drafters=3,
                  log_level="WARNING").start()
    channel = grpc.insecure_channel(stack.gateway_address, options=CHANNEL_OPTIONS)
    yield stack, gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    stack.stop()


def request(plain: bool = False) -> gateway_pb2.GenerateRequest:
    mode = gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT
    return gateway_pb2.GenerateRequest(prompt=CODE_PROMPTS[1], max_new_tokens=MAX_NEW_TOKENS, decoding=mode)


def stream_with_fault(stub, fault) -> tuple[list[int], gateway_pb2.DecodingStats]:
    """Streams one generation and injects ``fault`` after the first few steps."""
    tokens, stats, steps = [], None, 0
    for chunk in stub.GenerateStream(request(), timeout=600):
        tokens.extend(chunk.token_ids)
        steps += 1
        if steps == 4:
            fault()
        if chunk.HasField("stats"):
            stats = chunk.stats
    return tokens, stats


def test_killing_a_drafter_replica_mid_generation_loses_nothing(three_drafters):
    stack, stub = three_drafters
    plain = list(stub.Generate(request(plain=True), timeout=600).token_ids)
    victim = stack.process("drafter-1")
    tokens, stats = stream_with_fault(stub, lambda: victim.send_signal(signal.SIGKILL))
    assert victim.wait(10) == -signal.SIGKILL
    assert tokens == plain
    # The surviving replicas kept drafting: trees were verified. (How many nodes a step verifies,
    # and so whether any is accepted, is the sizer's call from this machine's measured costs; on a
    # busy 2-core AVX2 host it verified 3 nodes in 52 steps, none accepted.)
    assert stats.draft_tokens > 0
    # Later requests are served by the survivors, drafts included.
    again = stub.Generate(request(), timeout=600)
    assert list(again.token_ids) == plain and again.stats.draft_tokens > 0


def test_restarting_redis_mid_generation_loses_nothing(three_drafters):
    stack, stub = three_drafters
    plain = list(stub.Generate(request(plain=True), timeout=600).token_ids)
    tokens, _ = stream_with_fault(stub, stack.redis.restart)
    assert tokens == plain
    # Drafting resumes once Redis is back (a fresh Redis: sessions start over).
    again = stub.Generate(request(), timeout=600)
    assert list(again.token_ids) == plain and again.stats.accepted_draft_tokens > 0


@pytest.fixture(scope="module")
def two_verifiers(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("verifiers"), MindieSettings(), gateway_addr="127.0.0.1:0", verifiers=2,
                  metrics_addr="127.0.0.1:0", log_level="WARNING").start()
    channel = grpc.insecure_channel(stack.gateway_address, options=CHANNEL_OPTIONS)
    yield stack, gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    stack.stop()


def _failovers(stack) -> float:
    text = urllib.request.urlopen(f"http://{stack.addresses['gateway-metrics']}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pardec_verifier_failovers_total{"))


def test_killing_the_verifier_serving_a_session_resumes_it_on_another(two_verifiers):
    stack, stub = two_verifiers
    plain = list(stub.Generate(request(plain=True), timeout=600).token_ids)
    # An idle gateway places a new session on the first replica (least sessions, then order).
    victim = stack.process("verifier")
    tokens, stats = stream_with_fault(stub, lambda: victim.send_signal(signal.SIGKILL))
    assert victim.wait(10) == -signal.SIGKILL
    assert tokens == plain
    assert _failovers(stack) >= 1
    # New sessions go to the survivor, drafting included.
    again = stub.Generate(request(), timeout=600)
    assert list(again.token_ids) == plain and again.stats.accepted_draft_tokens > 0
    plain_again = stub.Generate(request(plain=True), timeout=600)
    assert list(plain_again.token_ids) == plain
