"""Log-probabilities of generated tokens: the verifier's rows (verifier/engine/acceptance.py
token_logprobs) on literal arrays and in the engine (aligned with the committed tokens, from a
tree's accepted rows as from plain steps, changing no token), the gateway over gRPC (plain
decoding only, MindIE's rule) and the OpenAI shapes over HTTP (gateway/openai_replies.py)."""

from __future__ import annotations

import doctest
import json
import math
import re
import urllib.request
import uuid

import grpc
import openai
import pytest
import torch

from pardec.gateway import openai_replies
from pardec.gateway.openai_api import requested
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import gateway_pb2
from pardec.verifier.api import Sampling, TokenLogprob
from pardec.verifier.engine import acceptance
from pardec.verifier.engine.acceptance import token_logprobs
from tests.openai_front import model_of


def test_the_worked_examples():
    assert doctest.testmod(openai_replies).failed == 0


def test_token_logprobs_on_literal_rows():
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 3.0, 1.0, -1.0]])
    lse0 = math.log(math.exp(2) + 3)
    rows = token_logprobs(logits, [0, 2], [1, 1], top=2)
    assert rows[0].logprob == pytest.approx(-lse0, abs=1e-6)
    assert rows[0].top[0] == (0, pytest.approx(2 - lse0, abs=1e-6))
    assert rows[1].top[0][0] == 1 and rows[1].logprob == rows[1].top[0][1]
    assert token_logprobs(logits, [1], [3], top=0) == [TokenLogprob(pytest.approx(-math.log(4)))]
    assert len(token_logprobs(logits, [1], [3], top=9)[0].top) == 4  # no more than the vocabulary
    with pytest.raises(InvalidArgument, match=r"logprobs: must be in \[0, 20\]"):
        Sampling(logprobs=21)


def test_token_logprobs_in_blocks_of_rows_are_the_whole_blocks(monkeypatch):
    logits = torch.randn(150, 500, generator=torch.Generator().manual_seed(0))
    rows, tokens = list(range(149, -1, -1)), [row * 3 % 500 for row in range(150)]
    blocked = token_logprobs(logits, rows, tokens, top=4)  # LOGPROB_ROWS at a time
    monkeypatch.setattr(acceptance, "LOGPROB_ROWS", 10**6)
    assert blocked == token_logprobs(logits, rows, tokens, top=4) and len(blocked) == 150


def test_request_bodies_ask_for_logprobs_in_both_openai_shapes():
    assert requested({}) == (False, 0)
    assert requested({"logprobs": True, "top_logprobs": 3}) == (True, 3)  # chat
    assert requested({"logprobs": 0}) == (True, 0) and requested({"logprobs": 5}) == (True, 5)  # completions
    for body, field in (({"logprobs": "yes"}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                        ({"top_logprobs": 1.5}, "top_logprobs"), ({"top_logprobs": -2}, "top_logprobs")):
        with pytest.raises(InvalidArgument, match=f"^{field}: "):
            requested(body)


def _decode(engine, prompt, steps, sampling, trees=None):
    """A session's tokens and logprobs: `steps` verify steps, plain or with the given trees."""
    session = uuid.uuid4().hex
    first = engine.prefill(session, prompt, sampling, sampling.seed)
    tokens, logprobs = [first.token], [first.logprob]
    try:
        for _ in range(steps):
            tree = trees(tokens) if trees else ([], [])
            verified = engine.verify(session, *tree)
            tokens += [*verified.accepted_tokens, verified.bonus_token]
            logprobs += verified.logprobs
    finally:
        engine.release(session)
    return tokens, logprobs


def test_the_engine_returns_each_committed_tokens_logprob_and_changes_no_token(engine):
    prompt = engine.tokenizer.encode_chat("Name three colours, one per line.")
    plain_tokens, none = _decode(engine, prompt, 16, Sampling())
    assert none == [None] and plain_tokens  # not asked for: none at all
    tokens, logprobs = _decode(engine, prompt, 16, Sampling(logprobs=3))
    assert tokens == plain_tokens and len(logprobs) == len(tokens)
    for token, logprob in zip(tokens, logprobs):
        assert len(logprob.top) == 3 and logprob.top[0] == (token, logprob.logprob)  # greedy: the likeliest
        assert [lp for _, lp in logprob.top] == sorted((lp for _, lp in logprob.top), reverse=True)
        assert sum(math.exp(lp) for _, lp in logprob.top) <= 1.0 + 1e-5

    def chain(committed):  # the plain continuation as a chain, with a wrong sibling first
        ahead = plain_tokens[len(committed): len(committed) + 4]
        return [(ahead[0] + 1) % engine.vocab_size, *ahead], [-1, -1, *range(1, len(ahead))]

    drafted, drafted_logprobs = _decode(engine, prompt, 2, Sampling(logprobs=3), trees=chain)
    assert drafted == plain_tokens[: len(drafted)] and len(drafted) > 4  # accepted rows, not only roots
    for mine, theirs in zip(drafted_logprobs, logprobs):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top][:1] == [t for t, _ in theirs.top][:1]

    seeded = Sampling(temperature=1.0, seed=7)
    sampled, _ = _decode(engine, prompt, 8, seeded)
    assert _decode(engine, prompt, 8, Sampling(temperature=1.0, seed=7, logprobs=0))[0] == sampled


def test_prompt_logprobs_score_a_text_as_decoding_it_did(engine):
    """The prompt's scores are the model's own: a prompt made of a prompt and its greedy answer
    scores the answer's tokens as decoding them gave, though the prefix cache holds that prompt."""
    prompt = engine.tokenizer.encode_chat("Name three colours, one per line.")
    tokens, logprobs = _decode(engine, prompt, 10, Sampling(logprobs=2))
    session = uuid.uuid4().hex
    assert engine.config.prefix_caching
    engine.prefill(session, prompt + tokens, Sampling(), None)
    engine.release(session)  # the whole text's blocks are now in the prefix cache
    scored = engine.prefill(session, prompt + tokens, Sampling(prompt_logprobs=2), None)
    engine.release(session)
    assert scored.cached_tokens == 0 and len(scored.prompt_logprobs) == len(prompt) + len(tokens) - 1
    answer = scored.prompt_logprobs[len(prompt) - 1:]
    for mine, theirs in zip(answer, logprobs):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
    unscored = engine.prefill(session, prompt + tokens, Sampling(), None)
    engine.release(session)
    assert scored.token == unscored.token  # scores change no token


def test_grpc_plain_requests_get_logprobs_and_parallel_ones_are_refused(stack):
    request = gateway_pb2.GenerateRequest(prompt="Count from one to five.", max_new_tokens=12, logprobs=True,
                                          top_logprobs=2, decoding=gateway_pb2.DECODING_MODE_PLAIN)
    reply = stack.gateway.Generate(request, timeout=120)
    assert len(reply.logprobs) == len(reply.token_ids) > 0
    for token, logprob in zip(reply.token_ids, reply.logprobs):
        assert list(logprob.top_token_ids)[0] == token and logprob.top_logprobs[0] == logprob.logprob
    chunks = list(stack.gateway.GenerateStream(request, timeout=120))
    assert [lp for c in chunks for lp in c.logprobs] == list(reply.logprobs)
    assert [t for c in chunks for t in c.token_ids] == list(reply.token_ids)

    scored = gateway_pb2.GenerateRequest(prompt="Count from one to five.", max_new_tokens=4, prompt_logprobs=1,
                                         decoding=gateway_pb2.DECODING_MODE_PLAIN)
    chunks = list(stack.gateway.GenerateStream(scored, timeout=120))
    prompt_ids = stack.gateway.Tokenize(gateway_pb2.TokenizeRequest(prompt=scored.prompt), timeout=60).token_ids
    assert chunks[0].prompt_token_ids == prompt_ids and len(chunks[0].prompt_logprobs) == len(prompt_ids) - 1
    assert all(len(lp.top_token_ids) == 1 for lp in chunks[0].prompt_logprobs)
    assert not any(c.prompt_token_ids or c.prompt_logprobs or c.logprobs for c in chunks[1:])
    unary = stack.gateway.Generate(scored, timeout=120)
    assert unary.prompt_logprobs == chunks[0].prompt_logprobs and not unary.logprobs

    as_ids = gateway_pb2.GenerateRequest(prompt_token_ids=list(prompt_ids), raw=True, max_new_tokens=4)
    text = gateway_pb2.GenerateRequest(prompt=scored.prompt, max_new_tokens=4)  # the chat template's tokens
    assert stack.gateway.Generate(as_ids, timeout=120).token_ids == stack.gateway.Generate(text, timeout=120).token_ids
    for bad, field in ((dict(prompt="x", prompt_token_ids=[1]), "prompt_token_ids: send one of"),
                       (dict(prompt_token_ids=[1, 10**9]), r"prompt_token_ids\[1\]: 1000000000 is not a token")):
        with pytest.raises(grpc.RpcError) as refused:
            stack.gateway.Generate(gateway_pb2.GenerateRequest(max_new_tokens=2, **bad), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search(field, refused.value.details()), refused.value.details()

    request.decoding = gateway_pb2.DECODING_MODE_DEFAULT
    with pytest.raises(grpc.RpcError) as refused:
        stack.gateway.Generate(request, timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs" in refused.value.details() and "plain decoding" in refused.value.details()


def test_openai_chat_and_completions_carry_logprobs_in_their_shapes(front, client):
    model, messages = model_of(front), [{"role": "user", "content": "Say hello in French."}]
    plain = {"parallel_decoding": False}
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=plain)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    text_bytes = b"".join(bytes(entry.bytes) for entry in content if not entry.token.startswith("<|"))
    assert text_bytes.decode() == chat.choices[0].message.content
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token for entry in content)

    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                              logprobs=True, top_logprobs=2, extra_body=plain, stream=True)
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]

    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, logprobs=1, extra_body=plain)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 6
    assert [list(top) for top in logprobs.top_logprobs] == [[token] for token in logprobs.tokens]
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)

    # Token ids as the prompt (lm-evaluation-harness's tokenized requests): the same as the text's.
    asked = urllib.request.Request(f"http://{front.http_address}/tokenize", method="POST",
                                   data=json.dumps({"prompt": "The capital of France is"}).encode(),
                                   headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(asked, timeout=60) as answer:
        ids = json.load(answer)["tokens"]
    by_ids = client.completions.create(model=model, prompt=[ids], max_tokens=6, temperature=0, logprobs=1,
                                       extra_body=plain)
    assert by_ids.choices[0].text == completion.choices[0].text and by_ids.usage.prompt_tokens == len(ids)

    # lm-evaluation-harness's log-likelihood request: the prompt echoed, each token scored.
    prompt = "The capital of France is Paris"
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                       extra_body=plain)
    choice = echoed.choices[0]
    tokens = choice.logprobs.tokens
    assert choice.text.startswith(prompt) and "".join(tokens) == choice.text
    assert len(tokens) == echoed.usage.prompt_tokens + 1 and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.top_logprobs[0] is None  # nothing precedes the first token
    # the likeliest token and the chosen one, always (OpenAI's: up to logprobs + 1 entries)
    assert all(token in top and len(top) <= 2 for token, top in zip(tokens[1:], choice.logprobs.top_logprobs[1:]))
    assert any(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])  # a prompt token the model did not expect
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    streamed = list(client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                              echo=True, extra_body=plain, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == tokens
    assert client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                     echo=True).choices[0].text.startswith(prompt)  # echo alone: any decoding
    # max_tokens 0 with echo: the prompt scored, nothing generated (OpenAI's legacy API).
    for stream in (False, True):
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=0, temperature=0, logprobs=1,
                                          echo=True, extra_body=plain, stream=stream, stream_options=None)
        chunks = [c for c in reply if c.choices] if stream else [reply]
        assert "".join(c.choices[0].text for c in chunks) == prompt
        scored = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
        assert scored == choice.logprobs.token_logprobs[:-1]  # the prompt's, as with a generated token after
        assert chunks[-1].choices[0].finish_reason == "length"
        if not stream:
            assert reply.usage.completion_tokens == 0

    with pytest.raises(Exception) as refused:  # parallel decoding (the default): MindIE's rule
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, logprobs=True)
    assert getattr(refused.value, "status_code", None) == 400 and "logprobs" in str(refused.value)


def test_vllm_prompt_logprobs_score_the_prompt_in_chat_and_completions(front, client):
    model, plain, prompt = model_of(front), {"parallel_decoding": False}, "The capital of France is Paris"
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
                                       extra_body=plain).choices[0].logprobs
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={**plain, "prompt_logprobs": 2})
    scores = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == reply.usage.prompt_tokens and scores[0] is None
    assert reply.choices[0].logprobs is None  # not asked for: null, not an empty object (vLLM's)
    # Each entry: the prompt's token (first) and the two likeliest, the same scores echo gives.
    assert [next(iter(entry.values()))["logprob"] for entry in scores[1:]] == echoed.token_logprobs[1:-1]
    assert [next(iter(entry.values()))["decoded_token"] for entry in scores[1:]] == echoed.tokens[1:-1]
    assert all(2 <= len(entry) <= 3 and {e["rank"] for e in entry.values()} >= {1, 2} for entry in scores[1:])
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=1,
                                          temperature=0, extra_body={**plain, "prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in chat.model_extra["prompt_logprobs"][1:])
    for extra, field in (({"prompt_logprobs": 1}, "prompt_logprobs"),  # parallel decoding: MindIE's rule
                         ({**plain, "prompt_logprobs": 21}, "prompt_logprobs"),
                         ({**plain, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body=extra)
        assert refused.value.body["param"] == field
