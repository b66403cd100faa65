"""A request's input, protobuf-free: a prompt or a conversation, checked and tokenized.

A request carries exactly one of ``prompt`` (one user message; with ``raw``, text sent as it is,
no chat template) and ``messages`` (a conversation rendered with the model's chat template).
Whatever the client wrote is tokenized as text: a control token's spelling inside it stays
characters (verifier/model/tokenizer.py), so no message can close its turn or forge another.
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2.exceptions import TemplateError

from pardec.runtime.errors import InvalidArgument

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
ROLES = (SYSTEM, USER, ASSISTANT)
# Rendering costs grow with the count: a conversation of a million empty messages fits in a few
# MiB, so the count is capped as the characters are (rules.py MAX_PROMPT_CHARS).
MAX_MESSAGES = 4096


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: str  # "system", "user" or "assistant"
    content: str


def check_input(prompt: str, messages: tuple[Message, ...], raw: bool) -> None:
    """Raises InvalidArgument naming the field unless the input is exactly one of a non-empty
    prompt and a well-formed conversation: an optional system message first, user messages and
    assistant replies after it in any order, a non-empty user message last (its reply is what
    is generated)."""
    if prompt and messages:
        raise InvalidArgument("messages: set prompt or messages, not both")
    if not messages:
        if not prompt:
            raise InvalidArgument("prompt: must not be empty (or send messages instead)")
        return
    if raw:
        raise InvalidArgument("raw: a raw completion sends prompt as text; messages always take the chat template")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages: {len(messages)} messages; at most {MAX_MESSAGES}")
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidArgument(
                f"messages[{index}].role: {message.role[:40]!r} is not a role (system, user or assistant)"
            )
        if message.role == SYSTEM and index != 0:
            raise InvalidArgument(f"messages[{index}].role: a system message must be the first message")
        if message.role == USER and not message.content:
            raise InvalidArgument(f"messages[{index}].content: a user message must not be empty")
    if messages[-1].role != USER:
        raise InvalidArgument(
            f"messages[{len(messages) - 1}].role: the conversation must end with a user message, "
            f"not {messages[-1].role}"
        )


def input_chars(prompt: str, messages: tuple[Message, ...]) -> int:
    """Characters the client wrote: what MAX_PROMPT_CHARS caps before anything is tokenized."""
    return len(prompt) + sum(len(message.content) for message in messages)


def input_tokens(tokenizer, prompt: str, messages: tuple[Message, ...], raw: bool) -> list[int]:
    """The prompt's token ids: the conversation (or the prompt as one user message) with the chat
    template, or the raw prompt without one."""
    check_input(prompt, messages, raw)
    if raw:
        return tokenizer.encode_raw(prompt)
    turns = [{"role": m.role, "content": m.content} for m in messages] or [{"role": USER, "content": prompt}]
    try:
        return tokenizer.encode_messages(turns)
    except TemplateError as error:  # the template's raise_exception: a conversation it does not take
        raise InvalidArgument(f"messages: the model's chat template refuses this conversation: {error}") from None
