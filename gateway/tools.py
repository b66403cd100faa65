"""Tool calling, protobuf-free: the tools a chat request offers, how the model is held to calling
them, and its answer read back as calls.

The model writes a call as one JSON object between tags, the layout Qwen2.5/Qwen3 and the
Hermes models are trained on (templates without tools are taught it by `tools_preamble`):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` "auto" leaves the model free and reads whatever calls it wrote; "required" and a
named function hold it to one or more calls (a Lark grammar over each function's JSON Schema,
as structured output: greedy output under it is still plain decoding's under it, token for
token); "none" reads nothing back. A worked example:

    >>> use = ToolUse((Tool("get_weather", parameters='{"type": "object"}'),))
    >>> reader = CallReader(use)
    >>> reader.feed('Let me check. <tool_')  # held back: it may be a call's opening tag
    'Let me check. '
    >>> reader.feed('call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>')
    ''
    >>> [(call.name, call.arguments) for call in reader.calls], reader.finish()
    ([('get_weather', '{"city": "Paris"}')], '')
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from functools import cached_property

from pardec.runtime.errors import InvalidArgument
from pardec.verifier.api import Sampling
from pardec.verifier.structured_output import StructuredOutput

AUTO, NONE, REQUIRED = "auto", "none", "required"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
NEWLINE = "\n"
# OpenAI's limits: a function's name is 1-64 of these characters; at most 128 tools a request.
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One call the model made (or, in a conversation's history, had made)."""

    name: str
    arguments: str  # a JSON object's text
    id: str = field(default_factory=call_id)

    def as_template(self) -> dict:
        """As chat templates read a call: the arguments as a mapping, as transformers passes them."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.loads(self.arguments)}}


@dataclass(frozen=True)
class Tool:
    """A function the model may call: ``parameters`` is the JSON Schema of its arguments, as text."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object"}'

    def as_template(self) -> dict:
        function = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def call_schema(self) -> dict:
        """The JSON Schema of one call of this function, in the tags' layout."""
        return {"type": "object", "properties": {"name": {"const": self.name},
                                                 "arguments": json.loads(self.parameters)},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and its ``choice``: "auto", "none" or "required", and with ``function``
    (a tool's name; choice "required") that one function's call. ``parallel`` false: at most one
    call. Validated on construction, naming the fields as OpenAI's API and the gRPC API spell them."""

    tools: tuple[Tool, ...]
    choice: str = AUTO
    parallel: bool = True
    function: str = ""

    def __post_init__(self) -> None:
        if not 0 < len(self.tools) <= MAX_TOOLS:
            raise InvalidArgument(f"tools: must hold 1 to {MAX_TOOLS} functions, got {len(self.tools)}")
        names = set()
        for index, tool in enumerate(self.tools):
            if not NAME.fullmatch(tool.name):
                raise InvalidArgument(f"tools[{index}].function.name: must be 1 to 64 letters, digits, '_', '.' "
                                      f"or '-', got {tool.name[:80]!r}")
            if tool.name in names:
                raise InvalidArgument(f"tools[{index}].function.name: {tool.name!r} is offered twice")
            names.add(tool.name)
            if not is_json_object(tool.parameters):
                raise InvalidArgument(f"tools[{index}].function.parameters: must be a JSON Schema object")
        if self.choice not in (AUTO, NONE, REQUIRED):
            raise InvalidArgument(f'tool_choice: must be "auto", "none", "required" or a function, got {self.choice[:80]!r}')
        if self.function and self.function not in names:
            raise InvalidArgument(f"tool_choice: names function {self.function[:80]!r}, which tools does not offer")
        if self.function and self.choice != REQUIRED:
            raise InvalidArgument(f"tool_choice: a named function is a required call, not {self.choice!r}")
        if self.constrains:
            self.structured_output()  # a schema the grammar cannot take is refused here, naming its tool

    @property
    def constrains(self) -> bool:
        """Whether the output is held to calls: "required" or a named function."""
        return self.choice == REQUIRED

    @property
    def reads_calls(self) -> bool:
        return self.choice != NONE

    def structured_output(self) -> StructuredOutput:
        """The language of the calls this choice allows: one call of the named function, or one
        or more (one with ``parallel`` false) of any offered function."""
        return self._language

    @cached_property
    def _language(self) -> StructuredOutput:
        offered = [tool for tool in self.tools if self.function in ("", tool.name)]
        schema = offered[0].call_schema() if len(offered) == 1 else {"anyOf": [t.call_schema() for t in offered]}
        many = self.parallel and not self.function
        start = 'start: call ("\\n" call)*' if many else "start: call"
        call = f"call: {json.dumps(OPEN + NEWLINE)} %json {json.dumps(schema)} {json.dumps(NEWLINE + CLOSE)}"
        try:
            return StructuredOutput("grammar", f"{start}\n{call}\n")
        except InvalidArgument as error:  # whose schema? (compiled alone only now: a failure is rare)
            for tool in offered:
                try:
                    StructuredOutput("json_schema", json.dumps(tool.call_schema()))
                except InvalidArgument as alone:
                    index = self.tools.index(tool)
                    raise InvalidArgument(f"tools[{index}].function.parameters: {_why(alone)}") from None
            raise InvalidArgument(f"tools: the grammar of their calls: {_why(error)}") from None

    def constrained(self, sampling: Sampling) -> Sampling:
        """``sampling`` holding the output to the calls this choice asks for, if it asks for any."""
        if not self.constrains:
            return sampling
        if sampling.structured_output is not None:
            raise InvalidArgument("tool_choice: a required call holds the output to tool calls; it cannot be "
                                  "combined with a structured output (response_format)")
        return dataclasses.replace(sampling, structured_output=self.structured_output())

    def finish_reason(self, calls: list[ToolCall], finish_reason: str) -> str:
        """OpenAI's: "tool_calls" when the model chose to call (a named function forced is "stop")."""
        if calls and finish_reason != "length" and not self.function:
            return "tool_calls"
        return finish_reason


def tools_preamble(tools: ToolUse) -> str:
    """What a system message tells a model whose chat template has no place for tools."""
    listed = "\n".join(json.dumps(tool.as_template(), ensure_ascii=False) for tool in tools.tools)
    return ("You can call functions to help answer. Each function is described by a JSON Schema:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, answer with a JSON object naming it and giving its arguments, between tags:\n"
            f'{OPEN}\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n{CLOSE}\n'
            "Write one such block per call.")


def calls_text(calls: tuple[ToolCall, ...]) -> str:
    """Calls as the model writes them: an assistant turn's history, where the template cannot."""
    return "\n".join(f'{OPEN}\n{json.dumps({"name": c.name, "arguments": json.loads(c.arguments)}, ensure_ascii=False)}'
                     f"\n{CLOSE}" for c in calls)


def response_text(content: str) -> str:
    """A tool's result as a turn's text, where the template has no tool role."""
    return f"<tool_response>\n{content}\n</tool_response>"


class CallReader:
    """Reads the model's text as it streams: `feed` returns the text that is content (never a
    piece of a call), `calls` grows as each call's closing tag arrives, and `finish` returns what
    is left. A block that is not a call of an offered function stays text, so nothing is lost;
    with ``parallel`` false the calls after the first are dropped."""

    def __init__(self, tools: ToolUse):
        self.tools = tools
        self.names = {tool.name for tool in tools.tools}
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet given out: a possible tag's start, or an open block
        self._in_call = False
        self._after_call = False  # the last thing read was a call
        self._given = 0  # calls `step` has returned

    def feed(self, text: str) -> str:
        self._pending += text
        out = []
        while True:
            if not self._in_call:
                if self._after_call:  # between and after calls, whitespace is the layout's, not content
                    self._pending = self._pending.lstrip()
                    self._after_call = not self._pending
                start = self._pending.find(OPEN)
                if start < 0:
                    keep = _partial_tag(self._pending, OPEN)
                    out.append(self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return "".join(out)
                out.append(self._pending[:start])
                self._pending, self._in_call = self._pending[start:], True
            end = self._pending.find(CLOSE)
            if end < 0:
                return "".join(out)
            block, self._pending = self._pending[:end + len(CLOSE)], self._pending[end + len(CLOSE):]
            self._in_call = False
            self._after_call = self._read(block[len(OPEN):-len(CLOSE)])
            out.append("" if self._after_call else block)

    def step(self, text: str, finish_reason: str = "") -> tuple[str, list[ToolCall], str]:
        """One piece of a stream: (its content, the calls it completes, the finish reason as it
        reads with those calls). The last piece has the finish reason; a whole answer is one piece."""
        content = self.feed(text) + (self.finish() if finish_reason else "")
        calls, self._given = self.calls[self._given:], len(self.calls)
        return content, calls, finish_reason and self.tools.finish_reason(self.calls, finish_reason)

    def finish(self) -> str:
        """The text left at the end: an unclosed block is read as a call where it is one whole."""
        pending, self._pending = self._pending, ""
        if self._in_call and self._read(pending[len(OPEN):]):
            return ""
        return pending

    def _read(self, body: str) -> bool:
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            return False
        if not (isinstance(call, dict) and call.get("name") in self.names):
            return False
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return False
        if not isinstance(arguments, dict):
            return False
        if self.tools.parallel or not self.calls:
            self.calls.append(ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
        return True


def read_calls(tools: ToolUse, text: str, finish_reason: str = "") -> tuple[str, list[ToolCall], str]:
    """(content, calls, finish reason) of a whole answer: what `CallReader` gives a stream, joined."""
    return CallReader(tools).step(text, finish_reason or "stop")


def _why(error: InvalidArgument) -> str:
    """An error's message without the field it named."""
    return str(error).partition(": ")[2]


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that a ``tag`` starts with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
