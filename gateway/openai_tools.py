"""OpenAI's tool calling fields, protobuf-free: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` become a `ToolUse` (gateway/tools.py), and a message's ``tool_calls``
and ``tool_call_id`` its calls and the call it answers. Errors name the field as the client
wrote it.

    >>> use = tool_use({"tools": [{"type": "function", "function": {"name": "now"}}], "tool_choice": "required"})
    >>> [tool.name for tool in use.tools], use.choice, use.parallel
    (['now'], 'required', True)
"""

from __future__ import annotations

import json
from typing import Any

from pardec.gateway.tools import AUTO, NONE, REQUIRED, Tool, ToolCall, ToolUse
from pardec.runtime.errors import InvalidArgument

FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


def tool_use(body: dict[str, Any]) -> ToolUse | None:
    """The request's tools and choice; None when it offers none."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument("parallel_tool_calls: must be true or false")
    if tools is None or tools == []:
        if choice not in (None, AUTO, NONE):
            raise InvalidArgument(f"tool_choice: {choice!r:.80} asks for a call, but the request offers no tools")
        return None
    if not isinstance(tools, list):
        raise InvalidArgument("tools: must be an array of {\"type\": \"function\", \"function\": {...}} objects")
    mode, function = _choice(AUTO if choice is None else choice)
    return ToolUse(tuple(_tool(index, tool) for index, tool in enumerate(tools)), mode,
                   True if parallel is None else parallel, function)


def _tool(index: int, tool: Any) -> Tool:
    field = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidArgument(f"{field}.type: must be \"function\" (the only kind of tool)")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidArgument(f"{field}.function: must be an object with name, description and parameters")
    name, description = function.get("name"), function.get("description", "")
    if not isinstance(name, str):
        raise InvalidArgument(f"{field}.function.name: must be a string")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise InvalidArgument(f"{field}.function.description: must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{field}.function.parameters: must be a JSON Schema object")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidArgument(f"{field}.function.strict: must be true or false")
    return Tool(name, valid_text(description, f"{field}.function.description"), json.dumps(parameters), bool(strict))


def _choice(choice: Any) -> tuple[str, str]:
    """(mode, function) of OpenAI's tool_choice: a named function is a required call of it."""
    if choice in (AUTO, NONE, REQUIRED):
        return choice, ""
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return REQUIRED, function["name"]
    raise InvalidArgument('tool_choice: must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}')


def message_calls(index: int, message: dict[str, Any]) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``: the calls it made, each's arguments a JSON object's text."""
    calls = message.get("tool_calls")
    if calls is None:
        return ()
    if message.get("role") != "assistant":
        raise InvalidArgument(f"messages[{index}].tool_calls: only an assistant message makes tool calls")
    if not isinstance(calls, list):
        raise InvalidArgument(f"messages[{index}].tool_calls: must be an array of calls")
    out = []
    for number, call in enumerate(calls):
        field = f"messages[{index}].tool_calls[{number}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(call.get("id"), str):
            raise InvalidArgument(f"{field}: must be an object with id, type \"function\" and function")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise InvalidArgument(f"{field}.function: name and arguments must be strings")
        out.append(ToolCall(valid_text(name, f"{field}.function.name"), valid_text(arguments, f"{field}.function.arguments"),
                            valid_text(call["id"], f"{field}.id")))
    return tuple(out)


def call_id_of(index: int, message: dict[str, Any]) -> str:
    """A tool message's ``tool_call_id``."""
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidArgument(f"messages[{index}].tool_call_id: a tool message names the call it answers")
    return valid_text(call_id, f"messages[{index}].tool_call_id")


def valid_text(text: str, name: str) -> str:
    """``text`` if it is valid Unicode: JSON's escapes can spell a lone surrogate, which no
    tokenizer (and no gRPC string) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgument(f"{name}: not valid Unicode (a lone surrogate at character {error.start})") from None
    return text
