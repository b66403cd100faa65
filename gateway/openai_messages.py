"""The texts of an OpenAI body: chat messages and the predicted output, each a string or an
array of text parts.

    >>> chat_message(0, {"role": "user", "content": [{"type": "text", "text": "Hi, "},
    ...                                               {"type": "text", "text": "there"}]}).content
    'Hi, there'
    >>> predicted_text({"type": "content", "content": "def f():\\n    return 1\\n"})
    'def f():\\n    return 1\\n'
"""

from __future__ import annotations

from typing import Any

from pardec.gateway.chat import ASSISTANT, SYSTEM, TOOL, USER, Message
from pardec.gateway.openai_tools import call_id_of, message_calls, valid_text
from pardec.runtime.errors import InvalidArgument

ROLES = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}


def chat_message(index: int, message: Any) -> Message:
    """``messages[index]`` of a chat body."""
    if not isinstance(message, dict):
        raise InvalidArgument(f"messages[{index}]: must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidArgument(
            f"messages[{index}].role: {show(role)} is not a role this server takes (system, developer, user, "
            "assistant, tool)"
        )
    calls = message_calls(index, message)
    content = message.get("content")
    if content is None and calls:  # an assistant message that only calls tools
        content = ""
    call_id = call_id_of(index, message) if role == "tool" else ""
    return Message(ROLES[role], text_content(content, f"messages[{index}].content"), calls, call_id)


def predicted_text(value: Any) -> str:
    """OpenAI's Predicted Outputs, ``{"type": "content", "content": ...}``; "" when absent."""
    if value is None:
        return ""
    if not isinstance(value, dict) or value.get("type") != "content" or "content" not in value:
        raise InvalidArgument('prediction: must be {"type": "content", "content": a string or an array of text '
                              f'parts}}, got {show(value)}')
    return text_content(value["content"], "prediction.content")


def text_content(content: Any, field: str) -> str:
    """A string, or an array of text parts joined."""
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f'{field}[{index}]: only text parts {{"type": "text", "text": ...}} are supported')
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidArgument(f"{field}: must be a string or an array of text parts")
    return valid_text(content, field)


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."
