"""A request's input, protobuf-free: a prompt or a conversation, checked and tokenized.

A request carries exactly one of ``prompt`` (one user message; with ``raw``, text sent as it is,
no chat template) and ``messages`` (a conversation rendered with the model's chat template).
Whatever the client wrote is tokenized as text: a control token's spelling inside it stays
characters (verifier/model/tokenizer.py), so no message can close its turn or forge another.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from pardec.gateway.call_layouts import calls_text, response_text, tools_preamble
from pardec.gateway.tools import ToolCall, ToolUse, is_json_object
from pardec.runtime.errors import InvalidArgument

SYSTEM, USER, ASSISTANT, TOOL = "system", "user", "assistant", "tool"
ROLES = (SYSTEM, USER, ASSISTANT, TOOL)
# Rendering costs grow with the count: a conversation of a million empty messages fits in a few
# MiB, so the count is capped as the characters are (rules.py MAX_PROMPT_CHARS).
MAX_MESSAGES = 4096
# The variables a chat template is rendered with that the server sets itself.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
MAX_VARIABLES_CHARS = 64 * 1024


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: str  # "system", "user", "assistant" or "tool"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's: the calls it made
    tool_call_id: str = ""  # a tool's: the call whose result the content is


def check_input(prompt: str, messages: tuple[Message, ...], raw: bool, continue_final: bool = False) -> None:
    """Raises InvalidArgument naming the field unless the input is exactly one of a non-empty
    prompt and a well-formed conversation: an optional system message first, user messages and
    assistant replies after it in any order, each assistant's tool calls answered by tool
    messages right after it, and a non-empty user message or a tool's result last (the reply to
    it is what is generated); with ``continue_final``, an assistant's text last (what is
    generated goes on from it)."""
    if prompt and messages:
        raise InvalidArgument("messages: set prompt or messages, not both")
    if not messages:
        if continue_final:
            raise InvalidArgument("continue_final_message: continues the last of messages; send messages")
        if not prompt:
            raise InvalidArgument("prompt: must not be empty (or send messages instead)")
        return
    if raw:
        raise InvalidArgument("raw: a raw completion sends prompt as text; messages always take the chat template")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages: {len(messages)} messages; at most {MAX_MESSAGES}")
    calls: set[str] = set()  # the ids of the calls the last assistant message made
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"messages[{index}].role: {message.role[:40]!r} is not a role (system, user, assistant or tool)"
            )
        if message.role == SYSTEM and index != 0:
            raise InvalidArgument(f"messages[{index}].role: a system message must be the first message")
        if message.role == USER and not message.content:
            raise InvalidArgument(f"messages[{index}].content: a user message must not be empty")
        if message.tool_calls and message.role != ASSISTANT:
            raise InvalidArgument(f"messages[{index}].tool_calls: only an assistant message makes tool calls")
        for number, call in enumerate(message.tool_calls):
            if not is_json_object(call.arguments):
                raise InvalidArgument(f"messages[{index}].tool_calls[{number}].function.arguments: must be a JSON "
                                      "object's text")
        if message.role == TOOL and message.tool_call_id not in calls:
            raise InvalidArgument(f"messages[{index}].tool_call_id: {message.tool_call_id[:80]!r} answers no "
                                  "tool call of the assistant message before it")
        if message.role != TOOL:
            calls = {call.id for call in message.tool_calls}
    last = len(messages) - 1
    if continue_final:
        if messages[-1].role != ASSISTANT or messages[-1].tool_calls or not messages[-1].content:
            raise InvalidArgument(f"messages[{last}]: with continue_final_message the conversation must end with "
                                  "an assistant message's text (no tool calls), which the answer goes on from")
    elif messages[-1].role not in (USER, TOOL):
        raise InvalidArgument(
            f"messages[{last}].role: the conversation must end with a user or tool message, not {messages[-1].role} "
            "(continue_final_message goes on from an assistant's)"
        )


def input_chars(prompt: str, messages: tuple[Message, ...]) -> int:
    """Characters the client wrote: what MAX_PROMPT_CHARS caps before anything is tokenized."""
    return len(prompt) + sum(len(message.content) + sum(len(call.arguments) for call in message.tool_calls)
                             for message in messages)


def template_variables(value: Any) -> str:
    """``chat_template_kwargs`` (vLLM's): the chat template's own variables, as a JSON object
    (Qwen3's ``{"enable_thinking": false}``), or its text; checked, and returned as JSON text.

    >>> template_variables({"enable_thinking": False}), template_variables(None)
    ('{"enable_thinking": false}', '')
    >>> template_variables('{"tools": []}')
    Traceback (most recent call last):
    ...
    pardec.runtime.errors.InvalidArgument: chat_template_kwargs.tools: is the server's to set, not the request's
    """
    if value in (None, ""):
        return ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidArgument("chat_template_kwargs: must be a JSON object's text") from None
    if not isinstance(value, dict):
        raise InvalidArgument("chat_template_kwargs: must be an object of the chat template's variables")
    for key in value:
        if not key.isidentifier():
            raise InvalidArgument(f"chat_template_kwargs: {key[:40]!r} is not a variable's name")
        if key in RESERVED_VARIABLES:
            raise InvalidArgument(f"chat_template_kwargs.{key}: is the server's to set, not the request's")
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_VARIABLES_CHARS:
        raise InvalidArgument(f"chat_template_kwargs: at most {MAX_VARIABLES_CHARS} characters as JSON")
    return text


def input_tokens(tokenizer, prompt: str, messages: tuple[Message, ...], raw: bool,
                 tools: ToolUse | None = None, variables: str = "", continue_final: bool = False) -> list[int]:
    """The prompt's token ids: the conversation (or the prompt as one user message) with the chat
    template, the request's tools and template ``variables`` (`template_variables`' text), or the
    raw prompt without one. ``continue_final``: the last (assistant) message left open."""
    check_input(prompt, messages, raw, continue_final)
    if raw:
        if tools or variables:
            raise InvalidArgument(f"{'tools' if tools else 'chat_template_kwargs'}: a raw prompt takes no chat "
                                  "template")
        return tokenizer.encode_raw(prompt)
    messages = messages or (Message(USER, prompt),)
    values = json.loads(variables) if variables else None
    try:
        if tokenizer.takes_tools:
            definitions = [tool.as_template() for tool in tools.tools] if tools else None
            return tokenizer.encode_messages([_turn(message) for message in messages], definitions, values,
                                             continue_final)
        return tokenizer.encode_messages(_turns_without_tools(messages, tools), None, values, continue_final)
    except TemplateError as error:  # the template's raise_exception: a conversation it does not take
        raise InvalidArgument(f"messages: the model's chat template refuses this conversation: {error}") from None
    except (TypeError, ValueError) as error:  # a template (an operator's, --chat-template) that fails on it
        raise InvalidArgument(f"messages: the model's chat template cannot render this conversation: "
                              f"{type(error).__name__}: {str(error)[:200]}") from None


def _turn(message: Message) -> dict:
    """One message as a template that takes tools reads it."""
    turn = {"role": message.role, "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = [call.as_template() for call in message.tool_calls]
    if message.role == TOOL:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _turns_without_tools(messages: tuple[Message, ...], tools: ToolUse | None) -> list[dict]:
    """The conversation for a template with no place for tools: the tools described in the
    system message, calls written out in their assistant turns, and each run of tool results as
    one user turn (a role every template takes)."""
    turns: list[dict] = []
    for message in messages:
        content = message.content
        if message.tool_calls:
            content = "\n".join(filter(None, (content, calls_text(message.tool_calls))))
        if message.role != TOOL:
            turns.append({"role": message.role, "content": content})
        elif turns[-1].get("tool"):
            turns[-1]["content"] += "\n" + response_text(content)
        else:
            turns.append({"role": USER, "content": response_text(content), "tool": True})
    if tools:
        if turns[0]["role"] == SYSTEM:
            turns[0]["content"] += "\n\n" + tools_preamble(tools)
        else:
            turns.insert(0, {"role": SYSTEM, "content": tools_preamble(tools)})
    return [{"role": turn["role"], "content": turn["content"]} for turn in turns]
