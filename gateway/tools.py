"""Tool calling, protobuf-free: the tools a chat request offers and how it asks the model to
call them (``tool_choice``), validated where the request enters.

"auto" leaves the model free and reads whatever calls it wrote (with a ``strict`` tool, as
OpenAI's strict function calling: text, or calls whose arguments their schemas validate);
"required" and a named function hold it to one or more calls (a grammar over each function's
JSON Schema, as structured output: greedy output under it is still plain decoding's under it,
token for token); "none" reads nothing back. How a model writes its calls, and how they are read and held to, is its family's
layout (gateway/call_layouts.py).

    >>> use = ToolUse((Tool("get_weather", parameters='{"type": "object"}'),), choice="required")
    >>> use.constrains, use.tools[0].call_schema("arguments")["required"]
    (True, ['name', 'arguments'])
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pardec.runtime.errors import InvalidArgument

AUTO, NONE, REQUIRED = "auto", "none", "required"
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
    strict: bool = False  # under "auto" too, its calls' arguments are held to the schema (OpenAI's strict)

    def as_template(self) -> dict:
        function = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def call_schema(self, arguments_key: str, held: bool = True, at: str = "") -> dict:
        """The JSON Schema of one call of this function: its name, and its arguments under
        ``arguments_key`` (``held`` false: any object), their `$ref`s to their own root ("#",
        "#/$defs/...") rebased to where they sit in the whole schema, this one at pointer ``at``."""
        arguments = _rebased(json.loads(self.parameters), f"{at}/properties/{arguments_key}") if held else {}
        arguments.setdefault("type", "object")  # "parameters": {} is any object, not any value
        return {"type": "object", "properties": {"name": {"const": self.name}, arguments_key: arguments},
                "required": ["name", arguments_key], "additionalProperties": False}


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: left as written
# Keywords whose value maps names (a property's, a definition's) to schemas: its keys are no keywords.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema, pointer: str):
    """``schema`` placed at JSON pointer ``pointer`` of another: every `$ref` that is a pointer
    into it ("#", "#/...") points there; other references (a "#name" anchor, a URL) stay.

    >>> _rebased({"items": {"$ref": "#"}, "$defs": {"a": {"$ref": "#/$defs/b"}}}, "/properties/arguments")
    {'items': {'$ref': '#/properties/arguments'}, '$defs': {'a': {'$ref': '#/properties/arguments/$defs/b'}}}
    >>> _rebased({"properties": {"default": {"$ref": "#"}}, "default": {"$ref": "#"}}, "/p")  # a name, a value
    {'properties': {'default': {'$ref': '#/p'}}, 'default': {'$ref': '#'}}
    """
    if isinstance(schema, list):
        return [_rebased(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            rebased[key] = "#" + pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            rebased[key] = {name: _rebased(named, pointer) for name, named in value.items()}
        else:
            rebased[key] = _rebased(value, pointer)
    return rebased


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
            stated = json.loads(tool.parameters).get("type", "object")
            if stated != "object":  # a call's arguments are an object: the reader takes nothing else
                raise InvalidArgument(f'tools[{index}].function.parameters: must describe an object (type "object"), '
                                      f"got type {json.dumps(stated)[:80]}")
        if self.choice not in (AUTO, NONE, REQUIRED):
            raise InvalidArgument(f'tool_choice: must be "auto", "none", "required" or a function, got {self.choice[:80]!r}')
        if self.function and self.function not in names:
            raise InvalidArgument(f"tool_choice: names function {self.function[:80]!r}, which tools does not offer")
        if self.function and self.choice != REQUIRED:
            raise InvalidArgument(f"tool_choice: a named function is a required call, not {self.choice!r}")

    @property
    def constrains(self) -> bool:
        """Whether the output is held to calls: "required" or a named function."""
        return self.choice == REQUIRED

    @property
    def strict(self) -> bool:
        """Whether, under "auto", the calls are held too: some tool is strict."""
        return self.choice == AUTO and any(tool.strict for tool in self.tools)

    @property
    def reads_calls(self) -> bool:
        return self.choice != NONE

    def finish_reason(self, calls: list[ToolCall], finish_reason: str) -> str:
        """OpenAI's: "tool_calls" when the model chose to call (a named function forced is "stop")."""
        if calls and finish_reason != "length" and not self.function:
            return "tool_calls"
        return finish_reason
