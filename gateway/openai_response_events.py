"""A streamed Responses API answer (``POST /v1/responses`` with ``stream: true``) as OpenAI's
events, each numbered: ``response.created`` and ``response.in_progress`` first; then each output
item opened (``response.output_item.added``), filled (text, thinking or a call's arguments as
``*.delta`` events) and closed (``*.done``, ``response.output_item.done``) in the order the model
writes them; ``response.completed`` (or ``response.incomplete`` when cut short by
``max_output_tokens``) last, with the whole response, the same as the unstreamed one."""

from __future__ import annotations

import time
from typing import Any

from pardec.gateway.answers import AnswerReader, thinking_tokens
from pardec.gateway.call_readers import CallDelta
from pardec.gateway.outputs import Chunk
from pardec.gateway.json_scan import WHITESPACE
from pardec.gateway.openai_replies import FINISH_REASONS
from pardec.gateway.openai_responses import (
    _item_id, call_item, message_item, reasoning_item, response_id, response_object,
)

_DELTA = {"reasoning": "response.reasoning_text.delta", "message": "response.output_text.delta"}


class ResponseEvents:
    """The events of one streamed response, chunk by chunk (`chunks`, as http_front streams)."""

    def __init__(self, model: str, body: dict[str, Any], answer: AnswerReader | None, tokenizer=None,
                 request_id: str = ""):
        self.model, self.body, self._answer, self._tokenizer = model, body, answer, tokenizer
        self._token_ids: list[int] = []
        self.id, self.created = response_id(request_id), int(time.time())
        self._number = 0
        self._items: list[dict[str, Any]] = []  # every item opened: {"kind", "id", "text", ...}
        self._calls: dict[int, int] = {}  # a call's index among the answer's -> its output index
        self._blank = ""  # whitespace held back: a message only once it has text (as the whole one)
        self._tokens = 0

    def chunks(self, chunk: Chunk) -> list[dict[str, Any]]:
        events = []
        if not self._number:
            snapshot = self._response([], None, "", "in_progress")
            events += [self._event("response.created", response=snapshot),
                       self._event("response.in_progress", response=snapshot)]
        self._tokens += len(chunk.token_ids)
        self._token_ids += chunk.token_ids
        finish = FINISH_REASONS[chunk.finish_reason] if chunk.finish_reason else ""
        reasoning, text, deltas = "", chunk.text, []
        if self._answer is not None:
            piece = self._answer.step(text, finish)
            reasoning, text, deltas = piece.reasoning, piece.content, piece.deltas
        if reasoning:
            events += self._write("reasoning", reasoning)
        if text:
            events += self._text(text)
        for delta in deltas:
            events += self._call(delta)
        if finish:
            if not self._calls and not any(item["kind"] == "message" for item in self._items):
                events += self._write("message", self._blank)  # an answer of nothing, or of whitespace
            events += self._close()
            done = [self._item(item, done=True) for item in self._items]
            thinking = "".join(item["text"] for item in self._items if item["kind"] == "reasoning")
            response = self._response(done, chunk.stats, finish, reasoning_tokens=thinking_tokens(
                self._tokenizer, self._token_ids, thinking) if self._tokenizer is not None else 0)
            events.append(self._event(f"response.{response['status']}", response=response))
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        current = self._items[-1] if self._items else None
        if current is not None and current["kind"] == "message":
            return self._write("message", text)
        if not text.strip(WHITESPACE):
            self._blank += text
            return []
        text, self._blank = self._blank + text, ""
        return self._write("message", text)

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if not self._items or self._items[-1]["kind"] != kind:
            events += self._close()
            events += self._open({"kind": kind, "id": _item_id("rs" if kind == "reasoning" else "msg"), "text": ""})
        item = self._items[-1]
        item["text"] += text
        if text:
            events.append(self._event(_DELTA[kind], item_id=item["id"], output_index=len(self._items) - 1,
                                      content_index=0, delta=text, **({"logprobs": []} if kind == "message" else {})))
        return events

    def _call(self, delta: CallDelta) -> list[dict[str, Any]]:
        events = []
        if delta.id:
            events += self._close()
            events += self._open({"kind": "call", "id": _item_id("fc"), "call_id": delta.id, "name": delta.name,
                                  "text": ""})
            self._calls[delta.index] = len(self._items) - 1
        index = self._calls[delta.index]
        item = self._items[index]
        item["text"] += delta.arguments
        if delta.arguments:
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=delta.arguments))
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._items.append(item)
        index = len(self._items) - 1
        events = [self._event("response.output_item.added", output_index=index, item=self._item(item, done=False))]
        if item["kind"] != "call":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=self._part(item, "")))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """Closes the last item, if one is open."""
        if not self._items or self._items[-1].get("closed"):
            return []
        item, index = self._items[-1], len(self._items) - 1
        item["closed"] = True
        where = {"item_id": item["id"], "output_index": index}
        if item["kind"] == "call":
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["text"])]
        else:
            done = "response.output_text.done" if item["kind"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": []} if item["kind"] == "message" else {}
            events = [self._event(done, **where, content_index=0, text=item["text"], **extra),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=self._part(item, item["text"]))]
        return events + [self._event("response.output_item.done", output_index=index, item=self._item(item, True))]

    @staticmethod
    def _part(item: dict[str, Any], text: str) -> dict[str, Any]:
        if item["kind"] == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    @staticmethod
    def _item(item: dict[str, Any], done: bool) -> dict[str, Any]:
        text = item["text"] if done else ""
        if item["kind"] == "call":
            return call_item(item["id"], item["call_id"], item["name"], text, done)
        return (message_item if item["kind"] == "message" else reasoning_item)(item["id"], text, done)

    def _response(self, output, stats, finish: str, status: str | None = None,
                  reasoning_tokens: int = 0) -> dict[str, Any]:
        return response_object(self.id, self.created, self.model, self.body, output, stats, self._tokens, finish,
                               status, reasoning_tokens)

    def error(self, code: str, message: str, param: str | None) -> dict[str, Any]:
        """The stream's error event, numbered as the events before it (OpenAI's "error" event)."""
        return self._event("error", code=code, message=message, param=param)

    def _event(self, kind: str, **fields) -> dict[str, Any]:
        self._number += 1
        return {"type": kind, "sequence_number": self._number - 1, **fields}
