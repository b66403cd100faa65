"""Tokenize and Detokenize, on gRPC, over HTTP (vLLM's /tokenize and /detokenize) and from the
light client: the tokens are the ones Generate prefills (its prompt_tokens), the text the one
Generate returns; bad input is refused naming the field, as Generate refuses it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pardec.client import AsyncClient, Client
from pardec.v1 import gateway_pb2
from tests.openai_front import post_json

PROMPT = "Name three sorting algorithms."
TURNS = [gateway_pb2.Message(role=gateway_pb2.ROLE_SYSTEM, content="Answer briefly."),
         gateway_pb2.Message(role=gateway_pb2.ROLE_USER, content=PROMPT)]
TIMEOUT_S = 300


def tokens_of(stack, **fields) -> gateway_pb2.TokenizeResponse:
    return stack.gateway.Tokenize(gateway_pb2.TokenizeRequest(**fields), timeout=TIMEOUT_S)


def prompt_tokens(stack, **fields) -> int:
    request = gateway_pb2.GenerateRequest(max_new_tokens=1, decoding=gateway_pb2.DECODING_MODE_PLAIN, **fields)
    return stack.gateway.Generate(request, timeout=TIMEOUT_S).stats.prompt_tokens


@pytest.mark.parametrize("fields", [{"prompt": PROMPT}, {"messages": TURNS}, {"prompt": PROMPT, "raw": True}],
                         ids=["prompt", "messages", "raw"])
def test_the_tokens_are_the_ones_generate_prefills(stack, fields):
    reply = tokens_of(stack, **fields)
    assert len(reply.token_ids) == prompt_tokens(stack, **fields) > 0
    served = stack.gateway.GetServedModel(gateway_pb2.GetServedModelRequest(), timeout=TIMEOUT_S)
    assert (reply.max_input_tokens, reply.max_seq_len) == (served.max_input_tokens, served.max_seq_len)


def test_detokenize_gives_generates_text(stack):
    answer = stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=24), timeout=TIMEOUT_S)
    text = stack.gateway.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=answer.token_ids), timeout=TIMEOUT_S).text
    assert answer.text and text == answer.text


@pytest.mark.parametrize("call, fields, field_name", [
    ("Tokenize", {"prompt": PROMPT, "messages": TURNS}, "messages"),
    ("Tokenize", {}, "prompt"),
    ("Tokenize", {"messages": TURNS, "raw": True}, "raw"),
    ("Detokenize", {"token_ids": [49152]}, "token_ids[0]"),
    ("Detokenize", {"token_ids": [1] * 100_000}, "token_ids"),
])
def test_bad_input_is_refused_naming_the_field(stack, call, fields, field_name):
    message = (gateway_pb2.TokenizeRequest if call == "Tokenize" else gateway_pb2.DetokenizeRequest)(**fields)
    with pytest.raises(grpc.RpcError) as caught:
        getattr(stack.gateway, call)(message, timeout=TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(field_name), caught.value.details()


def test_the_http_paths_answer_as_vllms(stack, front):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": PROMPT}]
    status, chat = post_json(front, "/tokenize", {"messages": messages})
    assert status == 200 and chat["tokens"] == list(tokens_of(stack, messages=TURNS).token_ids)
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == tokens_of(stack, prompt="x").max_seq_len
    status, raw = post_json(front, "/tokenize", {"prompt": PROMPT})  # as /v1/completions: text, no template
    assert status == 200 and raw["tokens"] == list(tokens_of(stack, prompt=PROMPT, raw=True).token_ids)
    status, text = post_json(front, "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200 and "Name three sorting algorithms." in text["prompt"]
    for path, body, param in (("/detokenize", {"tokens": [49152]}, "tokens"), ("/detokenize", {"tokens": "7"}, "tokens"),
                              ("/tokenize", {"prompt": ""}, "prompt"), ("/tokenize", {"messages": "hi"}, "messages"),
                              ("/tokenize", {"prompt": "hi", "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [1], "model": "other"}, "model")):
        status, error = post_json(front, path, body)
        assert status in (400, 404) and error["error"]["param"].startswith(param), (path, body, error)


def test_the_light_client_round_trips(stack):
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        tokens = client.tokenize(messages=[{"role": "user", "content": PROMPT}])
        assert tokens == client.tokenize(PROMPT) == list(tokens_of(stack, prompt=PROMPT).token_ids)
        assert PROMPT in client.detokenize(tokens)

    async def run():
        async with AsyncClient(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
            return await client.tokenize(PROMPT, raw=True), await client.detokenize([])

    assert asyncio.run(run()) == (list(tokens_of(stack, prompt=PROMPT, raw=True).token_ids), "")
