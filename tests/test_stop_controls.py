"""Where an answer ends, through the real stack: ignore_eos generates past the model's end of
sequence to max_new_tokens (the tokens parallel decoding commits there are plain decoding's too),
stop_token_ids end it at a token, include_stop_str_in_output keeps what ended it; on gRPC, over
HTTP (vLLM's field names) and from the light client. Bad values are refused naming the field."""

from __future__ import annotations

import grpc
import pytest

from pardec.client import Client
from pardec.v1 import gateway_pb2
from tests.openai_front import model_of

PROMPT = "Answer with one word: what colour is the sky?"  # a short answer, then end of sequence
TIMEOUT_S = 300


def generate(stack, plain=False, **fields) -> gateway_pb2.GenerateResponse:
    mode = gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT
    return stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, decoding=mode, **fields), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def ended(stack):
    """The plain answer that ends at the model's end of sequence, and the one that goes on."""
    short = generate(stack, plain=True, max_new_tokens=48)
    assert short.finish_reason == "eos" and len(short.token_ids) < 40, short
    longer = generate(stack, plain=True, max_new_tokens=48, ignore_eos=True)
    return short, longer


def test_ignore_eos_generates_to_max_new_tokens_and_parallel_decoding_keeps_every_token(stack, ended):
    short, longer = ended
    assert longer.finish_reason == "length" and len(longer.token_ids) == 48
    # Up to and with the end-of-sequence token, the same answer; then the model's continuation.
    assert list(longer.token_ids[: len(short.token_ids)]) == list(short.token_ids)
    parallel = generate(stack, max_new_tokens=48, ignore_eos=True)
    assert list(parallel.token_ids) == list(longer.token_ids) and parallel.text == longer.text
    assert parallel.stats.decoding_method == "memory_decoding"


def test_a_stop_token_ends_the_answer_with_its_text_only_if_asked(stack, ended):
    _, longer = ended
    at = len(longer.token_ids) // 2
    stop = longer.token_ids[at]
    first = list(longer.token_ids).index(stop)  # the first time the answer writes that token
    cut = generate(stack, max_new_tokens=48, ignore_eos=True, stop_token_ids=[stop])
    assert cut.finish_reason == "stop" and list(cut.token_ids) == list(longer.token_ids[: first + 1])
    kept = generate(stack, max_new_tokens=48, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert list(kept.token_ids) == list(cut.token_ids)
    assert kept.text.startswith(cut.text) and longer.text.startswith(kept.text)
    assert len(kept.text) > len(cut.text) or not kept.text.strip()  # the token's own text, if it has any


def test_a_stop_string_is_kept_when_asked(stack, ended):
    _, longer = ended
    word = longer.text.split()[len(longer.text.split()) // 2]
    cut = generate(stack, max_new_tokens=48, ignore_eos=True, stop=[word])
    kept = generate(stack, max_new_tokens=48, ignore_eos=True, stop=[word], include_stop_str_in_output=True)
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + word and longer.text.startswith(kept.text)


@pytest.mark.parametrize("fields, field_name, rule", [
    ({"stop_token_ids": [49152]}, "stop_token_ids[0]", "not a token of the model"),
    ({"stop_token_ids": list(range(17))}, "stop_token_ids", "at most 16"),
])
def test_bad_stop_token_ids_are_refused_naming_the_field(stack, fields, field_name, rule):
    with pytest.raises(grpc.RpcError) as caught:
        generate(stack, max_new_tokens=4, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in caught.value.details() and rule in caught.value.details()


def test_the_http_api_takes_vllms_fields(front, client, ended):
    _, longer = ended
    model = model_of(front)
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 48
    assert reply.choices[0].message.content == longer.text
    stop = longer.token_ids[len(longer.token_ids) // 2]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0,
                                           extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert reply.choices[0].finish_reason == "stop" and longer.text.startswith(reply.choices[0].message.content)
    import openai

    for body, field_name in (({"stop_token_ids": "7"}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
                             ({"include_stop_str_in_output": 1}, "include_stop_str_in_output")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=messages, max_tokens=4, extra_body=body)
        assert field_name in str(caught.value)


def test_the_light_client_sends_them(stack, ended):
    _, longer = ended
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        reply = client.generate(PROMPT, max_new_tokens=48, ignore_eos=True)
        assert list(reply.token_ids) == list(longer.token_ids) and reply.finish_reason == "length"
        stop = longer.token_ids[len(longer.token_ids) // 2]
        reply = client.generate(PROMPT, max_new_tokens=48, ignore_eos=True, stop_token_ids=[stop],
                                include_stop_str_in_output=True)
        assert reply.finish_reason == "stop" and longer.text.startswith(reply.text)
