"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``; vLLM and
llama.cpp serve it too), protobuf-free: a body becomes the chat request it means
(openai_api.chat_request: one set of rules for every API), and a generation becomes a message
object, with the thinking as a ``thinking`` block, the answer as a ``text`` block and each tool
call as a ``tool_use`` block (its stream of events: anthropic_events.py).

    >>> chat, names = chat_body({"model": "m", "max_tokens": 8, "system": "Be brief.",
    ...                          "messages": [{"role": "user", "content": "Hi"}]})
    >>> chat["messages"], chat["max_completion_tokens"], names
    ([{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}], 8, ['system', 'messages[0]'])

As Anthropic's API does: a last message of the assistant's is a prefill the answer continues;
``temperature`` is in [0, 1] and, when absent, the model's own default (its generation config,
http_anthropic.py) or 1.0 (sampling); ``stop_sequence`` says which stop
sequence ended the answer, which the text leaves out. A thinking model's thinking follows its
template: ``thinking`` sets the template's ``enable_thinking``; ``budget_tokens`` (checked as
Anthropic checks it: >= 1024, below ``max_tokens``) is the chat request's ``thinking_token_budget``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pardec.gateway.answers import AnswerReader
from pardec.gateway.outputs import Generation, Stats
from pardec.gateway.json_scan import WHITESPACE
from pardec.gateway.openai_api import http_field
from pardec.gateway.openai_replies import FINISH_REASONS, usage
from pardec.gateway.tools import ToolCall
from pardec.runtime.errors import InvalidArgument, PardecError

# Fields of a Messages body that mean what a chat body's fields mean, under the same name
# (Anthropic's own, then the extensions a pardec or vLLM client may send beside them).
_SAME = ("model", "temperature", "top_p", "top_k", "metadata", "stream", "seed", "min_p", "repetition_penalty",
         "presence_penalty", "frequency_penalty", "parallel_decoding", "session_id", "draft", "cache_salt",
         "chat_template_kwargs", "bad_words")
_OWN = ("max_tokens", "messages", "system", "stop_sequences", "tools", "tool_choice", "thinking", "output_config",
        "output_format", "service_tier", "cache_control", "inference_geo", "speed", "container", "mcp_servers",
        "diagnostics", "context_management")
FIELDS = frozenset((*_SAME, *_OWN))
_REFUSED = {
    "container": "code execution containers are not served here",
    "mcp_servers": "MCP servers are not connected here: offer their tools as tools",
}
# Taken and meaning nothing here: context editing (Claude Code sends it) finds nothing to clear
# in a conversation the server reads whole, as sent.
IGNORED = ("context_management",)
_SKIPPED = {"thinking", "redacted_thinking"}  # earlier thinking is not sent back, as chat templates leave it out
MIN_THINKING_BUDGET = 1024  # Anthropic's rule for budget_tokens
MAX_TEMPERATURE = 1.0  # Anthropic's range is [0, 1]


def chat_body(body: Any, counting: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The chat completions body a Messages body means, and each chat message's name in the
    Messages body (``system``, ``messages[i]`` or a tool result's ``messages[i].content[j]``);
    ``counting``: the body of a message to count the tokens of (no ``max_tokens`` needed)."""
    if not isinstance(body, dict):
        raise InvalidArgument("body: must be a JSON object")
    for name, rule in _REFUSED.items():
        if body.get(name) not in (None, [], {}):
            raise InvalidArgument(f"{name}: {rule}")
    if body.get("max_tokens") is None and not counting:
        raise InvalidArgument("max_tokens: required, the most tokens to generate (>= 1)")
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > MAX_TEMPERATURE:
        raise InvalidArgument(f"temperature: {str(temperature)[:24]} is over 1 (Anthropic's range is [0, 1])")
    chat = {name: body[name] for name in _SAME if name in body}
    chat["max_completion_tokens"] = 1 if body.get("max_tokens") is None else body["max_tokens"]
    chat["messages"], names = _messages(body.get("system"), body.get("messages"))
    if names[-1].startswith("messages[") and chat["messages"][-1]["role"] == "assistant" and \
            not chat["messages"][-1].get("tool_calls"):
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False  # a prefill, continued
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgument("stop_sequences: must be an array of non-empty strings")
        chat["stop"], chat["include_stop_str_in_output"] = stop, True  # to say which one ended the answer
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    if body.get("thinking") is not None:
        variables, budget = _thinking(body["thinking"], None if counting else body["max_tokens"],
                                      chat.get("chat_template_kwargs"))
        chat["chat_template_kwargs"] = variables
        if budget is not None:
            chat["thinking_token_budget"] = budget
    for name in ("output_config", "output_format"):  # output_format: the structured outputs beta's name
        if body.get(name) is not None:
            chat.update(_format(name, body[name] if name == "output_format" else _config(body[name])))
    return chat, names


def _messages(system: Any, items: Any) -> tuple[list[dict[str, Any]], list[str]]:
    messages, names = [], []
    if system is not None:
        messages.append({"role": "system", "content": _text("system", system)})
        names.append("system")
    if not isinstance(items, list) or not items:
        raise InvalidArgument("messages: required, a non-empty array of {role, content} objects")
    for index, item in enumerate(items):
        field = f"messages[{index}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{field}: must be an object with role and content")
        role, content = item.get("role"), item.get("content")
        if role not in ("user", "assistant"):
            raise InvalidArgument(f"{field}.role: must be \"user\" or \"assistant\" (the system prompt is the "
                                  "top-level system)")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise InvalidArgument(f"{field}.content: must be a string or an array of content blocks")
        texts, calls = [], []
        for place, block in enumerate(content):
            where = f"{field}.content[{place}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_text(where, [block]))
            elif kind == "tool_result" and role == "user":
                messages.append(_result(where, block))
                names.append(where)
            elif kind == "tool_use" and role == "assistant":
                calls.append(_call(where, block))
            elif kind not in _SKIPPED or role != "assistant":
                takes = "text and tool_result" if role == "user" else "text, tool_use and thinking"
                raise InvalidArgument(f"{where}.type: {str(kind)[:40]!r} is not a block this server takes in a "
                                      f"{role} message ({takes}; the served model reads text)")
        if texts or calls or (role == "user" and not any(name.startswith(field + ".") for name in names)):
            message = {"role": role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            names.append(field)
    if not any(name.startswith("messages[") for name in names):
        raise InvalidArgument("messages: no message holds text, tool_use or tool_result blocks (thinking alone "
                              "is left out)")
    return messages, names


def _text(field: str, value: Any) -> str:
    """A string, or text blocks joined (their cache_control and citations mean nothing here)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidArgument(f"{field}: must be a string or an array of text blocks")
    texts = []
    for index, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            where = field if field.endswith("]") and len(value) == 1 else f"{field}[{index}]"
            raise InvalidArgument(f'{where}: only text blocks {{"type": "text", "text": ...}} are supported')
        texts.append(block["text"])
    return "".join(texts)


def _result(field: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidArgument(f"{field}.tool_use_id: names the tool_use block this result answers")
    content = block.get("content", "")
    text = _text(f"{field}.content", content)
    if block.get("is_error") is True:  # no template has a place for the flag: the text says so
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _call(field: str, block: dict[str, Any]) -> dict[str, Any]:
    for name in ("id", "name"):
        if not isinstance(block.get(name), str) or not block[name]:
            raise InvalidArgument(f"{field}.{name}: a tool_use block's {name} must be a non-empty string")
    if not isinstance(block.get("input"), dict):
        raise InvalidArgument(f"{field}.input: must be an object (the tool's arguments)")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidArgument("tools: must be an array of {name, description, input_schema} objects")
    functions = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidArgument(f"tools[{index}]: must be an object with name, description and input_schema")
        if tool.get("type") not in (None, "custom"):
            raise InvalidArgument(f"tools[{index}].type: {str(tool['type'])[:40]!r} is not supported; only custom "
                                  "tools (name, description, input_schema), which the client runs")
        if "input_schema" not in tool:
            raise InvalidArgument(f"tools[{index}].input_schema: required, a JSON Schema object")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for name in ("description", "strict"):  # strict: Anthropic's strict tool use, as OpenAI's
            if name in tool:
                function[name] = tool[name]
        functions.append({"type": "function", "function": function})
    return functions


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidArgument('tool_choice: must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                              '{"type": "tool", "name": ...}')
    chat: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind)}
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidArgument("tool_choice.name: required with type \"tool\", the name of one of tools")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise InvalidArgument("tool_choice.disable_parallel_tool_use: must be true or false")
        chat["parallel_tool_calls"] = not parallel
    return chat


def _thinking(thinking: Any, max_tokens: Any, variables: Any) -> tuple[Any, int | None]:
    """The template's variables with thinking on or off, and the thinking's budget (or None)."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise InvalidArgument('thinking: must be {"type": "enabled", "budget_tokens": ...}, {"type": "adaptive"}, '
                              '{"type": "between_tools"} or {"type": "disabled"}')
    budget = None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET or (
                isinstance(max_tokens, int) and budget >= max_tokens):
            raise InvalidArgument(f"thinking.budget_tokens: must be an integer >= {MIN_THINKING_BUDGET} and less "
                                  "than max_tokens")
    if variables is not None and not isinstance(variables, dict):
        return variables, budget  # the chat rules name what is wrong with it
    return {"enable_thinking": kind != "disabled", **(variables or {})}, budget  # the client's own variables win


def _config(config: Any) -> Any:
    if not isinstance(config, dict):
        raise InvalidArgument("output_config: must be an object (format, effort)")
    return config.get("format")


def _format(name: str, value: Any) -> dict[str, Any]:
    field = "output_config.format" if name == "output_config" else name
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") != "json_schema" or not isinstance(value.get("schema"), dict):
        raise InvalidArgument(f'{field}: must be {{"type": "json_schema", "schema": {{...}}}}')
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": value["schema"]}}}


_CHAT_NAMES = [(re.compile(r"^(?:max_completion_tokens|max_tokens|max_new_tokens)\b"), "max_tokens"),
               (re.compile(r"^response_format(?:\.json_schema(?:\.schema)?)?"), "output_config.format"),
               (re.compile(r"^(tools\[\d+\])\.function\.parameters\b"), r"\1.input_schema"),
               (re.compile(r"^(tools\[\d+\])\.function\b"), r"\1"),
               (re.compile(r"^tool_choice\.function\b"), "tool_choice"),
               (re.compile(r"^parallel_tool_calls\b"), "tool_choice.disable_parallel_tool_use"),
               (re.compile(r"^stop\b"), "stop_sequences")]


def renamed(error: PardecError, names: list[str]) -> PardecError:
    """A chat request's error (or the core's), its field named as the Messages body names it.

    >>> str(renamed(InvalidArgument("messages[1].tool_call_id: bad"), ["system", "messages[0].content[1]"]))
    'messages[0].content[1].tool_use_id: bad'
    """
    message = http_field(str(error))[1]
    match = re.match(r"^messages\[(\d+)\]", message)
    if match and int(match.group(1)) < len(names):
        rest = message[match.end():]
        message = names[int(match.group(1))] + (".tool_use_id" + rest[len(".tool_call_id"):]
                                                 if rest.startswith(".tool_call_id") else rest)
    for pattern, name in _CHAT_NAMES:
        message = pattern.sub(name, message, count=1)
    return error.reworded(message)


def message_id(request_id: str = "") -> str:
    """Named after the request where it has an id (as chat completions' replies are), else new."""
    return "msg_" + (request_id or uuid.uuid4().hex)


def stop_sequence(text: str, finish: str, stops: tuple[str, ...]) -> str | None:
    """The stop sequence ``text`` ends on, if the answer ended on one (the longest that fits).

    >>> stop_sequence("a, b\\n\\n", "stop", ("\\n", "\\n\\n")), stop_sequence("a\\n", "eos", ("\\n",))
    ('\\n\\n', None)
    """
    if finish != "stop":
        return None
    ends = [stop for stop in stops if text.endswith(stop)]
    return max(ends, key=len) if ends else None


def stop_reason(finish: str, calls: bool, stopped_on: str | None) -> str:
    """Why the message ended: cut short by max_tokens (calls or not), on its calls, on a stop
    sequence, or where the model ended its turn.

    >>> stop_reason("length", True, None), stop_reason("tool_calls", True, None), stop_reason("stop", False, "\\n")
    ('max_tokens', 'tool_use', 'stop_sequence')
    """
    if finish == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stopped_on is not None else "end_turn"


def ended(finish: str, calls: bool, stopped_on: str | None) -> dict[str, Any]:
    """The message's stop_reason and stop_sequence (named only where the reason is that sequence)."""
    reason = stop_reason(finish, calls, stopped_on)
    return {"stop_reason": reason, "stop_sequence": stopped_on if reason == "stop_sequence" else None}


def message_usage(stats: Stats | None, prompt_tokens: int, output_tokens: int, cached: int = 0) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those the prefix cache did not hold (cache_read_input_tokens:
    the stats' or, before they come, ``cached``)."""
    cached = stats.cached_prompt_tokens if stats is not None else cached
    counted = {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
               "cache_read_input_tokens": cached, "output_tokens": output_tokens}
    return {**counted, "pardec": usage(stats, output_tokens)["pardec"]} if stats is not None else counted


def arguments(call_arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's input (an object; what is not one, cut short, is empty)."""
    try:
        value = json.loads(call_arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "citations": None}


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments(call.arguments)}


def shows_thinking(body: dict[str, Any]) -> bool:
    """Whether the thinking's text is sent (``thinking.display: "omitted"``: its blocks are empty)."""
    thinking = body.get("thinking")
    return not (isinstance(thinking, dict) and thinking.get("display") == "omitted")


def whole_message(generation: Generation, model: str, body: dict[str, Any], answer: AnswerReader | None,
                  stops: tuple[str, ...], request_id: str = "") -> dict[str, Any]:
    """A generation's message object, read as the request's answer reads."""
    finish, text = FINISH_REASONS[generation.finish_reason], generation.text
    stopped_on = stop_sequence(text, generation.finish_reason, stops)
    if stopped_on is not None:
        text = text[: len(text) - len(stopped_on)]
    reasoning, calls = "", []
    if answer is not None:
        piece = answer.step(text, finish)
        reasoning, text, calls = piece.reasoning, piece.content, piece.calls
    content = [thinking_block(reasoning if shows_thinking(body) else "")] if reasoning else []
    if text.strip(WHITESPACE) or not calls:
        content.append(text_block(text))
    content += [tool_use_block(call) for call in calls]
    return {"id": message_id(request_id), "type": "message", "role": "assistant", "model": model, "content": content,
            **ended(finish, bool(calls), stopped_on), "usage": message_usage(generation.stats, generation.stats.prompt_tokens, len(generation.token_ids))}
