"""Time through the real stack: a client's deadline or cancel ends the request and frees its
sessions on the verifier and the drafter at once, unary as streamed; a verify that misses its
timeout on the only verifier replica resumes there under a new key; trees fit what the session
has left under maxSeqLen."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
import redis

from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import start_gateway
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pardec.verifier.config import VerifierConfig
from pardec.verifier.engine.engine import Engine
from pardec.verifier.service import VerifierServicer
from tests.prompts import CODE_PROMPTS

# Freed "within a second" on an idle machine; this bound leaves room for a loaded 2-core one.
FREED_WITHIN_S = 5.0
COUNTING = "Count from 1 to 2000, one number per line, with nothing else."


def request(prompt=CODE_PROMPTS[1], max_new_tokens=800, plain=False):
    mode = gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT
    return gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, decoding=mode)


def drafter_keys(redis_server) -> set:
    return set(redis.Redis.from_url(redis_server.url).keys("pardec:*"))


def seconds_until_free(engine, redis_server, before: set, since: float, limit_s: float = 60.0) -> float:
    """Seconds from ``since`` until the verifier holds no session and Redis no new session key."""
    while engine.sessions or drafter_keys(redis_server) - before:
        assert time.monotonic() - since < limit_s, "sessions were never freed"
        time.sleep(0.02)
    return time.monotonic() - since


def wait_for_session(engine, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not engine.sessions:
        assert time.monotonic() < deadline, "the request never reached the verifier"
        time.sleep(0.01)


def whole_request_s(stack) -> float:
    """How long the whole request takes here: the tests' deadlines are a fraction of it, so they
    fall mid-generation on a fast machine as on a loaded one."""
    began = time.monotonic()
    stack.gateway.Generate(request(), timeout=600)
    return time.monotonic() - began


def test_a_unary_deadline_ends_the_request_and_frees_its_sessions(stack, engine, redis_server):
    stack.gateway.Generate(request(max_new_tokens=4), timeout=300)  # kernels built: the first forward is slow
    before = drafter_keys(redis_server)
    assert engine.sessions == 0
    whole_s = whole_request_s(stack)
    with pytest.raises(grpc.RpcError) as caught:
        stack.gateway.Generate(request(), timeout=whole_s / 4)
    ended = time.monotonic()
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    freed_s = seconds_until_free(engine, redis_server, before, ended)
    print(f"unary deadline: sessions freed {freed_s:.3f}s after the client's DEADLINE_EXCEEDED")
    assert freed_s < FREED_WITHIN_S


def test_a_unary_call_the_client_cancels_frees_its_sessions(stack, engine, redis_server):
    before = drafter_keys(redis_server)
    # A reply that runs to max_new_tokens, so the call is still generating when the cancel comes
    # on a fast machine too (a code edit's reply can end at EOS within the sleep below).
    call = stack.gateway.Generate.future(request(prompt=COUNTING), timeout=300)
    wait_for_session(engine)
    time.sleep(0.3)  # a few steps in
    call.cancel()
    cancelled = time.monotonic()
    assert call.cancelled()
    freed_s = seconds_until_free(engine, redis_server, before, cancelled)
    print(f"unary cancel: sessions freed {freed_s:.3f}s after the cancel")
    assert freed_s < FREED_WITHIN_S


def test_a_streamed_deadline_ends_the_stream_and_frees_its_sessions(stack, engine, redis_server):
    before = drafter_keys(redis_server)
    # Measured on a stream: its first chunk, then the rest; the deadline falls a third of the way
    # through the rest. A machine that slows down between the measure and the try can put the
    # deadline before the first chunk: then it is measured and tried again (a few times at most).
    for _attempt in range(3):
        received = 0
        began = time.monotonic()
        stream = stack.gateway.GenerateStream(request(), timeout=600)
        next(stream)
        first_s = time.monotonic() - began
        for _ in stream:
            pass
        whole_s = time.monotonic() - began
        with pytest.raises(grpc.RpcError) as caught:
            for chunk in stack.gateway.GenerateStream(request(), timeout=first_s + (whole_s - first_s) / 3):
                received += len(chunk.token_ids)
        ended = time.monotonic()
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if received:
            break
    assert 0 < received < 800
    freed_s = seconds_until_free(engine, redis_server, before, ended)
    print(f"stream deadline: sessions freed {freed_s:.3f}s after the client's DEADLINE_EXCEEDED")
    assert freed_s < FREED_WITHIN_S


def test_a_verify_that_misses_its_timeout_on_the_only_replica_resumes_there(stack, engine):
    """The gateway's verify timeout (rpc_timeout_s) passes while the only verifier is busy: the
    session resumes on that same replica under a new key (the old one still exists there) and
    the text is exactly plain decoding's."""
    message = request(CODE_PROMPTS[0], max_new_tokens=48)
    plain = list(stack.gateway.Generate(request(CODE_PROMPTS[0], 48, plain=True), timeout=300).token_ids)
    chunks = stream_past_a_missed_verify(stack, engine, message)
    assert [t for c in chunks for t in c.token_ids] == plain
    deadline = time.monotonic() + 30
    while engine.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.sessions == 0  # the session it replaced was released too


def stream_past_a_missed_verify(stack, engine, message) -> list:
    """``message``'s stream through a gateway whose verify timeout (rpc_timeout_s) passes once,
    three chunks in, while the only verifier is busy; its chunks, after at least one failover."""
    config = GatewayConfig(
        verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"], rpc_timeout_s=8.0
    )
    running = start_gateway(config, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(message, timeout=300)
            chunks = [next(call) for _ in range(3)]
            # The engine thread busy for longer than a verify may take: the step in flight misses it.
            stall = threading.Thread(target=engine.call, args=(lambda: time.sleep(10.0),))
            stall.start()
            chunks += list(call)
            stall.join()
        assert running.generator.metrics.failovers.labels("unavailable")._value.get() >= 1
    finally:
        running.stop()
    return chunks


def test_a_resumed_session_keeps_its_logprobs_and_min_tokens(stack, engine):
    """As above, for a plain request with logprobs and min_tokens: the resumed session's tokens,
    one logprob each, and min_tokens counted from what it had generated, as without the move."""
    free = stack.gateway.Generate(gateway_pb2.GenerateRequest(
        prompt="What is the capital of France?", max_new_tokens=48, decoding=gateway_pb2.DECODING_MODE_PLAIN),
        timeout=120)
    message = gateway_pb2.GenerateRequest(
        prompt="What is the capital of France?", max_new_tokens=48, decoding=gateway_pb2.DECODING_MODE_PLAIN,
        logprobs=True, top_logprobs=1)
    message.sampling.min_tokens = len(free.token_ids) + 8
    held = stack.gateway.Generate(message, timeout=120)
    assert held.finish_reason == "eos"
    # min_tokens just short of where the held answer ends: counted from the move instead of from
    # the first token, it would hold that end back too.
    message.sampling.min_tokens = len(held.token_ids) - 2
    reference = stack.gateway.Generate(message, timeout=120)
    assert reference.token_ids == held.token_ids
    chunks = stream_past_a_missed_verify(stack, engine, message)
    assert [t for c in chunks for t in c.token_ids] == list(reference.token_ids)
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert len(logprobs) == len(reference.logprobs) == len(reference.token_ids) >= message.sampling.min_tokens
    for moved, unmoved in zip(logprobs, reference.logprobs):
        assert moved.logprob == pytest.approx(unmoved.logprob, abs=1e-4)
        assert moved.top_token_ids == unmoved.top_token_ids


def test_a_resumed_session_stays_in_its_structured_output(stack, engine):
    """A JSON Schema answer moved mid-way: the new replica's grammar matches the tokens generated
    before the move (PrefillRequest.generated_tokens), and goes on where the old one was."""
    schema = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}'
    message = gateway_pb2.GenerateRequest(
        prompt='Reply with JSON only. Alice is 31 years old.', max_new_tokens=48,
        decoding=gateway_pb2.DECODING_MODE_PLAIN,
        sampling=common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(json_schema=schema)))
    reference = stack.gateway.Generate(message, timeout=120)
    assert reference.finish_reason == "eos" and json.loads(reference.text)
    chunks = stream_past_a_missed_verify(stack, engine, message)
    assert [t for c in chunks for t in c.token_ids] == list(reference.token_ids)


@pytest.fixture(scope="module")
def short_verifier(engine):
    """A verifier with a maxSeqLen of 256 over the shared model: a request can end right at it."""
    config = VerifierConfig(max_seq_len=256, max_input_tokens=200, kv_pool_tokens=1024, measure_cost_curve=False)
    short = Engine(engine.model, engine.tokenizer, engine.model_name, config)
    server, address = start_server([VerifierServicer(short).add_to], "127.0.0.1:0")
    yield short, address
    server.stop(None)
    short.close()


def test_drafted_trees_fit_what_is_left_under_max_seq_len(stack, short_verifier):
    short, address = short_verifier
    config = GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"])
    running = start_gateway(config, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            for prompt in CODE_PROMPTS[:2]:
                room = 256 - len(short.tokenizer.encode_chat(prompt))  # prompt + max_new = maxSeqLen
                plain = stub.Generate(request(prompt, room, plain=True), timeout=600)
                drafted = stub.Generate(request(prompt, room), timeout=600)
                assert list(drafted.token_ids) == list(plain.token_ids)
                assert drafted.stats.accepted_draft_tokens > 0
    finally:
        running.stop()
    assert short.sessions == 0


def test_a_request_naming_no_limit_gets_what_the_context_leaves(stack, short_verifier):
    """vLLM's default where the server's (256 tokens) does not fit: a request without
    max_new_tokens generates up to maxSeqLen and ends with "length", not refused for a field it
    never sent."""
    short, address = short_verifier
    config = GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"])
    running = start_gateway(config, "127.0.0.1:0")
    prompt = "Count on: " + "one two three four five six seven eight nine ten " * 8
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            reply = stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, raw=True, ignore_eos=True), timeout=600)
            assert reply.stats.prompt_tokens + len(reply.token_ids) == 256 and reply.finish_reason == "length"
            with pytest.raises(grpc.RpcError) as refused:  # a limit it names is still checked
                stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, raw=True, max_new_tokens=256), timeout=60)
            assert refused.value.details().startswith("max_new_tokens: prompt")
            with pytest.raises(grpc.RpcError) as refused:  # nor can it hold a min_tokens the context cannot
                stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, raw=True, sampling=common_pb2.SamplingParams(
                    min_tokens=250)), timeout=60)
            assert refused.value.details().startswith("min_tokens: 250 exceeds the ")
    finally:
        running.stop()
