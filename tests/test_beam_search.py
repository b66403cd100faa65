"""Beam search (gateway/beam_search.py): the algorithm on literal distributions against an
exhaustive search, then through a real gateway over gRPC and HTTP, its beams the algorithm's over
the engine's own distributions, and what it refuses."""

from __future__ import annotations

import doctest
import itertools
import json
import urllib.error
import urllib.request
import time
import uuid

import grpc
import pytest

import pardec.gateway.beam_search
from pardec.gateway.beam_search import Beam, best, candidates, extend, score, search
from pardec.gateway.openai_api import with_defaults
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.openai_front import post_json
from pardec.verifier.api import Sampling

END = 3
# A toy model over the tokens 0..3 (3 ends a sequence): the next token's log-probabilities after
# each prefix, a function of the last token only.
TABLE = {None: [(0, -0.25), (1, -1.5), (2, -2.0), (END, -3.0)], 0: [(1, -0.5), (END, -1.0), (0, -2.5), (2, -3.0)],
         1: [(END, -0.125), (2, -2.25), (0, -3.0), (1, -4.0)], 2: [(2, -0.75), (0, -1.0), (END, -2.0), (1, -2.5)]}


def _next(tokens: tuple[int, ...], keep: int = 4) -> list[tuple[int, float]]:
    return TABLE[tokens[-1] if tokens else None][:keep]


def _exhaustive(max_new: int, prompt_tokens: int, length_penalty: float) -> list[Beam]:
    """Every sequence of at most max_new tokens that ends at END or at max_new, ranked by score."""
    every = []
    for length in range(1, max_new + 1):
        for tokens in itertools.product(range(4), repeat=length):
            if END in tokens[:-1]:
                continue  # nothing follows an end
            logprob, prefix = 0.0, ()
            for token in tokens:
                logprob += dict(_next(prefix))[token]
                prefix += (token,)
            ended = tokens[-1] == END
            if ended or length == max_new:
                every.append(Beam(tokens, logprob, ended))
    return best(every, len(every), prompt_tokens, length_penalty)


def test_docstring_example():
    assert doctest.testmod(pardec.gateway.beam_search).failed == 0


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_wide_enough_beams_are_the_exhaustive_ranking(length_penalty):
    # 4 tokens a round, 3 rounds: 1 + 3 ended early, 3*3*4 at 3 tokens: 40; 64 beams keep every one.
    expected = _exhaustive(3, prompt_tokens=5, length_penalty=length_penalty)
    found = search(lambda beams: [_next(tokens) for tokens in beams], 64, 3, frozenset({END}), 5, length_penalty)
    scores = [score(b, 5, length_penalty) for b in found]
    assert scores == sorted(scores, reverse=True) and len(found) == len(expected) == 40
    def ranked(beams):  # noqa: E306 -- ties in score may come in either order
        return sorted(beams, key=lambda b: (-score(b, 5, length_penalty), b.tokens))
    assert ranked(found) == ranked(expected)


def test_narrow_beams_by_hand():
    # Width 2, 2 candidates a beam. Round 1: (0) -0.25, (1) -1.5 live. Round 2: (0,1) -0.75 and
    # (0,END) -1.25 ended, (1,END) -1.625 ended, (1,2) -3.75: live (0,1), (1,2). Round 3:
    # (0,1,END) -0.875 ended, (0,1,2) -3.0, (1,2,2) -4.5, (1,2,0) -4.75: live (0,1,2), (1,2,2).
    found = search(lambda beams: [_next(tokens, keep=2) for tokens in beams], 2, 3, frozenset({END}), 1, 1.0)
    # Scores over prompt 1 + tokens without the end: (0,1,END) -0.875 / 3, (0,END) -1.25 / 2.
    assert [(b.tokens, b.logprob) for b in found] == [((0, 1, END), -0.875), ((0, END), -1.25)]
    assert score(found[0], 1, 1.0) == -0.875 / 3 and candidates(2) == 4 and candidates(16) == 20
    live, ended = extend([Beam((0,)), Beam((1,))], [[(5, -1.0)], [(6, -1.0)]], width=1, ends=set())
    assert live == [Beam((0, 5), -1.0)] and ended == []  # a tie keeps the beams' order


# ---------------------------------------------------------------- through a real gateway
def _engine_beams(engine, prompt: list[int], width: int, max_new: int, ends: frozenset[int]) -> list[Beam]:
    """The same search over the engine's own next-token distributions, asked one beam at a time."""
    def next_tokens(beams):
        nexts = []
        for tokens in beams:
            session = f"reference-{uuid.uuid4().hex}"
            prefilled = engine.prefill(session, [*prompt, *tokens], Sampling(logprobs=candidates(width)), None,
                                       max_new_tokens=1)
            engine.release(session)
            nexts.append(prefilled.logprob.top)
        return nexts
    return search(next_tokens, width, max_new, ends, len(prompt), 1.0)


def test_served_beams_are_the_search_over_the_models_distributions(front, engine):
    prompt = "def add(a, b):"
    status, reply = post_json(front, "/v1/completions", {
        "prompt": prompt, "max_tokens": 6, "n": 3, "use_beam_search": True, "parallel_decoding": False,
        "return_token_ids": True, "temperature": 0.7})  # temperature does not apply to beams
    assert status == 200, reply
    prompt_ids = reply["choices"][0]["prompt_token_ids"]
    expected = _engine_beams(engine, prompt_ids, 3, 6, frozenset(engine.tokenizer.stop_token_ids))
    assert [choice["token_ids"] for choice in reply["choices"]] == [list(beam.tokens) for beam in expected]
    assert [choice["index"] for choice in reply["choices"]] == [0, 1, 2]
    assert reply["usage"]["completion_tokens"] == sum(len(beam.tokens) for beam in expected)
    assert reply["usage"]["pardec"]["decoding_method"] == "beam_search"
    assert all(c["finish_reason"] == ("stop" if b.ended else "length") for c, b in zip(reply["choices"], expected))
    # gRPC: GenerateStream says each beam with its index, Generate the best one
    request = gateway_pb2.GenerateRequest(prompt=prompt, raw=True, max_new_tokens=6, n=3, use_beam_search=True,
                                          decoding=gateway_pb2.DECODING_MODE_PLAIN, length_penalty=1.0)
    with grpc.insecure_channel(front.address, options=CHANNEL_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        streamed = {m.index: list(m.token_ids) for m in stub.GenerateStream(request, timeout=300)}
        request.n = 1
        unary = stub.Generate(request, timeout=300)
    assert streamed == {index: list(beam.tokens) for index, beam in enumerate(expected)}
    assert list(unary.token_ids) == list(_engine_beams(engine, prompt_ids, 1, 6, frozenset(
        engine.tokenizer.stop_token_ids))[0].tokens)


def test_a_chat_of_beams_streamed_and_a_batch(front):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 5, "n": 2,
            "use_beam_search": True, "parallel_decoding": False}
    status, whole = post_json(front, "/v1/chat/completions", body)
    assert status == 200 and len(whole["choices"]) == 2, whole
    request = urllib.request.Request(f"http://{front.http_address}/v1/chat/completions",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    texts: dict[int, str] = {}
    with urllib.request.urlopen(request, timeout=300) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    status, batch = post_json(front, "/v1/completions", {"prompt": ["One, two,", "Red, green,"], "max_tokens": 3,
                                                     "n": 2, "use_beam_search": True, "parallel_decoding": False})
    assert status == 200 and [c["index"] for c in batch["choices"]] == [0, 1, 2, 3], batch


@pytest.mark.parametrize("extra, field", [
    ({"parallel_decoding": True}, "use_beam_search"),  # MindIE's rule: plain decoding runs it
    ({"stop": ["\n"]}, "stop"),
    ({"logprobs": 1}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"response_format": {"type": "json_object"}}, "structured_output"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"n": 17}, "n"),
    ({"thinking_token_budget": 4}, "thinking_token_budget"),
    ({"guided_regex": "[a-z]+"}, 'sampling.structured_output = "regex"'),  # its kind, not the expression
    ({"prompt": ["Hello", [10**9]]}, "is not a token of the model"),  # checked whole before any search
    ({"prompt": ["Hello", [10**9]], "stream": True}, "is not a token of the model"),  # a 400, not a stream
])
def test_what_beam_search_refuses(front, extra, field):
    body = {"prompt": "Hello", "max_tokens": 3, "use_beam_search": True, "parallel_decoding": False, **extra}
    status, reply = post_json(front, "/v1/completions", body)
    assert status == 400 and field in reply["error"]["message"], reply


def test_a_required_tool_call_and_the_models_sampling_defaults(front):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    status, reply = post_json(front, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "tools": tools, "tool_choice": "required", "max_tokens": 4,
        "use_beam_search": True, "parallel_decoding": False})
    assert status == 400 and reply["error"]["message"].startswith("tool_choice: a required tool call"), reply
    # a model's generation_config defaults (Qwen's repetition_penalty 1.05) are sampling's, not the beams'
    defaults = (("repetition_penalty", 1.05), ("temperature", 0.7), ("max_new_tokens", 8))
    assert with_defaults({"use_beam_search": True, "max_tokens": 99}, defaults) == {"use_beam_search": True,
                                                                                    "max_tokens": 8}


def test_beams_past_max_input_tokens_and_extreme_length_penalties(front, engine):
    """A prompt at maxInputTokenLen leaves room for beams up to maxSeqLen (the generated tokens
    are not prompt tokens), and any finite length_penalty ranks (no overflow)."""
    limit = front.generator.config.max_input_tokens
    body = {"prompt": [253] * limit, "max_tokens": 3, "n": 2, "use_beam_search": True, "parallel_decoding": False,
            "ignore_eos": True}
    status, reply = post_json(front, "/v1/completions", body)
    assert status == 200 and [len(c["text"]) > 0 for c in reply["choices"]] == [True, True], reply
    for penalty in (1e30, -1e30, 0.0):
        status, reply = post_json(front, "/v1/completions", {"prompt": "One, two,", "max_tokens": 4, "n": 3,
                                                         "use_beam_search": True, "parallel_decoding": False,
                                                         "length_penalty": penalty})
        assert status == 200 and len(reply["choices"]) == 3, (penalty, reply)


def _scrape(front) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{front.http_address}/metrics", timeout=60) as reply:
        lines = [line for line in reply.read().decode().splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines)}


def test_a_beam_request_counts_once_and_each_beam_finishes(front):
    before = _scrape(front)
    status, reply = post_json(front, "/v1/completions", {"prompt": "One, two,", "max_tokens": 4, "n": 3,
                                                     "use_beam_search": True, "parallel_decoding": False})
    assert status == 200, reply
    after = _scrape(front)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("pardec_time_to_first_token_seconds_count") == grew("pardec_e2e_request_latency_seconds_count") == 1
    assert grew("pardec_request_time_per_output_token_seconds_count") == 0  # nothing was sent token by token
    assert grew("pardec_request_decode_time_seconds_count") == 0
    finished = sum(grew(f'pardec_request_success_total{{finished_reason="{r}"}}') for r in ("stop", "length"))
    assert finished == 3 and grew("pardec_generation_tokens_total") == reply["usage"]["completion_tokens"]
    assert after['pardec_request_success_total{finished_reason="stop"}'] >= 0  # each series exists from the start


def test_a_beam_that_takes_its_likeliest_token_continues_its_session(front, engine):
    """One beam never leaving its likeliest tokens is plain decoding's cost: one prefill, then a
    one-token step a round in the same session; wider beams hold no session once answered."""
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 8, "n": 1, "use_beam_search": True, "parallel_decoding": False,
            "ignore_eos": True, "return_token_ids": True}
    def counted(request: dict) -> tuple[dict, tuple[int, int]]:
        before = (engine.stats.prefill_chunks, engine.stats.verify_steps)
        status, reply = post_json(front, "/v1/completions", request)
        assert status == 200, reply
        return reply, (engine.stats.prefill_chunks - before[0], engine.stats.verify_steps - before[1])

    beams, beam_work = counted(body)
    greedy, greedy_work = counted({**body, "use_beam_search": False, "temperature": 0})
    assert beams["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]  # one beam: greedy here
    assert beam_work == greedy_work == (1, 7)
    status, reply = post_json(front, "/v1/completions", {**body, "n": 4})
    assert status == 200 and len(reply["choices"]) == 4 and engine.sessions == 0, reply
    # a search cut by its deadline releases the sessions its beams held
    request = gateway_pb2.GenerateRequest(prompt="Once upon a time", max_new_tokens=200, n=4, use_beam_search=True,
                                          ignore_eos=True, decoding=gateway_pb2.DECODING_MODE_PLAIN)
    with grpc.insecure_channel(front.address, options=CHANNEL_OPTIONS) as channel:
        with pytest.raises(grpc.RpcError) as cut:
            list(gateway_pb2_grpc.GatewayStub(channel).GenerateStream(request, timeout=1.0))
    assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(100):
        if engine.sessions == 0:
            break
        time.sleep(0.05)
    assert engine.sessions == 0
