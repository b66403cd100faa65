"""How a model family writes tool calls (gateway/call_layouts.py): Llama 3's bare JSON beside the
tagged layout, read back whole and streamed, held to by its own grammar, and chosen from the
model's chat template, end to end through a verifier serving a template in Llama 3's style."""

from __future__ import annotations

import doctest
import json

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pardec.gateway.call_layouts
import pardec.gateway.call_readers
import pardec.gateway.json_scan
import pardec.gateway.tools
from pardec.gateway.call_layouts import HERMES, LLAMA3_JSON, layout_of, read_calls, structured_output
from pardec.gateway.call_readers import MAX_HEAD_CHARS, read_head
from pardec.gateway.json_scan import JsonScan
from pardec.gateway.chat import Message, input_tokens
from pardec.gateway.tools import Tool, ToolCall, ToolUse
from tests.fuzzing import FUZZ
from tests.openai_front import serving_template, with_template

CITY = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
USE = ToolUse((Tool("get_weather", parameters=CITY), Tool("get_time")))
CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
TAGGED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.", "parameters": json.loads(CITY)}}

# A template in the style of Llama 3.1-3.3's (written for these tests, over the bundled model's
# ChatML tokens): the tools go into the last user turn with the call format Llama's ask for, a
# call is written as that JSON, and a tool's result is an "ipython" turn.
LLAMA_STYLE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' and loop.last and tools %}<|im_start|>user\n"
    "You may call these functions. To call one, answer with nothing but the call, in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n"
    '{% for call in m.tool_calls %}{"name": "{{ call.function.name }}", '
    '"parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|im_end|>\n'
    "{% elif m.role == 'tool' %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TAGGED_TEMPLATE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{{ messages }}</tool_call>"


def _named(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_doctests():
    assert doctest.testmod(pardec.gateway.call_layouts).failed == 0
    assert doctest.testmod(pardec.gateway.tools).failed == 0
    assert doctest.testmod(pardec.gateway.call_readers).failed == 0
    assert doctest.testmod(pardec.gateway.json_scan).failed == 0


def test_llama3_json_calls_are_read_and_anything_else_stays_text():
    content, calls, finish = read_calls(USE, CALL + "; " + CALL.replace("Paris", "Rome"), "eos", LLAMA3_JSON)
    assert (content, _named(calls), finish) == (
        "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})], "tool_calls")
    assert calls[0].id != calls[1].id
    assert _named(read_calls(USE, '\n {"name": "get_time", "parameters": {}} \n', "eos", LLAMA3_JSON)[1]) == [
        ("get_time", {})]
    # The arguments' other spellings: "arguments", and a JSON object's text.
    spelled = '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
    assert _named(read_calls(USE, spelled, "eos", LLAMA3_JSON)[1]) == [("get_weather", {"city": "Oslo"})]
    # Text: a call not at the start, an object that is no call of an offered function, one cut
    # short before its arguments began, and an object with its name after its arguments cut short.
    for text in ("Sure. " + CALL, '{"answer": 42}', CALL.replace("get_weather", "nope"), CALL[:30],
                 '{"parameters": {"city": "Paris"}, "name": "get_weath'):
        assert read_calls(USE, text, "eos", LLAMA3_JSON) == (text, [], "eos"), text
    # Whole, that last one is a call all the same (read when whole, its arguments written out again).
    assert _named(read_calls(USE, '{"parameters": {"city":"Oslo"}, "name": "get_weather"}', "eos", LLAMA3_JSON)[1]) == [
        ("get_weather", {"city": "Oslo"})]
    # A call cut short inside its arguments is a call with the arguments it has, as OpenAI's.
    cut = read_calls(USE, CALL[:-9], "length", LLAMA3_JSON)
    assert (cut[0], [(c.name, c.arguments) for c in cut[1]], cut[2]) == ("", [("get_weather", '{"city": ')], "length")
    # What follows the calls is text; with parallel calls off, the first call is the one taken.
    assert read_calls(USE, CALL + " and more", "eos", LLAMA3_JSON)[0] == " and more"
    single = ToolUse(USE.tools, parallel=False)
    assert len(read_calls(single, CALL + "; " + CALL, "eos", LLAMA3_JSON)[1]) == 1
    # A named function forced finishes as OpenAI's "stop"; "length" stays "length" whatever was read.
    assert read_calls(ToolUse(USE.tools, "required", function="get_weather"), CALL, "eos", LLAMA3_JSON)[2] == "eos"
    assert read_calls(USE, CALL, "length", LLAMA3_JSON)[2] == "length"


def _read(layout, text):
    content, calls, _ = read_calls(USE, text, "eos", layout)
    return content, [(call.name, call.arguments) for call in calls]


TIME = '{"name": "get_time", "%s": {"a": 1}}'


@pytest.mark.parametrize("layout, text, read", [
    # A name that is no string, a number too long for int(): text, never an error.
    (HERMES, '<tool_call>{"name": [], "arguments": {}}</tool_call>', None),
    (LLAMA3_JSON, '{"name": {"a": 1}, "parameters": {}}', None),
    (LLAMA3_JSON, '{"x": ' + "1" * 5000 + "}", None),
    # What follows a call's object in its block is text, the next call included.
    (HERMES, "<tool_call>" + TIME % "arguments" + "\nThe answer is 42.", ("The answer is 42.", [("get_time", '{"a": 1}')])),
    (HERMES, "<tool_call>" + TIME % "arguments" + "\n<tool_call>" + TIME % "arguments" + "</tool_call>",
     ("", [("get_time", '{"a": 1}')] * 2)),
    # A block closed inside the arguments ends the call with what it has; a tag inside a string is text.
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {"a": 1</tool_call> Then text',
     ("Then text", [("get_time", '{"a": 1')])),
    (HERMES, '<tool_call>{"name": "get_time", "arguments": {"b": "</tool_call>"}}</tool_call>',
     ("", [("get_time", '{"b": "</tool_call>"}')])),
    (HERMES, '<tool_call>{"arguments": {"b": "</tool_call>"}, "name": "get_time"}</tool_call>',
     ("", [("get_time", '{"b": "</tool_call>"}')])),
    # Keys after the arguments are the call's; a last separator is the layout's.
    (LLAMA3_JSON, '{"name": "get_time", "parameters": {"a": 1}, "x": 2}; {"name": "get_weather", "parameters": {}}',
     ("", [("get_time", '{"a": 1}'), ("get_weather", "{}")])),
    (LLAMA3_JSON, TIME % "parameters" + "; ", ("", [("get_time", '{"a": 1}')])),
    # Layout whitespace is JSON's: other white space is text.
    (HERMES, "<tool_call>" + TIME % "arguments" + "</tool_call>\u00a0Done", ("\u00a0Done", [("get_time", '{"a": 1}')])),
])
def test_odd_answers_read_as_their_text_says(layout, text, read):
    assert _read(layout, text) == (read or (text, []))
    pieces = [text[at:at + 3] for at in range(0, len(text), 3)]
    reader, content = layout.reader(USE), ""
    for number, piece in enumerate(pieces):
        content += reader.step(piece, "eos" if number == len(pieces) - 1 else "").content
    assert (content, [(c.name, c.arguments) for c in reader.calls]) == _read(layout, text)


def test_each_character_is_scanned_once_and_a_head_is_bounded(monkeypatch):
    """No answer is read again and again as it grows (a long whole-read object, a block's body,
    a call's arguments), and a head that runs past any name's length is none."""
    scanned = []
    advance = JsonScan.advance
    monkeypatch.setattr(JsonScan, "advance", lambda scan, text, tag="": scanned.append(len(text)) or advance(scan, text, tag))
    for layout, text in ((LLAMA3_JSON, '{"x": [' + "1," * 3000), (HERMES, '<tool_call>{"x": "' + "y" * 6000),
                         (LLAMA3_JSON, '{"name": "get_time", "parameters": {"a": "' + "y" * 6000)):
        scanned.clear()
        reader = layout.reader(USE)
        for character in text:
            reader.feed(character)
        assert 0 < sum(scanned) <= len(text), layout.name
    assert read_head('{"name": "' + "a" * MAX_HEAD_CHARS, {"get_time"}) is False
    assert read_head("{" + " " * MAX_HEAD_CHARS, {"get_time"}) is False
    assert read_head("{" + " " * (MAX_HEAD_CHARS - 2), {"get_time"}) is None


def test_text_that_cannot_be_a_call_is_given_out_before_the_end():
    reader = LLAMA3_JSON.reader(USE)
    assert reader.feed("{") == "" and reader.feed('"name": "get_weather", ') == ""  # may still be a call
    assert reader.feed("is not JSON at all") == '{"name": "get_weather", is not JSON at all'
    assert reader.feed(" more") == " more" and reader.finish() == "" and not reader.calls
    reader = LLAMA3_JSON.reader(USE)
    assert reader.feed('{"name": "get_weather", "parameters": {"city": "a long name still open') == ""


@pytest.mark.parametrize("layout", [LLAMA3_JSON, HERMES])
def test_a_call_streams_from_its_name_on_and_its_deltas_add_up_to_it(layout):
    text = CALL if layout is LLAMA3_JSON else "<tool_call>\n" + CALL + "\n</tool_call>"
    reader, deltas = layout.reader(USE), []
    for start in range(0, len(text), 4):
        piece = reader.step(text[start:start + 4], "eos" if start + 4 >= len(text) else "")
        deltas += piece.deltas
        assert not piece.content
    named = [delta for delta in deltas if delta.id]
    assert len(named) == 1 and named[0] is deltas[0] and named[0].name == "get_weather"
    assert "".join(delta.arguments for delta in deltas) == reader.calls[0].arguments == '{"city": "Paris"}'
    assert len(deltas) > 3 and {delta.index for delta in deltas} == {0}  # the arguments came in pieces
    # A whole answer is one piece: one delta a call, the whole call.
    whole = layout.reader(USE).step(text + (" " if layout is HERMES else "; ") + text, "eos")
    assert [(d.index, d.name, d.arguments) for d in whole.deltas] == [(0, "get_weather", '{"city": "Paris"}'),
                                                                       (1, "get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("layout, text, content", [
    (LLAMA3_JSON, CALL + "; " + CALL + "\nThat is all.", "\nThat is all."),
    (HERMES, "Sure. <tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n" + CALL + "\n</tool_call> trailing",
     "Sure. trailing"),
])
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_a_stream_in_any_pieces_reads_as_the_whole(layout, text, content, size):
    reader, streamed = layout.reader(USE), ""
    for start in range(0, len(text), size):
        streamed += reader.feed(text[start:start + size])
    streamed += reader.finish()
    whole_content, whole_calls, _ = read_calls(USE, text, "eos", layout)
    assert streamed == whole_content == content
    assert _named(reader.calls) == _named(whole_calls) == [("get_weather", {"city": "Paris"})] * 2


PIECES = {  # what streams are made of in the fuzz below: calls whole and in parts, JSON's and the tags' characters
    HERMES: [TAGGED, "<tool_call>", "</tool_call>", "<tool_", "call>", '{"name": "get_time", "arguments": {}}',
             '{"name": "get_time", "arguments": ', "\n", " ", "x", "{", "}", '"', "\\", "[", "]"],
    LLAMA3_JSON: [CALL, "{", "}", '"name"', ": ", '"get_time"', ", ", '"parameters"', "{}", ";", " ", "\n", "x", "1",
                  "tru", '"', "\\", "[", "]"],
}


@FUZZ
@pytest.mark.parametrize("layout", [HERMES, LLAMA3_JSON], ids=lambda layout: layout.name)
@given(data=st.data())
def test_any_text_streamed_reads_as_the_whole_and_loses_nothing_but_calls(layout, data):
    parts = data.draw(st.lists(st.sampled_from(PIECES[layout]), max_size=14))
    text, reader, content, deltas = "".join(parts), layout.reader(USE), "", []
    for number, part in enumerate(parts):
        piece = reader.step(part, "eos" if number == len(parts) - 1 else "")
        content, deltas = content + piece.content, deltas + piece.deltas
    if not parts:
        content = reader.finish()
    # The deltas add up to the calls: each call's arguments, in order.
    assert ["".join(d.arguments for d in deltas if d.index == i) for i in range(len(reader.calls))] == [
        c.arguments for c in reader.calls]
    whole_content, whole_calls, _ = read_calls(USE, text, "eos", layout)
    assert (content, [c.arguments for c in reader.calls]) == (whole_content, [c.arguments for c in whole_calls])
    if not reader.calls:
        assert content == text


def test_each_layout_has_its_grammar_and_the_template_chooses_it(engine):
    required = ToolUse(USE.tools, "required")
    llama, tagged = (structured_output(required, layout).spec for layout in (LLAMA3_JSON, HERMES))
    assert '"parameters"' in llama and "<tool_call>" not in llama and '"; "' in llama
    assert '"arguments"' in tagged and "<tool_call>" in tagged
    one = structured_output(ToolUse(USE.tools, "required", parallel=False), LLAMA3_JSON).spec
    assert one.startswith("start: call\n")
    base = engine.tokenizer
    assert layout_of(base) is HERMES  # SmolLM2's ChatML template has no place for tools: taught the tags
    assert layout_of(with_template(base, LLAMA_STYLE_TEMPLATE)) is LLAMA3_JSON
    assert layout_of(with_template(base, TAGGED_TEMPLATE)) is HERMES
    # Llama's history is the template's to write: its calls as JSON, their results as ipython turns.
    history = (Message("user", "Weather in Paris?"),
               Message("assistant", "", (ToolCall("get_weather", '{"city": "Paris"}', "call_1"),)),
               Message("tool", "18 C, sunny", tool_call_id="call_1"), Message("user", "And Rome?"))
    text = base.decode(input_tokens(with_template(base, LLAMA_STYLE_TEMPLATE), "", history, False, USE))
    assert 'assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "ipython\n18 C, sunny" in text and text.count('"name": "get_time"') == 1


# ---- end to end: a verifier serving a template in Llama 3's style ----------------------------

@pytest.fixture(scope="module")
def llama_style_front(stack, engine):
    with serving_template(stack, engine, LLAMA_STYLE_TEMPLATE) as running:
        yield running


def test_a_llama_style_model_is_held_to_its_own_layout_losslessly(llama_style_front):
    front = llama_style_front
    assert front.generator.answers.call_layout is LLAMA3_JSON and front.generator.served_model().tool_call_layout == "llama3_json"
    client = openai.OpenAI(base_url=f"http://{front.http_address}/v1", api_key="none", max_retries=0)
    model = front.generator.model.model_name
    named = {"type": "function", "function": {"name": "get_weather"}}
    replies = [client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=named,
                                              temperature=0, max_tokens=60, extra_body={"parallel_decoding": on})
               for on in (True, False)]
    calls = [reply.choices[0].message.tool_calls for reply in replies]
    assert replies[0].choices[0].message.content is None and len(calls[0]) == 1
    assert calls[0][0].function.name == "get_weather" and isinstance(json.loads(calls[0][0].function.arguments)["city"], str)
    # Lossless: parallel decoding under the layout's grammar makes plain decoding's tokens.
    assert calls[0][0].function.arguments == calls[1][0].function.arguments
    assert replies[0].usage.completion_tokens == replies[1].usage.completion_tokens
    # Streamed, no content: the call's deltas add up to the whole answer's call.
    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                 parallel_tool_calls=False, temperature=0, max_tokens=60,
                                                 stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    streamed = [call for delta in deltas for call in delta.tool_calls or ()]
    assert not "".join(delta.content or "" for delta in deltas)
    assert streamed[0].function.name == "get_weather" and {c.index for c in streamed} == {0}
    assert "".join(c.function.arguments for c in streamed) == calls[0][0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
