"""GenerateStream over the real stack: chunks add up to Generate's answer, stop strings that span
chunks never leak, a cancel frees every service's session, per-request draft limits."""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from pardec.runtime.draft_params import DraftParams
from pardec.gateway.config import GatewayConfig
from pardec.gateway.decoding import StreamDecoder
from pardec.gateway.generation import Request
from pardec.gateway.server import build_generator
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import gateway_pb2
from tests.prompts import CHAT_PROMPTS, CODE_PROMPTS


def request(prompt, max_new_tokens=40, plain=False, **fields):
    return gateway_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new_tokens,
        decoding=gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT, **fields,
    )


def joined(chunks):
    chunks = list(chunks)
    assert chunks and all(not c.finish_reason for c in chunks[:-1]) and chunks[-1].finish_reason
    assert all(not c.HasField("stats") for c in chunks[:-1]) and chunks[-1].HasField("stats")
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks


@pytest.mark.parametrize("plain", [False, True], ids=["parallel", "plain"])
def test_concatenated_chunks_equal_the_unary_answer(stack, plain):
    message = request(CODE_PROMPTS[0], max_new_tokens=40, plain=plain)
    unary = stack.gateway.Generate(message, timeout=300)
    text, tokens, chunks = joined(stack.gateway.GenerateStream(message, timeout=300))
    assert (text, tokens) == (unary.text, list(unary.token_ids))
    assert chunks[-1].finish_reason == unary.finish_reason
    # One chunk after prefill, then one per step that committed something. (The two runs' step
    # counts may differ: trees are sized from step times measured as the session runs.)
    assert len(chunks) == chunks[-1].stats.steps + 1


def test_stop_string_spanning_chunks_is_never_streamed(stack):
    prompt = CHAT_PROMPTS[0]
    _, _, plain_chunks = joined(stack.gateway.GenerateStream(request(prompt, 48, plain=True), timeout=300))
    full = "".join(c.text for c in plain_chunks)
    # A stop string made of the end of one plain chunk and the start of the next.
    index = next(i for i in range(len(plain_chunks) // 2, len(plain_chunks) - 1)
                 if len(plain_chunks[i].text) >= 3 and len(plain_chunks[i + 1].text) >= 2)
    stop = plain_chunks[index].text[-2:] + plain_chunks[index + 1].text[:2]
    expected = full[: full.find(stop)]
    for plain in (True, False):
        message = request(prompt, 48, plain=plain, stop=[stop])
        text, tokens, chunks = joined(stack.gateway.GenerateStream(message, timeout=300))
        unary = stack.gateway.Generate(message, timeout=300)
        assert text == unary.text == expected
        assert tokens == list(unary.token_ids)
        assert chunks[-1].finish_reason == "stop"
        assert stop not in text


def test_decoder_holds_back_partial_characters_and_stop_string_prefixes(engine):
    tokenizer = engine.tokenizer
    text = "Say 🙂 to the end of the line, then stop."
    tokens = tokenizer.encode(text)
    assert tokenizer.decode(tokens) == text
    for stop in ("end of", "🙂 to", "line, then stop.", "never there"):
        decoder = StreamDecoder(tokenizer, frozenset(), (stop,), max_new=len(tokens))
        streamed = ""
        for token in tokens:  # one token per step: every boundary is a chunk boundary
            piece = decoder.add([token])
            assert "\ufffd" not in piece.text
            streamed += piece.text
            assert text.startswith(streamed)
            if stop in text:
                assert len(streamed) <= text.find(stop)
            if piece.done:
                break
        assert streamed == (text[: text.find(stop)] if stop in text else text)


def _drafter_keys(redis_server) -> set:
    return set(redis.Redis.from_url(redis_server.url).keys("pardec:*"))


def test_cancel_mid_stream_frees_the_session_on_verifier_and_drafter(stack, engine, redis_server):
    before = _drafter_keys(redis_server)
    assert engine.sessions == 0
    call = stack.gateway.GenerateStream(request(CODE_PROMPTS[1], max_new_tokens=400), timeout=300)
    received = [next(call), next(call)]
    assert engine.sessions == 1 and len(_drafter_keys(redis_server)) > len(before)
    call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 30
    while (engine.sessions or _drafter_keys(redis_server) != before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.sessions == 0
    assert _drafter_keys(redis_server) == before
    assert len(received) == 2


def test_per_request_draft_limits(stack):
    too_big = request("Hello", 8, draft=gateway_pb2.DraftOverrides(decoding_length=17))
    with pytest.raises(grpc.RpcError) as caught:
        stack.gateway.Generate(too_big, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft.decoding_length" in caught.value.details()
    full = stack.gateway.Generate(request(CODE_PROMPTS[0], 32), timeout=300)
    small = stack.gateway.Generate(request(CODE_PROMPTS[0], 32, draft=gateway_pb2.DraftOverrides(decoding_length=2)),
                                   timeout=300)
    assert list(small.token_ids) == list(full.token_ids)  # limits change speed, never the text
    assert small.stats.draft_tokens <= 2 * small.stats.steps
    assert full.stats.draft_tokens > 2 * full.stats.steps


def test_dynamic_algo_refuses_max_new_tokens_beyond_max_iter_times_minus_gamma(stack):
    config = GatewayConfig(
        verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"],
        draft=DraftParams(dynamic_algo=True), speculation_gamma=16, max_iter_times=64,
    )
    generator = build_generator(config, verifier_wait_s=60)
    with pytest.raises(InvalidArgument, match="max_new_tokens = 49: with dynamic_algo"):
        generator.generate(Request(CODE_PROMPTS[0], max_new_tokens=49))
    assert len(generator.generate(Request(CODE_PROMPTS[0], max_new_tokens=6)).token_ids) == 6
    # A plain request is capped by maxIterTimes alone.
    with pytest.raises(InvalidArgument, match="max_new_tokens = 65: must not exceed ScheduleConfig.maxIterTimes"):
        generator.generate(Request(CODE_PROMPTS[0], max_new_tokens=65, plain=True))
