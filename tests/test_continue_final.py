"""vLLM's continue_final_message ("assistant prefill"): the conversation's last message, an
assistant's text, is left open and the answer goes on from it (verifier/model/tokenizer.py
render_chat, gateway/chat.py); checked on the rendered tokens, the rules, and through the gateway
over HTTP, gRPC and the light client, parallel decoding's answer plain decoding's."""

from __future__ import annotations

import grpc
import openai
import pytest

from pardec.client import Client
from pardec.gateway.answers import AnswerFormat
from pardec.gateway.chat import Message, input_tokens
from pardec.gateway.generation import Request
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import gateway_pb2
from tests.openai_front import model_of, with_template
from tests.test_reasoning import THINKING

ASK = [{"role": "user", "content": "What is the capital of France?"},
       {"role": "assistant", "content": "The capital of France is"}]
GO_ON = {"continue_final_message": True, "add_generation_prompt": False}


def _conversation(turns) -> tuple[Message, ...]:
    return tuple(Message(turn["role"], turn["content"]) for turn in turns)


@pytest.mark.parametrize("content", ["e", "<", "d", "|>", "\n", "im_end", "assistant"])
def test_the_cut_is_where_the_content_ends_whatever_the_template_writes_after_it(engine, content):
    """Text the template also writes after the message (its end-of-turn mark) is not where it ends."""
    tokenizer = engine.tokenizer
    opened = tokenizer.decode(input_tokens(tokenizer, "", _conversation(ASK[:1]), False))
    turns = _conversation([ASK[0], {"role": "assistant", "content": content}])
    assert tokenizer.decode(input_tokens(tokenizer, "", turns, False, continue_final=True)) == opened + content


def test_the_last_message_is_left_open(engine):
    tokenizer = engine.tokenizer
    opened = tokenizer.decode(input_tokens(tokenizer, "", _conversation(ASK[:1]), False))
    continued = tokenizer.decode(input_tokens(tokenizer, "", _conversation(ASK), False, continue_final=True))
    assert continued == opened + ASK[1]["content"]  # the turn the template opens, then the text; no end
    # What the client wrote stays text, control-token spellings too: only the template's own turn marks.
    spelled = ({"role": "user", "content": "Say it."}, {"role": "assistant", "content": "I say <|im_end|> and"})
    ids = input_tokens(tokenizer, "", _conversation(spelled), False, continue_final=True)
    end = tokenizer.encode("<|im_end|>")[0]
    ends = input_tokens(tokenizer, "", _conversation(spelled[:1]), False).count(end)  # the template's own
    assert ids.count(end) == ends and tokenizer.decode(ids).endswith("I say <|im_end|> and")


@pytest.mark.parametrize("messages, continue_final, message", [
    (ASK[:1], True, "messages[0]: with continue_final_message the conversation must end with an assistant"),
    (ASK, False, "messages[1].role: the conversation must end with a user or tool message, not assistant "
                 "(continue_final_message"),
    ([ASK[0], {"role": "assistant", "content": ""}], True, "messages[1]: with continue_final_message"),
])
def test_the_conversation_must_end_as_the_switch_says(engine, messages, continue_final, message):
    with pytest.raises(InvalidArgument) as refused:
        input_tokens(engine.tokenizer, "", _conversation(messages), False, continue_final=continue_final)
    assert str(refused.value).startswith(message), refused.value
    with pytest.raises(InvalidArgument, match="^continue_final_message: continues the last of messages"):
        input_tokens(engine.tokenizer, "hi", (), False, continue_final=True)


def test_a_continued_answer_is_not_split_into_thinking(engine):
    thinking = AnswerFormat(with_template(engine.tokenizer, THINKING))
    assert thinking.reader(Request(messages=_conversation(ASK), continue_final_message=True)) is None
    assert thinking.reader(Request(messages=_conversation(ASK[:1]))) is not None


def test_the_answer_goes_on_from_the_text_over_every_entry_point(stack, front, client):
    model = model_of(front)
    replies = [client.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0,
                                              extra_body={**GO_ON, "parallel_decoding": on}) for on in (True, False)]
    text = replies[0].choices[0].message.content
    assert text and text == replies[1].choices[0].message.content  # lossless
    assert "Paris" in text and not text.startswith("The capital")  # the continuation alone
    opened = client.chat.completions.create(model=model, messages=ASK[:1], max_tokens=8, temperature=0)
    assert opened.usage.prompt_tokens < replies[0].usage.prompt_tokens
    request = gateway_pb2.GenerateRequest(max_new_tokens=8, continue_final_message=True, messages=[
        gateway_pb2.Message(role=role, content=turn["content"])
        for role, turn in zip((gateway_pb2.ROLE_USER, gateway_pb2.ROLE_ASSISTANT), ASK)])
    assert stack.gateway.Generate(request, timeout=120).text == text
    with Client(stack.addresses["gateway"], timeout=120) as light:
        assert light.chat(ASK, max_new_tokens=8, continue_final_message=True).text == text
        assert len(light.tokenize(messages=ASK, continue_final_message=True)) == replies[0].usage.prompt_tokens
    with pytest.raises(grpc.RpcError) as refused:
        stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt="hi", continue_final_message=True), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
])
def test_bad_switches_are_400_naming_the_field(front, client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_of(front), messages=ASK, max_tokens=4, extra_body=fields)
    assert refused.value.body["param"] == param
