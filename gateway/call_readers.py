"""Reading a model's tool calls back from its text as it streams, one `CallReader` per layout
(gateway/call_layouts.py): the content around the calls, each call once it is whole, and, for
OpenAI's streamed deltas, each call from the moment its name is read, then its arguments' text
as it arrives.

A call whose JSON opens with its name and then its arguments object, as the models of every
layout write it (``{"name": "f", "arguments": {`` or ``"parameters"``), is a call from there on:
its arguments are that object's text as the model wrote it, up to the brace that closes it (in an
answer cut short, or a block closed early, what there is of it), and the rest of the call's
object (keys after the arguments, its closing brace) is the call's, not content. Any other JSON
is read when it is whole: a call of an offered function (its arguments written out again as JSON
text), or text. Braces and tags are only read outside JSON strings. Either way, a stream read in
any pieces reads as the whole answer does, and each character is scanned once.

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

from pardec.gateway.json_scan import CLOSED, TAG, WHITESPACE, JsonScan, broken, partial_tag
from pardec.gateway.tools import ToolCall, ToolUse, call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
# A call's head, in order: whitespace, literals (any one of them), the function's name.
_SPACE, _NAME = "space", "name"
HEAD = (_SPACE, ("{",), _SPACE, ('"name"',), _SPACE, (":",), _SPACE, _NAME, _SPACE, (",",), _SPACE,
        ('"arguments"', '"parameters"'), _SPACE, (":",), _SPACE, ("{",))
# A head longer than this is none (a name is at most 64 characters): it is read whole instead,
# and no text is scanned again and again.
MAX_HEAD_CHARS = 256


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
    whole = len(text) > MAX_HEAD_CHARS
    text = text[:MAX_HEAD_CHARS]
    at, name = 0, ""
    for part in HEAD:
        if part == _SPACE:
            while at < len(text) and text[at] in WHITESPACE:
                at += 1
            if at == len(text):
                return False if whole else None
        elif part == _NAME:
            if text[at] != '"':
                return False
            end = at + 1
            while end < len(text) and text[end] != '"':
                if text[end] not in NAME_CHARACTERS:
                    return False
                end += 1
            if end == len(text):
                return False if whole else None
            name, at = text[at + 1:end], end + 1
            if name not in names:
                return False
        else:
            rest = text[at:]
            taken = next((literal for literal in part if rest.startswith(literal)), None)
            if taken is None:
                return None if not whole and any(literal.startswith(rest) for literal in part) else False
            at += len(taken)
    return name, at - 1


@dataclass
class _OpenCall:
    """A call whose name is read and whose arguments object is streaming."""

    name: str
    index: int  # -1: dropped (parallel calls off, and a call came before)
    id: str = field(default_factory=call_id)
    parts: list[str] = field(default_factory=list)


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
        self._scan = JsonScan()
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
        self._open, self._scan = _OpenCall(name, self._started if kept else -1), JsonScan()
        if kept:
            self._started += 1
            self._deltas.append(CallDelta(self._open.index, "", self._open.id, name))

    def _arguments(self, tag: str = "") -> str:
        """Feeds the open call's arguments from the pending text; why the scan stopped (CLOSED:
        the call is whole; TAG: its block ended first, and it ends with what it has)."""
        used, why = self._scan.advance(self._pending, tag)
        call, text, self._pending = self._open, self._pending[:used], self._pending[used:]
        call.parts.append(text)
        if call.index >= 0 and text:
            self._deltas.append(CallDelta(call.index, text))
        if why in (CLOSED, TAG):
            self._end()
        return why

    def _end(self) -> None:
        call, self._open = self._open, None
        if call.index >= 0:
            self.calls.append(ToolCall(call.name, "".join(call.parts), call.id))

    def _take(self, call) -> bool:
        """Whether ``call`` (whole, decoded JSON) is a call of an offered function; if so, it is one of `calls`."""
        name = call.get("name") if isinstance(call, dict) else None
        if not (isinstance(name, str) and name in self.names):
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
            made = ToolCall(name, json.dumps(arguments, ensure_ascii=False))
            self._deltas.append(CallDelta(self._started, made.arguments, made.id, made.name))
            self._started += 1
            self.calls.append(made)
        return True


def _decoded(text: str):
    """``text`` as JSON, or None where it is not (a number too long for int() included)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class TaggedReader(CallReader):
    """``hermes``: a call is the JSON object between <tool_call> and </tool_call>. A possible
    tag's start is held back; an unclosed block at the end is read where its JSON is whole; what
    follows a call's object in its block other than the closing tag is text."""

    OUTSIDE, HEAD, ARGUMENTS, REST, AFTER, WHOLE = range(6)

    def __init__(self, tools: ToolUse):
        super().__init__(tools)
        self._state = self.OUTSIDE
        self._after_call = False  # the last thing read was a call
        self._scanned = 0  # WHOLE: how much of the block's text the scan has read

    def feed(self, text: str) -> str:
        self._pending += text
        out = []
        while True:
            if self._state == self.OUTSIDE:
                if self._after_call:  # between and after calls, whitespace is the layout's, not content
                    self._pending = self._pending.lstrip(WHITESPACE)
                    self._after_call = not self._pending
                start = self._pending.find(OPEN)
                if start < 0:
                    keep = len(self._pending) - partial_tag(self._pending, OPEN)
                    out.append(self._pending[:keep])
                    self._pending = self._pending[keep:]
                    return "".join(out)
                out.append(self._pending[:start])
                self._pending, self._state = self._pending[start + len(OPEN):], self.HEAD
            if self._state == self.HEAD:
                head = read_head(self._pending, self.names)
                if head is None:
                    return "".join(out)
                if head is False and not self._pending.lstrip(WHITESPACE).startswith("{"):
                    out.append(OPEN)  # no object follows the tag: it was text ("I use <tool_call> tags")
                    self._state = self.OUTSIDE
                    continue
                if head is False:
                    self._state, self._scan, self._scanned = self.WHOLE, JsonScan(), 0
                else:
                    self._begin(head[0])
                    self._pending, self._state = self._pending[head[1]:], self.ARGUMENTS
            if self._state == self.ARGUMENTS:
                why = self._arguments(CLOSE)
                if why == TAG:
                    self._close_block()
                    continue
                if why != CLOSED:
                    return "".join(out)
                self._state, self._scan = self.REST, JsonScan(depth=1)  # the call's object, after its arguments
            if self._state == self.REST:
                used, why = self._scan.advance(self._pending, CLOSE)
                self._pending = self._pending[used:]  # the call's own text
                if why == TAG:
                    self._close_block()
                    continue
                if why != CLOSED:
                    return "".join(out)
                self._state = self.AFTER
            if self._state == self.AFTER:  # the call's object ended: its closing tag, or text
                self._pending = self._pending.lstrip(WHITESPACE)
                if self._pending.startswith(CLOSE):
                    self._pending = self._pending[len(CLOSE):]
                    self._state, self._after_call = self.OUTSIDE, True
                elif not self._pending or CLOSE.startswith(self._pending):
                    return "".join(out)
                else:
                    self._state = self.OUTSIDE
                continue
            if self._state == self.WHOLE:
                while True:
                    used, why = self._scan.advance(self._pending[self._scanned:], CLOSE)
                    self._scanned += used
                    if why != CLOSED:
                        break
                if why != TAG:
                    return "".join(out)
                body, self._pending = self._pending[:self._scanned], self._pending[self._scanned + len(CLOSE):]
                self._state, self._after_call = self.OUTSIDE, self._read(body)
                out.append("" if self._after_call else OPEN + body + CLOSE)

    def _close_block(self) -> None:
        self._pending = self._pending[len(CLOSE):]
        self._state, self._after_call = self.OUTSIDE, True

    def finish(self) -> str:
        pending, self._pending = self._pending, ""
        if self._state == self.ARGUMENTS:
            self._end()
        if self._state in (self.ARGUMENTS, self.REST, self.AFTER) or (self._state == self.WHOLE and self._read(pending)):
            return ""
        return pending if self._state == self.OUTSIDE else OPEN + pending

    def _read(self, body: str) -> bool:
        return self._take(_decoded(body))


class BareJsonReader(CallReader):
    """``llama3_json``: an answer that opens with "{" is calls, one JSON object each, "; "
    between them; any other answer is text. What follows the calls (but whitespace and a last
    separator) is text; an object still open at the end, that is not a call from its head, is text."""

    START, HEAD, ARGUMENTS, REST, BETWEEN, WHOLE, TEXT = range(7)

    def __init__(self, tools: ToolUse):
        super().__init__(tools)
        self._state = self.START
        self._held = ""  # what precedes the object being read (whitespace, "; "): text if it is no call
        self._separated = False  # BETWEEN: the "; " read
        self._scanned = 0  # WHOLE: how much of the object's text the scan has read
        self._checked = 0  # WHOLE: the text's length when it was last tried as JSON

    def feed(self, text: str) -> str:
        if self._state == self.TEXT:
            return text
        self._pending += text
        while True:
            if self._state in (self.START, self.BETWEEN):
                stripped = self._pending.lstrip(WHITESPACE)
                self._held, self._pending = self._held + self._pending[:len(self._pending) - len(stripped)], stripped
                if self._state == self.BETWEEN and not self._separated and stripped.startswith(";"):
                    self._held, self._pending, self._separated = self._held + ";", stripped[1:], True
                    continue
                if not self._pending:
                    return ""
                if self._pending[0] != "{":
                    return self._as_text()
                self._state = self.HEAD
            if self._state == self.HEAD:
                head = read_head(self._pending, self.names)
                if head is None:
                    return ""
                if head is False:
                    self._state, self._scan, self._scanned, self._checked = self.WHOLE, JsonScan(), 0, 0
                else:
                    self._begin(head[0])
                    self._held, self._pending, self._state = "", self._pending[head[1]:], self.ARGUMENTS
            if self._state == self.ARGUMENTS:
                if self._arguments() != CLOSED:
                    return ""
                self._state, self._scan = self.REST, JsonScan(depth=1)  # the call's object, after its arguments
            if self._state == self.REST:
                used, why = self._scan.advance(self._pending)
                self._pending = self._pending[used:]  # the call's own text
                if why != CLOSED:
                    return ""
                self._state, self._separated = self.BETWEEN, False
                continue
            if self._state == self.WHOLE:  # an object read when it is whole
                used, why = self._scan.advance(self._pending[self._scanned:])
                self._scanned += used
                if why != CLOSED:
                    if len(self._pending) < 2 * self._checked or not self._broken():  # tried at doublings: linear
                        return ""
                    return self._as_text()
                if not self._take(_decoded(self._pending[:self._scanned])):
                    return self._as_text()
                self._held, self._pending = "", self._pending[self._scanned:]
                self._state, self._separated = self.BETWEEN, False

    def _broken(self) -> bool:
        """Whether no text the object's can start is JSON (tried as it doubles in length)."""
        self._checked = max(1, len(self._pending))
        try:
            json.loads(self._pending)
        except RecursionError:
            return True
        except json.JSONDecodeError as error:
            return broken(error, self._pending)
        except ValueError:
            return True
        return False

    def finish(self) -> str:
        pending, self._pending = self._pending, ""
        if self._state == self.ARGUMENTS:
            self._end()
        if self._state in (self.ARGUMENTS, self.REST, self.BETWEEN):
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
