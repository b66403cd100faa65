"""OpenAI's Responses API (POST /v1/responses: gateway/openai_responses.py, openai_response_events.py,
http_responses.py): a body means the chat request it names, checked on literal bodies; through the
OpenAI SDK, a response is the chat completion's answer, streamed as the whole, with tool calls as
function_call items, a thinking model's thinking as a reasoning item, and errors naming the
Responses body's fields."""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pardec.gateway.openai_responses import FIELDS, chat_body, renamed
from pardec.runtime.errors import InvalidArgument
from tests.fuzzing import FUZZ
from tests.openai_front import model_of, serving_template
from tests.test_reasoning import SHOTS, THINKING

ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_body_means_the_chat_request_it_names():
    chat, names = chat_body({
        "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0, "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                              "text": "Paris?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert names == ["instructions", "input[0]", "input[2]", "input[4]"]  # the reasoning item is not sent back
    assert chat["max_completion_tokens"] == 9 and chat["temperature"] == 0
    assert chat["tools"] == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                       "parameters")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert str(renamed(InvalidArgument("messages[3].tool_call_id: no"), names)) == "input[4].call_id: no"
    assert str(renamed(InvalidArgument("max_completion_tokens: must be >= 1"), names)) == "max_output_tokens: must be >= 1"


@pytest.mark.parametrize("body, message", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id: responses are not stored here"),
    ({"input": "hi", "background": True}, "background: "),
    ({"input": "hi", "truncation": "auto"}, "truncation: only \"disabled\""),
    ({"input": []}, "input: required"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]: only text"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type: 'web_search_call' is not an item"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type: 'web_search' is not supported"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format: must be"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments: must be a JSON object's text"),
    ({"input": [{"type": "function_call", "call_id": 7, "name": "f", "arguments": "{}"}]}, "input[0].call_id: "),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id: names the function_call"),
    ({"input": [{"role": {"a": 1}, "content": "hi"}]}, "input[0].role: must be one of"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}, "input[0].output: must be"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "image"}]}]},
     'input[0].output[0]: only text parts {"type": "input_text"'),
])
def test_what_is_not_served_is_refused_naming_the_field(body, message):
    with pytest.raises(InvalidArgument) as refused:
        chat_body(body)
    assert str(refused.value).startswith(message), refused.value


def test_a_response_is_the_chat_answer_whole_and_streamed(front, client):
    model = model_of(front)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": ASK}], max_tokens=24,
                                          temperature=0)
    whole = client.responses.create(model=model, input=ASK, max_output_tokens=24, temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.status == "completed"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                     chat.usage.completion_tokens)
    plain = client.responses.create(model=model, input=ASK, max_output_tokens=24, temperature=0,
                                    extra_body={"parallel_decoding": False})
    assert plain.output_text == whole.output_text  # lossless
    with client.responses.stream(model=model, input=ASK, max_output_tokens=24, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == whole.output_text
    short = client.responses.create(model=model, input=ASK, max_output_tokens=2, temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_tool_calls_are_function_call_items_and_their_outputs_go_back(front, client):
    model = model_of(front)
    asked = {"model": model, "input": "What is the weather in Paris?", "tools": [WEATHER], "temperature": 0,
             "max_output_tokens": 40, "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = client.responses.create(**asked)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    events = list(client.responses.create(**asked, stream=True))
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [(item.name, item.arguments) for item in done if item.type == "function_call"] == [
        (calls[0].name, calls[0].arguments)]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == calls[0].arguments
    answered = client.responses.create(model=model, tools=[WEATHER], temperature=0, max_output_tokens=16, input=[
        {"role": "user", "content": "What is the weather in Paris?"}, calls[0].model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C."}])
    assert answered.output_text and answered.usage.input_tokens > whole.usage.input_tokens
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    shaped = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "capital", "schema": schema}})
    assert isinstance(json.loads(shaped.output_text)["capital"], str)


def test_errors_name_the_responses_fields(front, client):
    model = model_of(front)
    for fields, param in (({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output",
                                                                          "call_id": "nope", "output": "x"}]},
                           "input[1].call_id"),
                          ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
                          ({"input": "hi", "previous_response_id": "resp_x"}, "previous_response_id")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=model, **fields)
        assert refused.value.body["param"] == param, refused.value.body
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="another-model", input="hi")


def test_a_thinking_models_thinking_is_a_reasoning_item(stack, engine):
    with serving_template(stack, engine, THINKING) as front:
        client = openai.OpenAI(base_url=f"http://{front.http_address}/v1", api_key="none", max_retries=0)
        model = front.generator.model.model_name
        whole = client.responses.create(model=model, input=SHOTS, temperature=0, max_output_tokens=40)
        kinds = [item.type for item in whole.output]
        assert kinds == ["reasoning", "message"], whole.output
        thinking = whole.output[0].content[0].text
        assert "two" in thinking.lower() and "think" not in whole.output_text
        counted = whole.usage.output_tokens_details.reasoning_tokens
        assert 0 < counted < whole.usage.output_tokens  # the tokens that wrote the thinking, its tag included
        events = list(client.responses.create(model=model, input=SHOTS, temperature=0, max_output_tokens=40,
                                              stream=True))
        assert events[-1].response.usage.output_tokens_details.reasoning_tokens == counted
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
    ["", "hi", "user", "assistant", "function_call", "function_call_output", "message", "input_text", "{}",
     "function", "json_schema", "reasoning"]), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["type", "role", "content", "text", "call_id", "name", "arguments", "output", "format",
                     "schema", "parameters"]), inner, max_size=4), max_leaves=12)


@FUZZ
@given(st.dictionaries(st.sampled_from(["input", "instructions", "tools", "tool_choice", "text", "max_output_tokens",
                                        "truncation", "previous_response_id"]), _JSON, max_size=5))
def test_any_body_is_a_chat_body_or_a_refusal_naming_a_responses_field(body):
    try:
        chat, names = chat_body(body)
    except InvalidArgument as error:
        assert str(error).split(":")[0].split(".")[0].split("[")[0] in FIELDS | {"body"}, error
        return
    assert len(names) == len(chat["messages"]) and all(name == "instructions" or name.startswith("input[")
                                                       for name in names)


def _events(front, body: dict, headers: dict | None = None) -> list[tuple[str | None, dict]]:
    """A streamed response's SSE events as sent: (the event's name, its data)."""
    import urllib.request

    request = urllib.request.Request(f"http://{front.http_address}/v1/responses", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    with urllib.request.urlopen(request, timeout=300) as reply:
        text = reply.read().decode()
    events = []
    for block in filter(None, text.split("\n\n")):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines.get("event"), lines["data"]))
    assert all(data != "[DONE]" for _, data in events)  # OpenAI's Responses stream has none
    return [(name, json.loads(data)) for name, data in events]


def test_each_streamed_event_is_named_by_its_type_and_an_error_is_responses_own(front):
    events = _events(front, {"model": model_of(front), "input": ASK, "max_output_tokens": 12, "temperature": 0,
                             "stream": True})
    assert all(name == data["type"] for name, data in events) and events[-1][0] == "response.completed"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    cut = _events(front, {"model": model_of(front), "input": "Count to a thousand.", "max_output_tokens": 2000,
                          "temperature": 0, "ignore_eos": True, "stream": True}, {"X-Request-Timeout": "1.5"})
    name, error = cut[-1]
    assert name == "error" and error["type"] == "error" and error["sequence_number"] == len(cut) - 1
    assert error["code"] and "deadline" in error["message"] and "param" in error


def test_instructions_and_leading_system_or_developer_messages_are_one_system_message():
    """OpenAI takes both (Codex sends instructions and a developer message); a chat template takes
    one system message, first."""
    chat, names = chat_body({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Hi"}]})
    assert chat["messages"] == [{"role": "system", "content": "Be brief.\n\nUse tools."},
                                {"role": "user", "content": "Hi"}]
    assert names == ["instructions", "input[1]"]  # an error in the user's message still names its item
