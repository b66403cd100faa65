"""How a model family writes its tool calls (`CallLayout`): read back from its text as it
streams (`CallReader`), and, where a request requires calls, held to by a grammar.

The layout is the model's, chosen from its chat template (`layout_of`); two are served:

``hermes``: Qwen2.5, Qwen3, the Hermes models, and every template with no place for tools
(`tools_preamble` teaches it): each call one JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``llama3_json``: Llama 3.1-3.3, whose templates ask for "a JSON for a function call": the answer
is the call itself, its arguments under "parameters", further calls after "; ",

    {"name": "get_weather", "parameters": {"city": "Paris"}}

(the names are those of vLLM's tool parsers, which operators know). A worked example:

    >>> from pardec.gateway.tools import Tool, ToolUse
    >>> use = ToolUse((Tool("get_weather", parameters='{"type": "object"}'),))
    >>> reader = HERMES.reader(use)
    >>> reader.feed('Let me check. <tool_')  # held back: it may be a call's opening tag
    'Let me check. '
    >>> reader.feed('call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>')
    ''
    >>> [(call.name, call.arguments) for call in reader.calls], reader.finish()
    ([('get_weather', '{"city": "Paris"}')], '')
    >>> content, calls, finish = read_calls(use, '{"name": "get_weather", "parameters": {}}', "eos", LLAMA3_JSON)
    >>> content, [(call.name, call.arguments) for call in calls], finish
    ('', [('get_weather', '{}')], 'tool_calls')
"""

from __future__ import annotations

import dataclasses
import json

from pardec.gateway.call_readers import CLOSE, OPEN, BareJsonReader, CallReader, TaggedReader
from pardec.gateway.tools import ToolCall, ToolUse
from pardec.runtime.errors import InvalidArgument
from pardec.verifier.api import Sampling
from pardec.verifier.structured_output import StructuredOutput, regex_literal

NEWLINE = "\n"
# What Llama 3's templates say, and only theirs: the call format they ask for, the built-in tools' tag.
LLAMA3_MARKS = ('"parameters": dictionary of argument name', "<|python_tag|>")


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """One way of writing calls: each call one JSON object (its arguments under
    ``arguments_key``) between ``opening`` and ``closing``, ``separator`` between calls, read back
    by a ``reader``."""

    name: str
    arguments_key: str
    reader: type[CallReader]
    opening: str = ""
    closing: str = ""
    separator: str = ""

    def grammar(self, call: dict, many: bool, or_text: bool = False) -> str:
        """The Lark grammar of one call (``many``: one or more) whose JSON Schema is ``call``;
        ``or_text`` (strict calls under "auto"): of text alone, or of text then the calls (bare
        JSON: text that does not open with an object, or the calls alone)."""
        more = f" ({json.dumps(self.separator)} call)*" if many else ""
        body = ["%json", json.dumps(call)]
        if self.opening:
            body = [json.dumps(self.opening), *body, json.dumps(self.closing)]
        rules = f"call: {' '.join(body)}\n"
        if not or_text:
            return f"start: call{more}\n{rules}"
        blank = "BLANK: /[ \\t\\r\\n]*/\n"
        if not self.opening:
            return f"start: TEXT | BLANK call{more} BLANK\n{rules}TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*\\{{(?s:.*)/\n{blank}"
        # The text before the first call and that call's opening tag are one lexeme, so the text
        # never ends on a piece of the tag; text alone never holds the tag.
        tag = regex_literal(self.opening)
        return (f"start: TEXT | HEAD first{more} BLANK\n{rules}first: {' '.join(body[1:])}\n"
                f"TEXT: /(?s:.*)/ & ~/(?s:.*{regex_literal(self.opening.rstrip())}(?s:.*))/\n"
                f"HEAD: /(?s:.*){tag}/ & ~/(?s:.*{tag}(?s:.+))/\n{blank}")


HERMES = CallLayout("hermes", "arguments", TaggedReader, OPEN + NEWLINE, NEWLINE + CLOSE, NEWLINE)
LLAMA3_JSON = CallLayout("llama3_json", "parameters", BareJsonReader, separator="; ")


def layout_of(tokenizer) -> CallLayout:
    """The layout a model's chat template asks for: Llama 3's where the template is theirs
    (it renders tools, and speaks of their format), else the tagged one."""
    template = (tokenizer.chat_template or "") if tokenizer is not None else ""
    if template and tokenizer.takes_tools and OPEN not in template and any(mark in template for mark in LLAMA3_MARKS):
        return LLAMA3_JSON
    return HERMES


def reader_for(tools: ToolUse | None, layout: CallLayout) -> CallReader | None:
    """What reads a request's answer back as calls (None: it offers no tools, or its choice is "none")."""
    return layout.reader(tools) if tools is not None and tools.reads_calls else None


def read_calls(tools: ToolUse, text: str, finish_reason: str = "", layout: CallLayout = HERMES,
               ) -> tuple[str, list[ToolCall], str]:
    """(content, calls, finish reason) of a whole answer: what a `CallReader` gives a stream, joined."""
    piece = layout.reader(tools).step(text, finish_reason or "stop")
    return piece.content, piece.calls, piece.finish_reason


def structured_output(tools: ToolUse, layout: CallLayout) -> StructuredOutput:
    """The language of the calls ``tools``' choice allows, in ``layout``: one call of the named
    function, or one or more (one with ``parallel`` false) of any offered function; under "auto"
    (strict tools), text or those calls, a strict tool's arguments held to its schema. A schema
    the grammar cannot take is refused naming its tool."""
    offered = [tool for tool in tools.tools if tools.function in ("", tool.name)]
    several = len(offered) > 1  # then each call's schema sits at /anyOf/i: where its $refs point
    schemas = [tool.call_schema(layout.arguments_key, tools.constrains or tool.strict, f"/anyOf/{i}" if several else "")
               for i, tool in enumerate(offered)]
    call = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    try:
        return StructuredOutput("grammar", layout.grammar(call, tools.parallel and not tools.function, tools.strict))
    except InvalidArgument as error:  # whose schema? (compiled alone only now: a failure is rare)
        for tool in offered:
            try:
                StructuredOutput("json_schema", json.dumps(tool.call_schema(layout.arguments_key,
                                                                             tools.constrains or tool.strict)))
            except InvalidArgument as alone:
                raise InvalidArgument(f"tools[{tools.tools.index(tool)}].function.parameters: {_why(alone)}") from None
        raise InvalidArgument(f"tools: the grammar of their calls: {_why(error)}") from None


def constrained(tools: ToolUse | None, sampling: Sampling, layout: CallLayout) -> Sampling:
    """``sampling`` holding the output to the calls ``tools``' choice asks for, if it asks for
    any; under "auto" with strict tools, to text or calls their schemas validate (beside a
    structured output, which holds the text, strict calls are read as written)."""
    if tools is None or not (tools.constrains or tools.strict):
        return sampling
    if sampling.structured_output is not None and not tools.constrains:
        return sampling
    if sampling.structured_output is not None:
        raise InvalidArgument("tool_choice: a required call holds the output to tool calls; it cannot be "
                              "combined with a structured output (response_format)")
    return dataclasses.replace(sampling, structured_output=structured_output(tools, layout))


def tools_preamble(tools: ToolUse) -> str:
    """What a system message tells a model whose chat template has no place for tools: the tagged layout."""
    listed = "\n".join(json.dumps(tool.as_template(), ensure_ascii=False) for tool in tools.tools)
    return ("You can call functions to help answer. Each function is described by a JSON Schema:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, answer with a JSON object naming it and giving its arguments, between tags:\n"
            f'{OPEN}\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n{CLOSE}\n'
            "Write one such block per call.")


def calls_text(calls: tuple[ToolCall, ...]) -> str:
    """Calls as the tagged layout writes them: an assistant turn's history, where the template cannot."""
    return "\n".join(f'{OPEN}\n{json.dumps({"name": c.name, "arguments": json.loads(c.arguments)}, ensure_ascii=False)}'
                     f"\n{CLOSE}" for c in calls)


def response_text(content: str) -> str:
    """A tool's result as a turn's text, where the template has no tool role."""
    return f"<tool_response>\n{content}\n</tool_response>"


def _why(error: InvalidArgument) -> str:
    """An error's message without the field it named."""
    return str(error).partition(": ")[2]
