"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens:
gateway/anthropic_messages.py, anthropic_events.py, http_anthropic.py): a body means the chat
request it names, checked on literal bodies; through Anthropic's own SDK, unmodified, a message is
the chat completion's answer, lossless under parallel decoding and streamed as the whole, with a
prefill continued, stop sequences named, tool calls as tool_use blocks, a thinking model's thinking
as a thinking block, and errors in Anthropic's shape naming the Messages body's fields."""

from __future__ import annotations

import doctest
import json

import anthropic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pardec.gateway import anthropic_messages
from pardec.gateway.anthropic_events import MessageEvents
from pardec.gateway.anthropic_messages import FIELDS, chat_body, renamed
from pardec.gateway.answers import AnswerReader
from pardec.gateway.call_layouts import HERMES, reader_for
from pardec.gateway.outputs import Chunk, Stats
from pardec.gateway.tools import Tool, ToolUse
from pardec.gateway.server import start_gateway
from pardec.runtime.errors import InvalidArgument
from pardec.runtime.security import BearerTokens
from tests.fuzzing import FUZZ
from tests.openai_front import TOKEN, gateway_config, model_of, serving_template
from tests.test_reasoning import SHOTS, THINKING

ASK = "What is the capital of France?"
GREEDY = {"temperature": 0}  # Anthropic's SDK sends no temperature of its own: the server's default is 1.0
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(front):
    with anthropic.Anthropic(base_url=f"http://{front.http_address}", api_key="unused", max_retries=0,
                             timeout=300) as client:
        yield client


def test_a_body_means_the_chat_request_it_names():
    assert doctest.testmod(anthropic_messages).failed == 0
    chat, names = chat_body({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief.", "cache_control": {
            "type": "ephemeral"}}], "stop_sequences": ["\n\n"], "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"},
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "s"},
                                              {"type": "text", "text": "Let me see."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                         {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                          "content": [{"type": "text", "text": "no wind data"}]},
                                         {"type": "text", "text": "And tomorrow?"}]},
            {"role": "assistant", "content": "Tomorrow"}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no wind data"},
        {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "Tomorrow"}]
    assert names == ["system", "messages[0]", "messages[1]", "messages[2].content[0]", "messages[2].content[1]",
                     "messages[2]", "messages[3]"]
    assert (chat["continue_final_message"], chat["add_generation_prompt"]) == (True, False)  # the prefill
    assert chat["max_completion_tokens"] == 9 and chat["stop"] == ["\n\n"] and chat["include_stop_str_in_output"]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER[
        "input_schema"], "description": WEATHER["description"]}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": {
        "type": "object"}}}
    assert str(renamed(InvalidArgument("messages[4].tool_call_id: no"), names)) == \
        "messages[2].content[1].tool_use_id: no"
    assert str(renamed(InvalidArgument("tools[0].function.parameters: bad"), names)) == "tools[0].input_schema: bad"
    assert str(renamed(InvalidArgument("max_new_tokens = 9000: too many"), names)) == "max_tokens = 9000: too many"
    assert str(renamed(InvalidArgument("stop: at most 16"), names)) == "stop_sequences: at most 16"
    named = chat_body({"max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}],
                       "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {
                           "type": "enabled", "budget_tokens": 2048}, "chat_template_kwargs": {"enable_thinking": False}})[0]
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert named["chat_template_kwargs"] == {"enable_thinking": False}  # the client's own variables win
    assert named["thinking_token_budget"] == 2048  # the budget bounds the thinking
    assert "continue_final_message" not in named
    counted, _ = chat_body({"messages": [{"role": "user", "content": "hi"}], "context_management": {"edits": [
        {"type": "clear_tool_uses_20250919"}]}, "thinking": {"type": "enabled", "budget_tokens": 2048}}, counting=True)
    assert counted["thinking_token_budget"] == 2048  # no max_tokens to count tokens, so none to check it against


def _blocks(events: list[dict]) -> list[tuple[str, str]]:
    """A stream's blocks (kind, text or arguments), checking each event goes to the open block."""
    blocks, open_block = [], None
    for event in events:
        if event["type"] == "content_block_start":
            assert open_block is None and event["index"] == len(blocks), events
            open_block = event["index"]
            blocks.append([event["content_block"]["type"], ""])
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_block, events
            blocks[open_block][1] += next(v for k, v in event["delta"].items() if k != "type")
        elif event["type"] == "content_block_stop":
            assert event["index"] == open_block, events
            open_block = None
    assert open_block is None and events[-1]["type"] == "message_stop", events
    return [tuple(block) for block in blocks]


def test_a_stream_sends_each_delta_to_its_open_block_and_says_why_it_ended():
    tools = ToolUse((Tool("get_weather", parameters=json.dumps(WEATHER["input_schema"])),))

    def streamed(pieces: list[str], finish: str) -> list[dict]:
        events = MessageEvents("m", {}, AnswerReader(None, reader_for(tools, HERMES)), ())
        chunks = [Chunk(piece, [1], finish if last else "", Stats() if last else None, prompt_tokens=5 if not index
                        else 0) for index, last, piece in ((i, i == len(pieces) - 1, p) for i, p in enumerate(pieces))]
        return [event for chunk in chunks for event in events.chunks(chunk)]

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    # A piece holding a call's last arguments and text after it: the deltas go first, to the call's block.
    events = streamed(["Let me check.\n", call, 'ris"}}\n</tool_call>\nDone.'], "eos")
    blocks = _blocks(events)
    assert blocks[:2] == [("text", "Let me check.\n"), ("tool_use", '{"city": "Paris"}')], blocks
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[0]["message"]["usage"]["input_tokens"] == 5 and events[-2]["usage"]["output_tokens"] == 3
    cut = streamed(["Let me check.\n", call], "length")  # cut short inside its call: max_tokens, calls or not
    _blocks(cut)
    assert cut[-2]["delta"]["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens: required"),
    ({"max_tokens": 4, "messages": []}, "messages: required"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, 'messages[0].role: must be "user" or'),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type: 'image' is not a block"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                   "input": {}}]}]},
     "messages[0].content[0].type: 'tool_use' is not a block this server takes in a user message"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                        "input": "[]"}]}]},
     "messages[0].content[0].input: must be an object"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id: names the tool_use block"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                   "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content[0]: only text blocks"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": 7}]}, "messages[0].content: must be a string"),
    ({"max_tokens": 4, "system": "s", "messages": [{"role": "assistant", "content": []}]},
     "messages: no message holds text"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}]},
     "messages: no message holds text"),
    ({"max_tokens": 4, "system": 3, "messages": [{"role": "user", "content": "hi"}]}, "system: must be a string"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}, "temperature: 1.5 is over 1"),
    ({"max_tokens": 4, "temperature": 10**400, "messages": [{"role": "user", "content": "hi"}]}, "temperature: 1000"),
    ({"max_tokens": 4, "stop_sequences": "\n", "messages": [{"role": "user", "content": "hi"}]},
     "stop_sequences: must be an array"),
    ({"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "hi"}]}, "tools[0].type: 'web_search_20250305' is not supported"),
    ({"max_tokens": 4, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "hi"}]},
     "tools[0].input_schema: required"),
    ({"max_tokens": 4, "tool_choice": {"type": "function"}, "messages": [{"role": "user", "content": "hi"}]},
     "tool_choice: must be"),
    ({"max_tokens": 4, "tool_choice": {"type": "tool"}, "messages": [{"role": "user", "content": "hi"}]},
     "tool_choice.name: required"),
    ({"max_tokens": 4000, "thinking": {"type": "enabled", "budget_tokens": 100},
      "messages": [{"role": "user", "content": "hi"}]}, "thinking.budget_tokens: must be an integer >= 1024"),
    ({"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000},
      "messages": [{"role": "user", "content": "hi"}]}, "thinking.budget_tokens: must be an integer >= 1024 and less"),
    ({"max_tokens": 4, "output_config": {"format": {"type": "json_object"}},
      "messages": [{"role": "user", "content": "hi"}]}, "output_config.format: must be"),
    ({"max_tokens": 4, "mcp_servers": [{"type": "url", "url": "http://x"}],
      "messages": [{"role": "user", "content": "hi"}]}, "mcp_servers: MCP servers are not connected here"),
])
def test_what_is_not_served_is_refused_naming_the_field(body, message):
    with pytest.raises(InvalidArgument) as refused:
        chat_body(body)
    assert str(refused.value).startswith(message), refused.value


def test_a_message_is_the_chat_answer_whole_and_streamed(front, client, claude):
    model, asked = model_of(front), [{"role": "user", "content": ASK}]
    chat = client.chat.completions.create(model=model, messages=asked, max_tokens=24, temperature=0)
    whole = claude.messages.create(model=model, messages=asked, max_tokens=24, extra_body=GREEDY)
    assert [block.type for block in whole.content] == ["text"] and whole.content[0].text == chat.choices[0].message.content
    assert whole.id.startswith("msg_") and whole.role == "assistant" and whole.model == model
    assert whole.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    plain = claude.messages.create(model=model, messages=asked, max_tokens=24,
                                   extra_body={**GREEDY, "parallel_decoding": False})
    assert plain.content[0].text == whole.content[0].text  # lossless
    with claude.messages.stream(model=model, messages=asked, max_tokens=24, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens - \
        final.usage.cache_read_input_tokens
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    started = events[0].message.usage  # known at once, and meaning what the final usage means: uncached, cached
    assert started.input_tokens + started.cache_read_input_tokens == chat.usage.prompt_tokens
    assert (started.input_tokens, started.cache_read_input_tokens) == (final.usage.input_tokens,
                                                                       final.usage.cache_read_input_tokens)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert claude.models.list().data[0].id == model
    counted = claude.messages.count_tokens(model=model, messages=asked)
    assert counted.input_tokens == chat.usage.prompt_tokens
    short = claude.messages.create(model=model, messages=asked, max_tokens=2, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_a_stop_sequence_is_named_and_left_out_and_a_prefill_is_continued(front, claude):
    model, asked = model_of(front), [{"role": "user", "content": ASK}]
    text = claude.messages.create(model=model, messages=asked, max_tokens=24, extra_body=GREEDY).content[0].text
    word = text.split()[3]  # a word within the answer, as a stop sequence
    for stops in ([word], ["zzz-never", word]):
        stopped = claude.messages.create(model=model, messages=asked, max_tokens=24, stop_sequences=stops,
                                         extra_body=GREEDY)
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
        assert stopped.content[0].text == text[:text.index(word)]
        with claude.messages.stream(model=model, messages=asked, max_tokens=24, stop_sequences=stops,
                                    extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert (final.content[0].text, final.stop_sequence, final.stop_reason) == (
            stopped.content[0].text, word, "stop_sequence")
    head = text[: len(text) // 2].rstrip()
    continued = claude.messages.create(model=model, messages=[*asked, {"role": "assistant", "content": head}],
                                       max_tokens=24, extra_body=GREEDY)
    assert continued.content[0].text and (head + continued.content[0].text).startswith(text[:len(head) + 4].rstrip())


def test_tool_calls_are_tool_use_blocks_and_their_results_go_back(front, claude):
    model = model_of(front)
    asked = {"model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
             "tools": [WEATHER], "max_tokens": 40, "tool_choice": {"type": "tool", "name": "get_weather"},
             "extra_body": GREEDY}
    whole = claude.messages.create(**asked)
    calls = [block for block in whole.content if block.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(calls[0].input.get("city"), str)
    plain = claude.messages.create(**{**asked, "extra_body": {**GREEDY, "parallel_decoding": False}})
    assert [block.input for block in plain.content if block.type == "tool_use"] == [calls[0].input]  # lossless
    with claude.messages.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(calls[0].name, calls[0].input)]
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta" and
             e.delta.type == "input_json_delta"]
    assert len(parts) > 1 and json.loads("".join(parts)) == calls[0].input  # the arguments as the model writes them
    answered = claude.messages.create(model=model, tools=[WEATHER], max_tokens=16, extra_body=GREEDY, messages=[
        *asked["messages"], {"role": "assistant", "content": [calls[0].model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 24 C."}]}])
    assert answered.content[0].type == "text" and answered.content[0].text
    assert answered.usage.input_tokens + answered.usage.cache_read_input_tokens > whole.usage.input_tokens
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    shaped = claude.messages.create(model=model, messages=[{"role": "user", "content": ASK}], max_tokens=40,
                                    extra_body=GREEDY, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert isinstance(json.loads(shaped.content[0].text)["capital"], str)


def test_errors_are_anthropics_and_name_the_messages_fields(front, claude):
    model = model_of(front)
    for fields, start in (
            ({"max_tokens": 0}, "max_tokens: "),
            ({"max_tokens": 8, "stop_sequences": ["x"] * 40}, "stop_sequences = 40: at most 16"),
            ({"max_tokens": 8, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}, "messages[0].content[0]"),
            ({"max_tokens": 999999}, "max_tokens")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(**{"model": model, "messages": [{"role": "user", "content": "hi"}], **fields})
        body = refused.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith(start), body
    with pytest.raises(anthropic.NotFoundError) as refused:
        claude.messages.create(model="another-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert refused.value.body["error"]["type"] == "not_found_error"


def test_the_token_is_read_from_x_api_key(stack):
    running = start_gateway(gateway_config(stack, tokens=BearerTokens.from_mapping({TOKEN: "tenant-a"})), "127.0.0.1:0",
                            http_address="127.0.0.1:0")
    try:
        base, asked = f"http://{running.http_address}", [{"role": "user", "content": "hi"}]
        with anthropic.Anthropic(base_url=base, api_key="wrong-token-0123456789", max_retries=0) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as refused:
                wrong.messages.create(model=model_of(running), messages=asked, max_tokens=4)
            assert refused.value.body["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=base, api_key=TOKEN, max_retries=0, timeout=300) as client:
            assert client.messages.create(model=model_of(running), messages=asked, max_tokens=4,
                                          extra_body=GREEDY).usage.output_tokens >= 1
            assert client.messages.count_tokens(model=model_of(running), messages=asked).input_tokens > 1
    finally:
        running.stop()


def test_a_thinking_models_thinking_is_a_thinking_block(stack, engine):
    with serving_template(stack, engine, THINKING) as front:
        with anthropic.Anthropic(base_url=f"http://{front.http_address}", api_key="none", max_retries=0,
                                 timeout=300) as claude:
            model = model_of(front)
            whole = claude.messages.create(model=model, messages=SHOTS, max_tokens=40, extra_body=GREEDY)
            assert [block.type for block in whole.content] == ["thinking", "text"], whole.content
            thinking, answer = whole.content[0].thinking, whole.content[1].text
            assert "two" in thinking.lower() and "think" not in answer
            with claude.messages.stream(model=model, messages=SHOTS, max_tokens=40, extra_body=GREEDY) as stream:
                events = list(stream)
                final = stream.get_final_message()
            assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
                ("thinking", thinking), ("text", answer)]
            assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta" and
                           e.delta.type == "thinking_delta") == thinking
            hidden = claude.messages.create(model=model, messages=SHOTS, max_tokens=40, extra_body=GREEDY,
                                            thinking={"type": "adaptive", "display": "omitted"})
            assert [(b.type, getattr(b, "thinking", None)) for b in hidden.content][0] == ("thinking", "")
            assert hidden.content[1].text == answer


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
    ["", "hi", "user", "assistant", "text", "tool_use", "tool_result", "thinking", "image", "any", "tool", "auto",
     "enabled", "disabled", "json_schema", "custom"]), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["type", "role", "content", "text", "id", "name", "input", "tool_use_id", "is_error", "format",
                     "schema", "input_schema", "budget_tokens", "disable_parallel_tool_use"]), inner, max_size=4),
    max_leaves=12)


@FUZZ
@given(st.dictionaries(st.sampled_from(["messages", "system", "tools", "tool_choice", "thinking", "max_tokens",
                                        "stop_sequences", "output_config", "temperature"]), _JSON, max_size=6))
def test_any_body_is_a_chat_body_or_a_refusal_naming_a_messages_field(body):
    try:
        chat, names = chat_body(body)
    except InvalidArgument as error:
        assert str(error).split(":")[0].split(".")[0].split("[")[0].split(" ")[0] in FIELDS | {"body"}, error
        return
    assert len(names) == len(chat["messages"]) and all(name == "system" or name.startswith("messages[")
                                                       for name in names)
