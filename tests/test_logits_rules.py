"""The verifier's rules on logits (verifier/engine/acceptance.py constrain): min_tokens holds the
stop tokens back, logit_bias shifts a token, allowed_token_ids keeps only some. Each row's own,
so parallel decoding under them stays token-for-token plain decoding's; checked on literal
arrays, through the gateway over gRPC (memory_decoding against plain) and over HTTP."""

from __future__ import annotations

import grpc
import pytest
import torch

from pardec.v1 import common_pb2, gateway_pb2
from pardec.verifier.api import Sampling
from pardec.verifier.engine.acceptance import accept_step, constrain, tree_layout
from tests.openai_front import model_of

PROMPT = "What is the capital of France?"


def test_min_tokens_holds_stop_tokens_back_in_the_rows_before_it():
    rules = Sampling(min_tokens=5, stop_token_ids=(0, 2))
    depths = torch.tensor([0, 1, 2, 1])
    out = constrain(torch.zeros(4, 4), depths, 3, rules)  # rows predict tokens 3, 4, 5, 4
    assert out[:, 0].tolist() == [float("-inf"), float("-inf"), 0.0, float("-inf")]
    assert out[:, 2].tolist() == out[:, 0].tolist() and out[:, 1].tolist() == [0.0] * 4
    assert constrain(torch.zeros(2, 4), torch.tensor([0, 1]), 5, rules).tolist() == [[0.0] * 4] * 2
    # Greedy acceptance walks the constrained rows: the stop token 0 is never chosen early.
    logits = torch.tensor([[9.0, 1, 0, 0], [9.0, 0, 1, 0], [9.0, 0, 0, 1]])
    layout = tree_layout(3, [1, 2], [-1, 0], vocab_size=4)
    accepted, _ = accept_step(logits, layout, [3, 1, 2], None, Sampling(min_tokens=2, stop_token_ids=(0,)), None)
    assert (accepted.accepted_rows, accepted.bonus_token) == ([1, 2], 0)  # row 2 predicts token 2: 0 is allowed


def test_logit_bias_and_allowed_tokens_apply_to_every_row():
    out = constrain(torch.zeros(2, 3), torch.tensor([0, 1]), 0,
                    Sampling(logit_bias=((0, -100.0), (2, 1.5)), allowed_token_ids=(0, 2)))
    assert out.tolist() == [[-100.0, float("-inf"), 1.5]] * 2
    assert constrain(torch.ones(1, 2), torch.tensor([0]), 0, Sampling()).tolist() == [[1.0, 1.0]]
    with pytest.raises(Exception, match=r"sampling.logit_bias\[3\]: must be in \[-100, 100\]"):
        Sampling(logit_bias=((3, 100.5),))


def _generate(stack, plain: bool, max_new: int = 48, **sampling):
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT, max_new_tokens=max_new, sampling=common_pb2.SamplingParams(**sampling),
        decoding=gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT)
    return stack.gateway.Generate(request, timeout=120)


def test_rules_through_the_gateway_are_lossless_under_parallel_decoding(stack, engine):
    eos = set(engine.tokenizer.stop_token_ids)
    free = _generate(stack, plain=True)
    assert free.finish_reason == "eos" and len(free.token_ids) < 32  # the model ends early by itself
    least = len(free.token_ids) + 8
    held = _generate(stack, plain=True, min_tokens=least)
    assert len(held.token_ids) >= least and not eos & set(held.token_ids[: least - 1])
    assert held.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1]  # the same text until its end
    assert _generate(stack, plain=False, min_tokens=least).token_ids == held.token_ids

    first = free.token_ids[0]
    banned = _generate(stack, plain=True, logit_bias={first: -100.0})
    assert banned.token_ids[0] != first
    assert _generate(stack, plain=False, logit_bias={first: -100.0}).token_ids == banned.token_ids
    allowed = [first, free.token_ids[1]]
    only = _generate(stack, plain=True, max_new=10, allowed_token_ids=allowed)
    assert set(only.token_ids) <= set(allowed) and only.finish_reason == "length"
    assert _generate(stack, plain=False, max_new=10, allowed_token_ids=allowed).token_ids == only.token_ids

    for fields, field in (({"min_tokens": 49}, "sampling.min_tokens"),
                          ({"logit_bias": {10**6: 1.0}}, "sampling.logit_bias"),
                          ({"allowed_token_ids": [10**6]}, "sampling.allowed_token_ids")):
        with pytest.raises(grpc.RpcError) as refused:
            _generate(stack, plain=False, **fields)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(field), refused.value.details()


def test_rules_over_http(front, client):
    model, messages = model_of(front), [{"role": "user", "content": PROMPT}]
    free = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
    least = free.usage.completion_tokens + 8
    held = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0,
                                          extra_body={"min_tokens": least})
    assert held.usage.completion_tokens >= least and held.choices[0].message.content.startswith(
        free.choices[0].message.content)
    biased = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0,
                                       logit_bias={"12": 100})
    assert biased.usage.completion_tokens == 3
    with pytest.raises(Exception) as refused:
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, logit_bias={"1": 200})
    assert getattr(refused.value, "status_code", None) == 400 and "logit_bias" in str(refused.value)
