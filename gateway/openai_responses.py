"""OpenAI's Responses API (``POST /v1/responses``), protobuf-free: a body becomes the chat
request it means (openai_api.chat_request: one set of rules for both), and a generation becomes a
response object or its stream of events, with the thinking as a ``reasoning`` item, the answer as
a ``message`` item and each tool call as a ``function_call`` item.

Nothing is stored: ``previous_response_id`` is refused (the client sends the conversation in
``input``: its messages, ``function_call`` items and their ``function_call_output`` items).

    >>> body = chat_body({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 8})[0]
    >>> body["messages"], body["max_completion_tokens"]
    ([{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}], 8)
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from pardec.gateway.answers import AnswerReader, thinking_tokens
from pardec.gateway.outputs import Generation, Stats
from pardec.gateway.json_scan import WHITESPACE
from pardec.gateway.openai_replies import FINISH_REASONS, usage
from pardec.gateway.tools import is_json_object
from pardec.runtime.errors import InvalidArgument, PardecError

# Fields of a Responses body that mean what a chat body's fields mean, under the same name.
_SAME = ("model", "temperature", "top_p", "tool_choice", "parallel_tool_calls", "top_k", "min_p", "seed",
         "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "min_tokens",
         "logit_bias", "allowed_token_ids", "ignore_eos", "include_stop_str_in_output", "parallel_decoding",
         "session_id", "draft", "cache_salt", "chat_template_kwargs", "structured_outputs", "user", "metadata",
         "thinking_token_budget", "bad_words", "priority")
_HARMLESS = ("stream", "store", "include", "reasoning", "service_tier", "safety_identifier", "prompt_cache_key",
             "max_tool_calls", "stream_options", "text", "tools", "input", "instructions", "max_output_tokens",
             "truncation", "background", "previous_response_id", "prompt", "conversation", "top_logprobs")
FIELDS = frozenset((*_SAME, *_HARMLESS))
_REFUSED = {
    "previous_response_id": "responses are not stored here: send the conversation in input",
    "conversation": "conversations are not stored here: send the conversation in input",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "background": "background responses are not supported",
    "top_logprobs": "log-probabilities are not returned here (POST /v1/chat/completions returns them)",
}
_ROLES = {"user", "system", "developer", "assistant"}


def chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The chat completions body a Responses body means, and each chat message's name in the
    Responses body (``instructions`` or ``input[i]``), to name it in errors."""
    if not isinstance(body, dict):
        raise InvalidArgument("body: must be a JSON object")
    for name, rule in _REFUSED.items():
        if body.get(name) not in (None, False, 0):
            raise InvalidArgument(f"{name}: {rule}")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidArgument("truncation: only \"disabled\" (an input over the context is refused, not cut)")
    chat = {name: body[name] for name in _SAME if name in body}
    chat["messages"], names = _messages(body.get("instructions"), body.get("input"))
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict):  # {"type": "function", "name": ...}
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidArgument('tool_choice: must be "auto", "none", "required" or {"type": "function", "name": ...}')
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise InvalidArgument("text: must be an object with format")
        chat.update(_format(text.get("format")))
    return chat, names


def _messages(instructions: Any, items: Any) -> tuple[list[dict[str, Any]], list[str]]:
    messages, names = [], []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidArgument("instructions: must be a string")
        messages.append({"role": "system", "content": instructions})
        names.append("instructions")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("input: required, a string or a non-empty array of items")
    for index, item in enumerate(items):
        field = f"input[{index}]"
        if not isinstance(item, dict):
            raise InvalidArgument(f"{field}: must be an object (a message, a function_call or its output)")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise InvalidArgument(f"{field}.role: must be one of user, system, developer, assistant")
            content = _content(field, item.get("content"))
            if role in ("system", "developer") and names == ["instructions"]:
                messages[0]["content"] += "\n\n" + content  # the instructions' one system message (Codex sends both)
                continue
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str) or not item[name]:
                    raise InvalidArgument(f"{field}.{name}: a function_call item's {name} must be a non-empty string")
            if not is_json_object(item["arguments"]):
                raise InvalidArgument(f"{field}.arguments: must be a JSON object's text")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)  # one turn: its text, then its calls
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise InvalidArgument(f"{field}.call_id: names the function_call this output answers")
            output = item.get("output")
            if not isinstance(output, (str, list)):
                raise InvalidArgument(f"{field}.output: must be a string or an array of text parts")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _texts(f"{field}.output", output)})
        elif kind == "reasoning":
            continue  # earlier thinking is not sent back, as chat templates leave it out
        else:
            raise InvalidArgument(f"{field}.type: {str(kind)[:40]!r} is not an item this server takes (message, "
                                  "function_call, function_call_output, reasoning)")
        names.append(field)
    return messages, names


def _content(field: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{field}.content: must be a string or an array of text parts")
    return _texts(f"{field}.content", content)


def _texts(field: str, parts: list) -> str:
    texts = []
    for index, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or not \
                isinstance(part.get("text"), str):
            raise InvalidArgument(f'{field}[{index}]: only text parts {{"type": "input_text", "text": ...}} are '
                                  "supported")
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidArgument("tools: must be an array of {\"type\": \"function\", \"name\": ...} objects")
    functions = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidArgument(f"tools[{index}].type: {str(kind)[:40]!r} is not supported; only \"function\"")
        functions.append({"type": "function", "function": {
            name: tool[name] for name in ("name", "description", "parameters", "strict") if name in tool}})
    return functions


def _format(value: Any) -> dict[str, Any]:
    if value is None or (isinstance(value, dict) and value.get("type") == "text"):
        return {}
    if isinstance(value, dict) and value.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict) and value.get("type") == "json_schema":
        schema = {name: value[name] for name in ("name", "schema", "strict", "description") if name in value}
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise InvalidArgument('text.format: must be {"type": "text"}, {"type": "json_object"} or '
                          '{"type": "json_schema", "name": ..., "schema": {...}}')


_CHAT_NAMES = [(re.compile(r"^(?:max_completion_tokens|max_tokens|max_new_tokens)\b"), "max_output_tokens"),
               (re.compile(r"^response_format(?:\.json_schema)?"), "text.format"),
               (re.compile(r"^(tools\[\d+\])\.function\b"), r"\1")]


def renamed(error: PardecError, names: list[str]) -> PardecError:
    """A chat request's error, its field named as the Responses body names it.

    >>> str(renamed(InvalidArgument("messages[1].content: bad"), ["instructions", "input[0]"]))
    'input[0].content: bad'
    """
    message = str(error)
    match = re.match(r"^messages\[(\d+)\]", message)
    if match and int(match.group(1)) < len(names):
        rest = message[match.end():]
        message = names[int(match.group(1))] + (".call_id" + rest[len(".tool_call_id"):]
                                                 if rest.startswith(".tool_call_id") else rest)
    elif message.startswith("messages:"):
        message = "input" + message[len("messages"):]
    for pattern, name in _CHAT_NAMES:
        message = pattern.sub(name, message, count=1)
    return error.reworded(message)


def response_id(request_id: str = "") -> str:
    """Named after the request where it has an id (as chat completions' replies are), else new."""
    return "resp_" + (request_id or uuid.uuid4().hex)


def response_object(response: str, created: int, model: str, body: dict[str, Any], output: list[dict],
                    stats: Stats | None, tokens: int, finish: str, status: str | None = None,
                    reasoning_tokens: int = 0) -> dict[str, Any]:
    """The response object: ``output`` items, its status from the finish reason, the usage."""
    incomplete = finish == "length"
    usage_of = None
    if stats is not None:
        chat_usage = usage(stats, tokens)
        usage_of = {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": tokens,
                    "total_tokens": chat_usage["total_tokens"],
                    "input_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
                    "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "pardec": chat_usage["pardec"]}
    text = body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}}
    return {
        "id": response, "object": "response", "created_at": created, "model": model,
        "status": status or ("incomplete" if incomplete else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status is None else None,
        "error": None, "output": output, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0), "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "text": text, "metadata": body.get("metadata") or {},
        "previous_response_id": None, "reasoning": body.get("reasoning"), "store": False, "truncation": "disabled",
        "usage": usage_of, "user": body.get("user"),
    }


def reasoning_item(item_id: str, text: str, done: bool = True) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if done else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": "completed" if done else "in_progress"}


def message_item(item_id: str, text: str, done: bool = True) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
    return {"type": "message", "id": item_id, "role": "assistant", "content": content,
            "status": "completed" if done else "in_progress"}


def call_item(item_id: str, call_id: str, name: str, arguments: str, done: bool = True) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed" if done else "in_progress"}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def whole_response(generation: Generation, model: str, body: dict[str, Any], created: int,
                   answer: AnswerReader | None, tokenizer, request_id: str = "") -> dict[str, Any]:
    """A generation's response object, read as the request's answer reads."""
    finish, reasoning, text, calls = FINISH_REASONS[generation.finish_reason], "", generation.text, []
    if answer is not None:
        piece = answer.step(text, finish)
        reasoning, text, calls = piece.reasoning, piece.content, piece.calls
    output = [reasoning_item(_item_id("rs"), reasoning)] if reasoning else []
    if text.strip(WHITESPACE) or not calls:
        output.append(message_item(_item_id("msg"), text))
    output += [call_item(_item_id("fc"), call.id, call.name, call.arguments) for call in calls]
    return response_object(response_id(request_id), created, model, body, output, generation.stats,
                           len(generation.token_ids), finish,
                           reasoning_tokens=thinking_tokens(tokenizer, generation.token_ids, reasoning))
