"""OpenAI's presence and frequency penalties (verifier/engine/acceptance.py penalize_output): over
the output's tokens only, each row of a drafted tree penalised by its own path, so a drafted
session gives plain decoding's tokens; checked on literal arrays, on the engine (greedy, seeded
sampling, a resumed session), and through the gateway over gRPC and HTTP, where MindIE's rule
allows them with plain decoding only."""

from __future__ import annotations

import grpc
import pytest
import torch

from pardec.client import Client
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2, gateway_pb2
from pardec.verifier.api import Sampling
from pardec.verifier.engine.acceptance import accept, accept_step, tree_layout
from tests.openai_front import model_of
from tests.steps import decode_session, plain_chain

PROMPT = "Write the word 'hello' ten times, one per line."


def test_a_rows_penalty_counts_the_output_and_its_own_path_not_the_prompt():
    # History: prompt [3], then the output [1] (the root). A frequency penalty of 2 makes the
    # root's row choose 2 over 1; in the next row, 2 is on the path (penalised) and 3 only in the
    # prompt (not), so 3 is chosen: the walk goes root -> 2 -> 3, then row 3's bonus 0.
    logits = torch.tensor([[0.0, 1.5, 1.0, 0.0],   # root: 1 -> -0.5, so 2
                           [0.0, 0.0, 1.8, 1.0],   # after 2: 2 -> -0.2, 3 stays 1.0
                           [9.0, 0.0, 0.0, 0.0],   # after 2, 2 (not taken)
                           [5.0, 0.0, 0.0, 0.0]])  # after 2, 3
    layout = tree_layout(1, [2, 2, 3], [-1, 0, 0], vocab_size=4)
    history = torch.tensor([3, 1])
    walked = accept(logits, layout, [1, 2, 2, 3], history, Sampling(frequency_penalty=2.0), None, generated=1)
    assert (walked.accepted_rows, walked.bonus_token) == ([1, 3], 0)
    # The same as plain decoding: one row at a time, each with the tokens committed before it.
    plain, committed = [], [3, 1]
    for row in (0, 1, 3):
        one = tree_layout(committed[-1], [], [], vocab_size=4)
        token = accept(logits[row:row + 1], one, [committed[-1]], torch.tensor(committed),
                       Sampling(frequency_penalty=2.0), None, generated=len(committed) - 1).bonus_token
        plain.append(token)
        committed.append(token)
    assert plain == [2, 3, 0]
    # Presence counts a token once however often the output holds it: 1 (three times) loses 0.6
    # (0.9 < 1.0: 2), then 2 on the path loses 0.6 too (1.2 > 1.0: 2 again), then row 2's bonus 0.
    walked = accept(logits, layout, [1, 2, 2, 3], torch.tensor([3, 1, 1, 1]), Sampling(presence_penalty=0.6), None,
                    generated=3)
    assert (walked.accepted_rows, walked.bonus_token) == ([1, 2], 0)
    # Without penalties greedy takes each row's argmax alone: the root's 1, no child of it.
    free, _ = accept_step(logits, layout, [1, 2, 2, 3], lambda: history, Sampling(), None, generated=1)
    assert (free.accepted_rows, free.bonus_token) == ([], 1)


def test_penalties_are_validated_in_openais_range():
    assert Sampling(presence_penalty=-2.0, frequency_penalty=2.0).penalizes
    assert not Sampling().penalizes and Sampling(repetition_penalty=1.2).penalizes
    for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", float("nan"))):
        with pytest.raises(InvalidArgument, match=rf"^sampling\.{name}: must be in \[-2, 2\]"):
            Sampling(**{name: value})
    sampling = Sampling(temperature=0.5, presence_penalty=0.5, frequency_penalty=-1.0)
    assert Sampling.from_proto(sampling.to_proto()) == sampling


def test_drafted_and_resumed_sessions_under_penalties_are_plain_decoding(engine):
    prompt = engine.tokenizer.encode_chat(PROMPT)
    free = decode_session(engine, prompt, Sampling(), 12)
    for sampling in (Sampling(frequency_penalty=1.0), Sampling(presence_penalty=1.5, repetition_penalty=1.1),
                     Sampling(temperature=0.8, seed=7, frequency_penalty=0.7, presence_penalty=-0.5)):
        plain = decode_session(engine, prompt, sampling, 24)
        if sampling.greedy:
            assert plain[:len(free)] != free, sampling  # the penalty changes the answer
        drafted = decode_session(engine, prompt, sampling, 4, trees=plain_chain(plain, engine.vocab_size))
        assert drafted == plain[:len(drafted)] and len(drafted) > 8, sampling
        if sampling.greedy:  # a session rebuilt elsewhere from prompt + output counts the output alone
            resumed = decode_session(engine, prompt + plain[:6], sampling, 6, generated=6)
            assert resumed == plain[6:6 + len(resumed)], sampling


def _generate(stack, plain: bool, **sampling):
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=32, sampling=common_pb2.SamplingParams(**sampling),
        decoding=gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT)
    return stack.gateway.Generate(request, timeout=120)


def test_plain_decoding_applies_the_penalties_and_parallel_decoding_refuses_them(stack, engine):
    free = _generate(stack, plain=True)
    penalised = _generate(stack, plain=True, frequency_penalty=1.0)
    assert penalised.token_ids != free.token_ids
    prompt = engine.tokenizer.encode_chat(PROMPT)
    assert list(penalised.token_ids) == decode_session(engine, prompt, Sampling(frequency_penalty=1.0), 31)[
        :len(penalised.token_ids)]
    with Client(stack.addresses["gateway"], timeout=120) as client:  # the light client sends them as they are
        reply = client.generate(PROMPT, max_new_tokens=32, plain=True, frequency_penalty=1.0)
    assert reply.token_ids == tuple(penalised.token_ids)
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(grpc.RpcError) as refused:
            _generate(stack, plain=False, **{name: 0.5})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(f"sampling.{name} = 0.5: must be 0 with parallel decoding")
        with pytest.raises(grpc.RpcError) as refused:
            _generate(stack, plain=True, **{name: 3.0})
        assert refused.value.details().startswith(f"sampling.{name}: must be in [-2, 2]")


def test_penalties_over_http(front, client):
    model, messages = model_of(front), [{"role": "user", "content": PROMPT}]
    plain = {"parallel_decoding": False}
    free = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                          extra_body=plain)
    penalised = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0,
                                               frequency_penalty=1.0, presence_penalty=0.5, extra_body=plain)
    assert penalised.choices[0].message.content != free.choices[0].message.content
    for fields, rule in (({"frequency_penalty": 0.5}, "must be 0 with parallel decoding"),
                         ({"presence_penalty": -2.5, "extra_body": plain}, "must be in [-2, 2]")):
        with pytest.raises(Exception) as refused:
            client.chat.completions.create(model=model, messages=messages, max_tokens=4, **fields)
        assert getattr(refused.value, "status_code", None) == 400 and rule in str(refused.value)
        assert next(iter(set(fields) - {"extra_body"})) in str(refused.value)
