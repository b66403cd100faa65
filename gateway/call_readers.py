"""Reading a model's tool calls back from its text as it streams, one `CallReader` per layout
(gateway/call_layouts.py): the content around the calls, each call once it is whole, and, for
OpenAI's streamed deltas, each call from the moment its name is read, then its arguments' text
as it arrives.

A call whose JSON opens with its name and then its arguments object, as the models of every
layout write it (``{"name": "f", "arguments": {`` or ``"parameters"``), is a call from there on:
its arguments are that object's text as the model wrote it, up to the brace that closes it (in an
answer cut short, what there is of it). Any other JSON is read when it is whole: a call of an
offered function (its arguments written out again as JSON text), or text. Either way, a stream
read in any pieces reads as the whole answer does.

    >>> from pardec.gateway.tools import Tool, ToolUse
    >>> reader = BareJsonReader(ToolUse((Tool("get_weather"),)))
    >>> for piece in ('{"name": "get_', 'weather", "parameters": {"ci', 'ty": "Paris"}}'):
    ...     print([(d.index, d.name, d.arguments) for d in reader.step(piece).deltas])
    []
    [(0, 'get_weather', '{"ci')]
    [(0, '', 'ty": "Paris"}')]
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from pardec.gateway.tools import ToolCall, ToolUse, call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
WHITESPACE = " \t\n\r"
NAME_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
# A call's head, in order: whitespace, literals (any one of them), the function's name.
_SPACE, _NAME = "space", "name"
HEAD = (_SPACE, ("{",), _SPACE, ('"name"',), _SPACE, (":",), _SPACE, _NAME, _SPACE, (",",), _SPACE,
        ('"arguments"', '"parameters"'), _SPACE, (":",), _SPACE, ("{",))
# The most characters a cut-short JSON token ("fals", "1.5e+", a "\\u00" escape) runs past where
# the decoder reports it: an error before them is the text's, not the cut's.
JSON_LOOKAHEAD = 8


@dataclass(frozen=True)
class CallDelta:
    """OpenAI's streamed ``tool_calls`` entry: the call's ``index`` among the answer's calls, its
    ``id`` and ``name`` on its first delta only, and its arguments' text that is new."""

    index: int
    arguments: str
    id: str = ""
    name: str = ""


@dataclass(frozen=True)
class ReadPiece:
    """What one piece of the text reads as: its ``content``, the ``calls`` it completes, the
    ``deltas`` it streams, and the finish reason as it reads with the calls (on the last piece)."""

    content: str
    calls: list[ToolCall]
    deltas: list[CallDelta]
    finish_reason: str


def read_head(text: str, names: set[str]) -> tuple[str, int] | bool | None:
    """Whether ``text`` opens a call of one of ``names`` with its name and then its arguments
    object: (the name, where the object's "{" is), False, or None while the text could still go
    either way.

    >>> read_head(' {"name": "f", "arguments": {"a', {"f"}), read_head('{"name": "f", "argu', {"f"})
    (('f', 28), None)
    >>> read_head('{"name": "g", "arguments": {', {"f"}), read_head('{"arguments": {}, "name": "f"}', {"f"})
    (False, False)
    """
    at, name = 0, ""
    for part in HEAD:
        if part == _SPACE:
            while at < len(text) and text[at] in WHITESPACE:
                at += 1
            if at == len(text):
                return None
        elif part == _NAME:
            if text[at] != '"':
                return False
            end = at + 1
            while end < len(text) and text[end] != '"':
                if text[end] not in NAME_CHARACTERS:
                    return False
                end += 1
            if end == len(text):
                return None
            name, at = text[at + 1:end], end + 1
            if name not in names:
                return False
        else:
            rest = text[at:]
            taken = next((literal for literal in part if rest.startswith(literal)), None)
            if taken is None:
                return None if any(literal.startswith(rest) for literal in part) else False
            at += len(taken)
    return name, at - 1


@dataclass
class _OpenCall:
    """A call whose name is read and whose arguments object is streaming: the object's text is
    scanned for the brace that closes it (strings and escapes kept apart)."""

    name: str
    index: int  # -1: dropped (parallel calls off, and a call came before)
    id: str = field(default_factory=call_id)
    parts: list[str] = field(default_factory=list)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    closed: bool = False

    def scan(self, text: str) -> int:
        """How much of ``text`` is the object's (all of it, while the object stays open)."""
        for at, character in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif character == "\\":
                    self.escaped = True
                elif character == '"':
                    self.in_string = False
            elif character == '"':
                self.in_string = True
            elif character in "{[":
                self.depth += 1
            elif character in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = True
                    self.parts.append(text[:at + 1])
                    return at + 1
        self.parts.append(text)
        return len(text)


class CallReader(ABC):
    """Reads the model's text as it streams: `feed` returns the text that is content (never a
    piece of a call); `calls` grows as each call is whole; `finish` returns what is left. Text
    that is not a call of an offered function stays text, so nothing is lost; with ``parallel``
    false the calls after the first are dropped."""

    def __init__(self, tools: ToolUse):
        self.tools = tools
        self.names = {tool.name for tool in tools.tools}
        self.calls: list[ToolCall] = []
        self._pending = ""  # text not yet given out
        self._open: _OpenCall | None = None
        self._started = 0  # calls begun (kept ones): the next one's index
        self._given = 0  # calls `step` has returned
        self._deltas: list[CallDelta] = []

    @abstractmethod
    def feed(self, text: str) -> str:
        """The content in ``text`` (and in what was held back before it) that can be given out now."""

    @abstractmethod
    def finish(self) -> str:
        """The text left at the end; a call still open ends with the arguments it has."""

    def step(self, text: str, finish_reason: str = "") -> ReadPiece:
        """One piece of a stream. The last piece has the finish reason; a whole answer is one piece."""
        content = self.feed(text) + (self.finish() if finish_reason else "")
        calls, self._given = self.calls[self._given:], len(self.calls)
        deltas, self._deltas = _joined(self._deltas), []
        return ReadPiece(content, calls, deltas, finish_reason and self.tools.finish_reason(self.calls, finish_reason))

    def _begin(self, name: str) -> None:
        kept = self.tools.parallel or not self._started
        self._open = _OpenCall(name, self._started if kept else -1)
        if kept:
            self._started += 1
            self._deltas.append(CallDelta(self._open.index, "", self._open.id, name))

    def _arguments(self, text: str) -> int:
        """Feeds the open call's arguments; how much of ``text`` they took."""
        call = self._open
        used = call.scan(text)
        if call.index >= 0 and used:
            self._deltas.append(CallDelta(call.index, text[:used]))
        if call.closed:
            self._end()
        return used

    def _end(self) -> None:
        call, self._open = self._open, None
        if call.index >= 0:
            self.calls.append(ToolCall(call.name, "".join(call.parts), call.id))

    def _take(self, call) -> bool:
        """Whether ``call`` (whole, decoded JSON) is a call of an offered function; if so, it is one of `calls`."""
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
        if self.tools.parallel or not self._started:
            made = ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))
            self._deltas.append(CallDelta(self._started, made.arguments, made.id, made.name))
            self._started += 1
            self.calls.append(made)
        return True


class TaggedReader(CallReader):
    """``hermes``: a call is the JSON object between <tool_call> and </tool_call>. A possible
    tag's start is held back; an unclosed block at the end is read where its JSON is whole."""

    OUTSIDE, HEAD, ARGUMENTS, TRAILER, WHOLE = range(5)

    def __init__(self, tools: ToolUse):
        super().__init__(tools)
        self._state = self.OUTSIDE
        self._after_call = False  # the last thing read was a call

    def feed(self, text: str) -> str:
        self._pending += text
        out = []
        while True:
            if self._state == self.OUTSIDE:
                if self._after_call:  # between and after calls, whitespace is the layout's, not content
                    self._pending = self._pending.lstrip()
                    self._after_call = not self._pending
                start = self._pending.find(OPEN)
                if start < 0:
                    keep = partial_tag(self._pending, OPEN)
                    out.append(self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return "".join(out)
                out.append(self._pending[:start])
                self._pending, self._state = self._pending[start + len(OPEN):], self.HEAD
            if self._state == self.HEAD:
                head = read_head(self._pending, self.names)
                if head is None:
                    return "".join(out)
                if head is False:
                    self._state = self.WHOLE
                else:
                    self._begin(head[0])
                    self._pending, self._state = self._pending[head[1]:], self.ARGUMENTS
            if self._state == self.ARGUMENTS:
                self._pending = self._pending[self._arguments(self._pending):]
                if self._open is not None:
                    return "".join(out)
                self._state = self.TRAILER
            if self._state == self.TRAILER:  # the call's own closing brace and tag: the layout's
                end = self._pending.find(CLOSE)
                if end < 0:
                    self._pending = self._pending[len(self._pending) - partial_tag(self._pending, CLOSE):]
                    return "".join(out)
                self._pending, self._state, self._after_call = self._pending[end + len(CLOSE):], self.OUTSIDE, True
            if self._state == self.WHOLE:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return "".join(out)
                body, self._pending, self._state = self._pending[:end], self._pending[end + len(CLOSE):], self.OUTSIDE
                self._after_call = self._read(body)
                out.append("" if self._after_call else OPEN + body + CLOSE)

    def finish(self) -> str:
        pending, self._pending = self._pending, ""
        if self._state == self.ARGUMENTS:
            self._end()
        if self._state in (self.ARGUMENTS, self.TRAILER) or (self._state == self.WHOLE and self._read(pending)):
            return ""
        return pending if self._state == self.OUTSIDE else OPEN + pending

    def _read(self, body: str) -> bool:
        try:
            return self._take(json.loads(body))
        except (ValueError, RecursionError):
            return False


class BareJsonReader(CallReader):
    """``llama3_json``: an answer that opens with "{" is calls, one JSON object each, "; "
    between them; any other answer is text. What follows the calls (but whitespace) is text; an
    object still open at the end, that is not a call from its head, is text."""

    START, HEAD, ARGUMENTS, TRAILER, BETWEEN, WHOLE, TEXT = range(7)

    def __init__(self, tools: ToolUse):
        super().__init__(tools)
        self._state = self.START
        self._held = ""  # what precedes the object being read (whitespace, "; "): text if it is no call

    def feed(self, text: str) -> str:
        if self._state == self.TEXT:
            return text
        self._pending += text
        while True:
            if self._state in (self.START, self.BETWEEN, self.TRAILER):
                rest = self._pending.lstrip()
                if self._state == self.BETWEEN and rest.startswith(";"):
                    rest = rest[1:].lstrip()
                if not rest:
                    return ""
                if rest[0] != ("}" if self._state == self.TRAILER else "{"):
                    return self._as_text()
                if self._state == self.TRAILER:  # the call's own closing brace
                    self._pending, self._state = rest[1:], self.BETWEEN
                else:
                    self._held, self._pending = self._pending[:len(self._pending) - len(rest)], rest
                    self._state = self.HEAD
            if self._state == self.HEAD:
                head = read_head(self._pending, self.names)
                if head is None:
                    return ""
                if head is False:
                    self._state = self.WHOLE
                else:
                    self._begin(head[0])
                    self._held, self._pending, self._state = "", self._pending[head[1]:], self.ARGUMENTS
            if self._state == self.ARGUMENTS:
                self._pending = self._pending[self._arguments(self._pending):]
                if self._open is not None:
                    return ""
                self._state = self.TRAILER
            if self._state == self.WHOLE:  # an object read when it is whole
                try:
                    call, end = json.JSONDecoder().raw_decode(self._pending)
                except RecursionError:
                    return self._as_text()
                except json.JSONDecodeError as error:
                    return self._as_text() if _broken(error, self._pending) else ""
                if not self._take(call):
                    return self._as_text()
                self._held, self._pending, self._state = "", self._pending[end:], self.BETWEEN

    def finish(self) -> str:
        pending, self._pending = self._pending, ""
        if self._state == self.ARGUMENTS:
            self._end()
            return ""
        if self._state in (self.BETWEEN, self.TRAILER) and not pending.strip():
            return ""
        return self._held + pending

    def _as_text(self) -> str:
        self._state = self.TEXT
        text, self._held, self._pending = self._held + self._pending, "", ""
        return text


def _joined(deltas: list[CallDelta]) -> list[CallDelta]:
    """Deltas of the same call next to each other as one (its first's id and name kept)."""
    joined: list[CallDelta] = []
    for delta in deltas:
        if joined and joined[-1].index == delta.index:
            last = joined[-1]
            joined[-1] = CallDelta(last.index, last.arguments + delta.arguments, last.id, last.name)
        else:
            joined.append(delta)
    return joined


def _broken(error: json.JSONDecodeError, text: str) -> bool:
    """Whether no text that ``text`` starts can be JSON: the decoder failed before its last few
    characters (where a literal, number or escape may be cut short), not inside an open string."""
    return error.pos < len(text) - JSON_LOOKAHEAD and not error.msg.startswith("Unterminated string")


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that a ``tag`` starts with."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
