"""A streamed Messages API answer (``POST /v1/messages`` with ``stream: true``) as Anthropic's
events, each an SSE event named by its ``type``: ``message_start`` first (the message with no
content yet), then each content block opened (``content_block_start``), filled
(``content_block_delta``: ``text_delta``, ``thinking_delta``, or a tool call's arguments as
``input_json_delta``) and closed (``content_block_stop``) in the order the model writes them;
``message_delta`` (the stop reason, the stop sequence, the usage) and ``message_stop`` last. The
blocks add up to the unstreamed message's content, save where the model writes text after a call:
streamed, that text is a block after the call's (a piece of the stream is read at once, so its text
goes before its calls' deltas until a call opens, after them from then on, and no delta goes to a
closed block); whole, all the text is the one block before the calls.

A stop sequence is held back while it may be one (gateway/decoding.py), so it arrives whole in
the last chunk, where it is cut from the text and named in ``message_delta``."""

from __future__ import annotations

from typing import Any

from pardec.gateway.anthropic_messages import (
    ended, message_id, message_usage, shows_thinking, stop_sequence, text_block, thinking_block,
)
from pardec.gateway.answers import AnswerReader
from pardec.gateway.call_readers import CallDelta
from pardec.gateway.outputs import Chunk
from pardec.gateway.json_scan import WHITESPACE
from pardec.gateway.openai_replies import FINISH_REASONS

_DELTA = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


class MessageEvents:
    """The events of one streamed message, chunk by chunk (`chunks`, as http_front streams)."""

    def __init__(self, model: str, body: dict[str, Any], answer: AnswerReader | None, stops: tuple[str, ...],
                 request_id: str = ""):
        self.model, self._answer, self._stops = model, answer, stops
        self._shows_thinking = shows_thinking(body)
        self.id = message_id(request_id)
        self._started = False
        self._prompt_tokens = self._tokens = 0
        self._text = ""  # the generation's text so far, to find the stop sequence it ends on
        self._blocks: list[str] = []  # each block's kind, in order; the last may be open
        self._open = False
        self._calls: dict[int, int] = {}  # a call's index among the answer's -> its block's index
        self._blank = ""  # whitespace held back: a text block only once it has text (as the whole one)

    def chunks(self, chunk: Chunk) -> list[dict[str, Any]]:
        events = []
        if not self._started:
            self._started, self._prompt_tokens = True, chunk.prompt_tokens
            events.append({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": message_usage(None, chunk.prompt_tokens, 0, chunk.cached_tokens)}})
        self._tokens += len(chunk.token_ids)
        text, self._text = chunk.text, self._text + chunk.text
        stopped_on = stop_sequence(self._text, chunk.finish_reason, self._stops)
        if stopped_on is not None:
            text = text[: max(0, len(text) - len(stopped_on))]
        finish = FINISH_REASONS[chunk.finish_reason] if chunk.finish_reason else ""
        reasoning, deltas = "", []
        if self._answer is not None:
            piece = self._answer.step(text, finish)
            reasoning, text, deltas = piece.reasoning, piece.content, piece.deltas
        if reasoning:
            events += self._write("thinking", reasoning if self._shows_thinking else "")
        calls_first = bool(self._calls)  # text after a call's arguments began follows them
        if text and not calls_first:
            events += self._write_text(text)
        for delta in deltas:
            events += self._call(delta)
        if text and calls_first:
            events += self._write_text(text)
        if finish:
            if not self._calls and "text" not in self._blocks:
                events += self._write("text", self._blank)  # an answer of nothing, or of whitespace
            events += self._close()
            events.append({"type": "message_delta",
                           "delta": ended(finish, bool(self._calls), stopped_on),
                           "usage": message_usage(chunk.stats, self._prompt_tokens, self._tokens)})
            events.append({"type": "message_stop"})
        return events

    def _write_text(self, text: str) -> list[dict[str, Any]]:
        if self._open and self._blocks[-1] == "text":
            return self._write("text", text)
        if not text.strip(WHITESPACE):
            self._blank += text
            return []
        text, self._blank = self._blank + text, ""
        return self._write("text", text)

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if not (self._open and self._blocks[-1] == kind):
            events += self._close()
            events += self._start(kind, text_block("") if kind == "text" else thinking_block(""))
        if text:
            name, field = _DELTA[kind]
            events.append(self._delta({"type": name, field: text}))
        return events

    def _call(self, delta: CallDelta) -> list[dict[str, Any]]:
        events = []
        if delta.id:
            events += self._close()
            events += self._start("tool_use", {"type": "tool_use", "id": delta.id, "name": delta.name, "input": {}})
            self._calls[delta.index] = len(self._blocks) - 1
        if delta.arguments:
            events.append({"type": "content_block_delta", "index": self._calls[delta.index],
                           "delta": {"type": "input_json_delta", "partial_json": delta.arguments}})
        return events

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._blocks.append(kind)
        self._open = True
        return [{"type": "content_block_start", "index": len(self._blocks) - 1, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self._blocks) - 1}]
