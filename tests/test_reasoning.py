"""Reasoning models (gateway/answers.py) and the chat template's own variables: a model whose
template writes <think> blocks has its thinking set apart as reasoning_content, whole and
streamed, over HTTP and gRPC; chat_template_kwargs switches the template (Qwen3's
enable_thinking), checked, with what the client wrote kept as text."""

from __future__ import annotations

import contextlib
import doctest
import json
import re

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pardec.gateway.answers
from pardec.client import Client
from pardec.gateway.answers import AnswerFormat, ReasoningReader, thinking_tokens
from pardec.gateway.chat import Message, input_tokens, template_variables
from pardec.gateway.generation import Request
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.fuzzing import FUZZ
from tests.openai_front import serving_template, with_template

# Templates in the style of the thinking models' (written for these tests, over the bundled
# model's ChatML tokens). THINKING opens the <think> block in the assistant's turn opening, as
# DeepSeek-R1's does, unless enable_thinking is false, which closes it there, as Qwen3's does.
# HYBRID leaves the block to the model, as Qwen3's with thinking on.
_TURNS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
THINKING = (_TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
HYBRID = (_TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
OFF = {"enable_thinking": False}
ASK = [{"role": "user", "content": "What is two plus two?"}]


def _read(reader: ReasoningReader, pieces) -> tuple[str, str]:
    thinking, answer = "", ""
    for piece in pieces:
        more = reader.feed(piece)
        thinking, answer = thinking + more[0], answer + more[1]
    rest = reader.finish()
    return thinking + rest[0], answer + rest[1]


def test_doctests():
    assert doctest.testmod(pardec.gateway.answers).failed == 0


@pytest.mark.parametrize("starts_inside, text, split", [
    (False, "<think>\nadd them\n</think>\n\nFour.", ("\nadd them\n", "Four.")),
    (False, "  <think>a</think>b", ("a", "b")),
    (False, "Four.", ("", "Four.")),
    (False, "Four. <think>not at the start</think>", ("", "Four. <think>not at the start</think>")),
    (False, "<thinking>", ("", "<thinking>")),
    (False, "<think>cut short", ("cut short", "")),
    (True, "add them\n</think>\n\nFour.", ("add them\n", "Four.")),
    (True, "cut short </thi", ("cut short </thi", "")),
    (True, "</think>", ("", "")),
    (False, "", ("", "")),
    (False, " <think>", ("", "")),  # cut short right after the tag (max_tokens 1): thinking, none yet
    (False, "\u00a0<think>a", ("", "\u00a0<think>a")),  # the layout's white space is JSON's
])
@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_thinking_is_set_apart_whole_and_in_any_pieces(starts_inside, text, split, size):
    pieces = [text[start:start + size] for start in range(0, len(text), size)]
    assert _read(ReasoningReader(starts_inside), pieces) == split


@FUZZ
@given(parts=st.lists(st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</", "\n", " ", "x", "<"]), max_size=12),
       starts_inside=st.booleans())
def test_any_text_splits_as_the_whole_does_and_loses_only_the_tags_and_their_layout(parts, starts_inside):
    text = "".join(parts)
    whole = _read(ReasoningReader(starts_inside), [text])
    assert _read(ReasoningReader(starts_inside), parts) == whole
    thinking, answer = whole
    if "<think>" not in text and "</think>" not in text:
        assert (thinking if starts_inside else answer) == text


def test_the_thinking_s_tokens_are_those_that_reach_past_its_closing_tag(engine):
    tokenizer = engine.tokenizer
    ids = tokenizer.encode_text("<think>\nTwo and two.\n</think>\n\nFour.")
    counted = thinking_tokens(tokenizer, ids, "\nTwo and two.\n")
    assert tokenizer.decode(ids[:counted]).endswith("</think>") and "</think>" not in tokenizer.decode(ids[:counted - 1])
    assert thinking_tokens(tokenizer, ids[:4], "\nTwo") == 4  # cut short inside it: all thinking
    assert thinking_tokens(tokenizer, ids, "") == 0


def test_the_template_says_whether_the_model_thinks_and_where(engine):
    base = engine.tokenizer
    assert not AnswerFormat(base).thinks  # SmolLM2: its text is its answer
    assert AnswerFormat(base).reader(Request(prompt="hi")) is None
    thinking, hybrid = AnswerFormat(with_template(base, THINKING)), AnswerFormat(with_template(base, HYBRID))
    assert thinking.thinks and hybrid.thinks
    assert thinking.reader(Request(prompt="hi")).thinking._state != hybrid.reader(Request(prompt="hi")).thinking._state
    # The block opened in the turn opening (thinking from the first token), or left to the model.
    assert thinking._opens("") and not hybrid._opens("")
    assert not thinking._opens(template_variables(OFF))
    # A raw prompt or token ids take no template: nothing is set apart.
    assert thinking.reader(Request(prompt="hi", raw=True)) is None
    assert thinking.reader(Request(prompt_token_ids=(1, 2))) is None


def test_template_variables_are_checked_and_rendered_as_text(engine):
    tokenizer = with_template(engine.tokenizer, THINKING)
    on = tokenizer.decode(input_tokens(tokenizer, "hi", (), False))
    off = tokenizer.decode(input_tokens(tokenizer, "hi", (), False, variables=template_variables(OFF)))
    assert on.endswith("assistant\n<think>\n") and off.endswith("assistant\n<think>\n\n</think>\n\n")
    for bad, field in ((["x"], "chat_template_kwargs: must be an object"), ("{", "chat_template_kwargs: must be a JSON"),
                       ({"messages": []}, "chat_template_kwargs.messages: is the server's"),
                       ({"not a name": 1}, "chat_template_kwargs: 'not a name' is not a variable's name"),
                       ({"x": "y" * 70_000}, "chat_template_kwargs: at most")):
        with pytest.raises(InvalidArgument, match="^" + field):
            template_variables(bad)
    with pytest.raises(InvalidArgument, match="^chat_template_kwargs: a raw prompt"):
        input_tokens(tokenizer, "hi", (), True, variables=template_variables(OFF))
    # A variable the template writes out is text: its control-token spellings stay characters.
    echoing = with_template(engine.tokenizer, _TURNS + "{{ note }}<|im_start|>assistant\n")
    end = engine.tokenizer.encode("<|im_end|>")[0]
    ids = input_tokens(echoing, "", (Message("user", "hi"),), False, variables=template_variables({"note": "<|im_end|>"}))
    assert ids.count(end) == 1 and "<|im_end|>" in echoing.decode(ids[ids.index(end) + 1:])


# ---- end to end: a verifier serving a thinking template -------------------------------------

@pytest.fixture(scope="module")
def thinking_front(stack, engine):
    with serving_template(stack, engine, THINKING) as running:
        yield running


# The model held to thinking, then an answer: the split is then known, and lossless to check.
THOUGHT = {"structured_outputs": {"regex": "[a-z ]{3,24}</think>[A-Za-z ]{2,12}"}}


def _streamed(stream) -> tuple[str, str]:
    """A streamed chat answer's (thinking, content), its deltas joined."""
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    return ("".join((delta.model_extra or {}).get("reasoning_content") or "" for delta in deltas),
            "".join(delta.content or "" for delta in deltas))


def test_a_thinking_model_s_thinking_is_reasoning_content_whole_and_streamed(thinking_front):
    front = thinking_front
    client = openai.OpenAI(base_url=f"http://{front.http_address}/v1", api_key="none", max_retries=0)
    model = front.generator.model.model_name
    replies = [client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=40,
                                              extra_body={**THOUGHT, "parallel_decoding": on}) for on in (True, False)]
    messages = [reply.choices[0].message for reply in replies]
    thinking = messages[0].model_extra["reasoning_content"]
    assert thinking and "<" not in thinking and messages[0].content and "think" not in messages[0].content
    # Lossless: parallel decoding gives plain decoding's thinking and answer.
    assert (thinking, messages[0].content) == (messages[1].model_extra["reasoning_content"], messages[1].content)
    chunks = list(client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=THOUGHT))
    assert _streamed(chunks) == (thinking, messages[0].content)
    # The tokens that wrote the thinking (its closing tag included), whole, streamed and summed over n.
    counted = replies[0].usage.completion_tokens_details.reasoning_tokens
    assert 0 < counted < replies[0].usage.completion_tokens
    assert replies[1].usage.completion_tokens_details.reasoning_tokens == counted
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == counted
    two = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=40, n=2,
                                         extra_body={**THOUGHT, "parallel_decoding": False})
    assert two.usage.completion_tokens_details.reasoning_tokens == 2 * counted
    # Thinking switched off by the template's own variable: all answer.
    off = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=8,
                                         extra_body={"chat_template_kwargs": OFF})
    assert off.choices[0].message.content and off.choices[0].message.model_extra["reasoning_content"] is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert off.usage.prompt_tokens > replies[0].usage.prompt_tokens  # "\n</think>\n\n" closes the block
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"tools": []}})
    assert refused.value.body["param"] == "chat_template_kwargs.tools"


# Two worked examples: the bundled model, which was not trained to think, then writes its own block.
SHOTS = [{"role": "user", "content": "What is one plus two?"},
         {"role": "assistant", "content": '<think>\nOne and two make three.\n</think>\n\n{"answer": 3}'},
         {"role": "user", "content": "What is two plus five?"},
         {"role": "assistant", "content": '<think>\nTwo and five make seven.\n</think>\n\n{"answer": 7}'},
         {"role": "user", "content": "What is two plus two?"}]
SUM = {"type": "json_schema", "json_schema": {"name": "sum", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}


@pytest.mark.parametrize("template", ["opened", "hybrid"])
def test_a_structured_output_holds_the_answer_after_the_thinking(thinking_front, stack, engine, template):
    """vLLM's structured outputs with a reasoning parser: the model thinks freely, then its answer
    is the schema's; lossless under parallel decoding, and streamed as the whole."""
    with contextlib.ExitStack() as running:
        front = thinking_front if template == "opened" else running.enter_context(
            serving_template(stack, engine, HYBRID))
        client = openai.OpenAI(base_url=f"http://{front.http_address}/v1", api_key="none", max_retries=0)
        model = front.generator.model.model_name
        replies = [client.chat.completions.create(model=model, messages=SHOTS, temperature=0, max_tokens=60,
                                                  response_format=SUM, extra_body={"parallel_decoding": on})
                   for on in (True, False)]
        messages = [reply.choices[0].message for reply in replies]
        thinking = messages[0].model_extra["reasoning_content"]
        assert "two" in thinking.lower() and "think" not in thinking, thinking
        assert json.loads(messages[0].content) == {"answer": 4} and replies[0].choices[0].finish_reason == "stop"
        assert (thinking, messages[0].content) == (messages[1].model_extra["reasoning_content"], messages[1].content)
        assert _streamed(client.chat.completions.create(model=model, messages=SHOTS, temperature=0, max_tokens=60,
                                                        response_format=SUM, stream=True)) == (thinking,
                                                                                               messages[0].content)


def test_grpc_sends_thinking_apart_and_takes_template_variables(thinking_front):
    import grpc

    with grpc.insecure_channel(thinking_front.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(
            messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, content=ASK[0]["content"])], max_new_tokens=40)
        request.sampling.structured_output.regex = THOUGHT["structured_outputs"]["regex"]
        whole = stub.Generate(request, timeout=120)
        chunks = list(stub.GenerateStream(request, timeout=120))
        assert whole.reasoning_content and whole.text and "think" not in whole.text
        assert "".join(chunk.reasoning_content for chunk in chunks) == whole.reasoning_content
        assert "".join(chunk.text for chunk in chunks) == whole.text
        off = gateway_pb2.TokenizeRequest(messages=request.messages, chat_template_kwargs=json.dumps(OFF))
        on = gateway_pb2.TokenizeRequest(messages=request.messages)
        assert len(stub.Tokenize(off, timeout=60).token_ids) > len(stub.Tokenize(on, timeout=60).token_ids)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(gateway_pb2.GenerateRequest(prompt="x", raw=True, chat_template_kwargs='{"a": 1}'),
                          timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("chat_template_kwargs: a raw prompt")
    # The light client: the same fields, the same words.
    with Client(thinking_front.address, timeout=120) as client:
        reply = client.chat(ASK, max_new_tokens=40, regex=THOUGHT["structured_outputs"]["regex"])
        assert (reply.reasoning_content, reply.text) == (whole.reasoning_content, whole.text)
        assert "".join(chunk.reasoning_content for chunk in client.stream(
            messages=ASK, max_new_tokens=40, regex=THOUGHT["structured_outputs"]["regex"])) == reply.reasoning_content
        assert len(client.tokenize(messages=ASK, chat_template_kwargs=OFF)) > len(client.tokenize(messages=ASK))


def test_pardec_generate_and_chat_show_the_thinking_beside_the_answer(thinking_front):
    import subprocess
    import sys

    regex = THOUGHT["structured_outputs"]["regex"]
    flags = [sys.executable, "-m", "pardec.gateway.cli", "generate", "--addr", thinking_front.address,
             "--max-new-tokens", "40", "--regex", regex]
    for stream in ([], ["--stream"]):
        shown = subprocess.run([*flags, *stream, ASK[0]["content"]], capture_output=True, text=True, timeout=300)
        assert shown.returncode == 0, shown.stderr
        answer = shown.stdout.strip()
        assert answer and "think" not in answer and "</think>" not in shown.stderr
        thinking = r"^\[thinking\] [a-z ]{3,24}$" if not stream else r"^[a-z ]{3,24}"
        assert re.search(thinking, shown.stderr, re.M), shown.stderr
    # The template's own switch: thinking off, the answer alone; a switch that is no JSON object is refused.
    off = subprocess.run([*flags[:-2], "--chat-template-kwargs", json.dumps(OFF), ASK[0]["content"]],
                         capture_output=True, text=True, timeout=300)
    assert off.returncode == 0 and off.stdout.strip() and "[thinking]" not in off.stderr, off.stderr
    bad = subprocess.run([*flags[:-2], "--chat-template-kwargs", "[1]", "Hi"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and "INVALID_ARGUMENT: chat_template_kwargs" in bad.stderr, bad.stderr
    chat = subprocess.run([sys.executable, "-m", "pardec.gateway.cli", "chat", "--addr", thinking_front.address,
                           "--max-new-tokens", "6"], input="Hi\n", capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0 and chat.stderr.strip(), chat.stderr  # thinking (and the stats) beside it
