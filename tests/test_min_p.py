"""vLLM's min_p (verifier/engine/acceptance.py choose_token): after temperature, only the tokens at
least min_p times as likely as the likeliest are drawn from. A row's own filter, so a drafted
session samples plain decoding's tokens; checked on literal rows, on the engine, and through the
gateway over HTTP, gRPC and the light client (min_p 1 keeps the likeliest token alone: greedy)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pardec.client import Client
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2, gateway_pb2
from pardec.verifier.api import Sampling
from pardec.verifier.engine.acceptance import choose_token
from tests.openai_front import model_of
from tests.steps import decode_session, plain_chain

PROMPT = "Write a short poem about the sea."


def _draws(logits, sampling, count=3000):
    generator = torch.Generator().manual_seed(0)
    return Counter(choose_token(logits, sampling, generator) for _ in range(count))


def test_min_p_keeps_the_tokens_near_the_likeliest_after_temperature():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = _draws(logits, Sampling(temperature=1.0, min_p=0.2))  # keeps p >= 0.1
    assert set(drawn) == {0, 1, 2} and drawn[0] > drawn[1] > drawn[2]
    assert set(_draws(logits, Sampling(temperature=1.0))) == {0, 1, 2, 3}
    assert set(_draws(logits, Sampling(temperature=1.0, min_p=1.0), 200)) == {0}  # the likeliest alone
    # Temperature first: at 2 the last token is sqrt(0.05 / 0.5) = 0.32 of the likeliest, kept at 0.2.
    assert set(_draws(logits, Sampling(temperature=2.0, min_p=0.2))) == {0, 1, 2, 3}
    assert set(_draws(logits, Sampling(temperature=2.0, min_p=0.4))) == {0, 1, 2}
    # Then top-k and top-p over what it kept; greedy is untouched.
    assert set(_draws(logits, Sampling(temperature=1.0, min_p=0.2, top_k=2))) == {0, 1}
    assert choose_token(logits, Sampling(min_p=0.9), None) == 0


def test_min_p_is_checked_and_travels_on_the_wire():
    for value in (-0.1, 1.5, math.nan):
        with pytest.raises(InvalidArgument, match=r"^sampling\.min_p: must be in \[0, 1\]"):
            Sampling(min_p=value)
    sampling = Sampling(temperature=0.5, min_p=0.25, seed=3)  # float32-exact
    assert Sampling.from_proto(sampling.to_proto()) == sampling


def test_a_drafted_session_under_min_p_samples_plain_decodings_tokens(engine):
    prompt = engine.tokenizer.encode_chat(PROMPT)
    sampling = Sampling(temperature=1.5, seed=11, min_p=0.1)
    plain = decode_session(engine, prompt, sampling, 24)
    assert plain != decode_session(engine, prompt, Sampling(temperature=1.5, seed=11), 24)  # the filter changes draws
    drafted = decode_session(engine, prompt, sampling, 4, trees=plain_chain(plain, engine.vocab_size))
    assert drafted == plain[:len(drafted)] and len(drafted) > 8


def test_min_p_one_is_greedy_over_every_entry_point(stack, front, client):
    greedy = stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=16), timeout=120)
    sampled = stack.gateway.Generate(gateway_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=16, sampling=common_pb2.SamplingParams(temperature=1.0, min_p=1.0)), timeout=120)
    assert sampled.token_ids == greedy.token_ids
    with Client(stack.addresses["gateway"], timeout=120) as light:
        assert light.generate(PROMPT, max_new_tokens=16, temperature=1.0, min_p=1.0).token_ids == tuple(greedy.token_ids)
    messages = [{"role": "user", "content": PROMPT}]
    over_http = client.chat.completions.create(model=model_of(front), messages=messages, max_tokens=16,
                                               temperature=1.0, extra_body={"min_p": 1.0})
    assert over_http.choices[0].message.content == greedy.text
    with pytest.raises(Exception) as refused:
        client.chat.completions.create(model=model_of(front), messages=messages, max_tokens=4,
                                       extra_body={"min_p": 1.5})
    assert getattr(refused.value, "status_code", None) == 400 and "min_p" in str(refused.value)
