"""Control tokens in the text on request (gRPC's keep_special_tokens, vLLM's skip_special_tokens
false; gateway/decoding.py): the decoder with literal tokens, then whole answers over gRPC and
HTTP, parallel against plain."""

from __future__ import annotations

import copy

import pytest

from pardec.gateway.decoding import StreamDecoder, text_tokenizer
from pardec.v1 import gateway_pb2

END = "<|im_end|>"  # the bundled model's end of sequence, a control token


def _decoded(tokenizer, tokens, keep: bool, include_stop: bool = False, eos=frozenset(), stop=()) -> tuple[str, str]:
    decoder = StreamDecoder(text_tokenizer(tokenizer, keep), eos, stop, 64, include_stop=include_stop)
    streamed = "".join(decoder.add([token]).text for token in tokens)
    return streamed, decoder.finish_reason


def test_the_decoder_keeps_control_tokens_and_leaves_out_the_one_that_ends(engine):
    tokenizer = engine.tokenizer
    start, end = (tokenizer.encode(mark)[0] for mark in ("<|im_start|>", END))
    tokens = [start, *tokenizer.encode_text("assistant\nHi there"), end]
    assert tokenizer.decode([start, end]) == "" and tokenizer.decode([start, end], skip_special=False) == "<|im_start|>" + END
    assert _decoded(tokenizer, tokens, keep=False) == ("assistant\nHi there", "")
    assert _decoded(tokenizer, tokens, keep=True) == ("<|im_start|>assistant\nHi there" + END, "")
    # Where the control token ends the answer, its text is left out unless asked for, as a stop token's.
    eos = frozenset({end})
    assert _decoded(tokenizer, tokens, keep=True, eos=eos) == ("<|im_start|>assistant\nHi there", "eos")
    assert _decoded(tokenizer, tokens, keep=True, include_stop=True, eos=eos)[0].endswith("there" + END)
    assert _decoded(tokenizer, tokens, keep=False, include_stop=True, eos=eos) == ("assistant\nHi there", "eos")
    # Nor is a stop string found in that text: the answer ended on its end of sequence.
    assert _decoded(tokenizer, tokens, keep=True, eos=eos, stop=(END,)) == ("<|im_start|>assistant\nHi there", "eos")
    assert _decoded(tokenizer, tokens, keep=True, eos=eos, stop=("there",)) == ("<|im_start|>assistant\nHi ", "stop")
    kept = copy.copy(text_tokenizer(tokenizer, True))  # a plain object: copies, and decodes as asked
    assert kept.decode([start]) == "<|im_start|>" and kept.decode([start], skip_special=True) == ""


def _generate(stack, keep: bool, decoding, **fields):
    return stack.gateway.Generate(gateway_pb2.GenerateRequest(
        prompt="Say hi.", max_new_tokens=40, ignore_eos=True, keep_special_tokens=keep, decoding=decoding, **fields),
        timeout=300)


def test_grpc_answers_keep_them_in_parallel_as_in_plain_decoding(stack, engine):
    # Past its end of sequence (ignore_eos) the model writes control tokens: a new turn's.
    plain = _generate(stack, True, gateway_pb2.DECODING_MODE_PLAIN)
    kept = _generate(stack, True, gateway_pb2.DECODING_MODE_DEFAULT)
    skipped = _generate(stack, False, gateway_pb2.DECODING_MODE_DEFAULT)
    assert list(kept.token_ids) == list(plain.token_ids) == list(skipped.token_ids)
    assert END in kept.text and kept.text == plain.text
    assert kept.text == engine.tokenizer.decode(kept.token_ids, skip_special=False)
    assert skipped.text == engine.tokenizer.decode(kept.token_ids) and END not in skipped.text
    stopped = stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt="Say hi.", max_new_tokens=40,
                                                                 keep_special_tokens=True), timeout=300)
    assert stopped.finish_reason == "eos" and not stopped.text.endswith(END)
    assert stopped.text == engine.tokenizer.decode(stopped.token_ids[:-1], skip_special=False)


def test_http_skip_special_tokens_false(client, engine):
    model = client.models.list().data[0].id
    fields = {"ignore_eos": True, "skip_special_tokens": False}
    messages = [{"role": "user", "content": "Say hi."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                           extra_body={**fields, "return_token_ids": True})
    ids, text = reply.choices[0].model_extra["token_ids"], reply.choices[0].message.content
    assert text == engine.tokenizer.decode(ids, skip_special=False) and END in text
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                              stream=True, extra_body=fields)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == text
    import openai

    with pytest.raises(openai.BadRequestError, match="skip_special_tokens: must be true or false"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"skip_special_tokens": "no"})
