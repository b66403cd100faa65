"""Anthropic's Messages API on the gateway's HTTP API (anthropic_messages.py): POST /v1/messages
(stream: named server-sent events, no closing [DONE]) and /v1/messages/count_tokens, over the same
`Generator` as chat completions, with the same body bounds, authentication (the token may come as
``x-api-key``), admission, counting and deadlines (http_front.py), and Anthropic's error JSON,
``{"type": "error", "error": {"type", "message"}}``, naming the Messages body's fields."""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse

from pardec.gateway.anthropic_events import MessageEvents
from pardec.gateway.anthropic_messages import FIELDS, IGNORED, chat_body, renamed, whole_message
from pardec.gateway.http_errors import ErrorShape, error_body, exchange_status
from pardec.gateway.http_front import OpenAIFront, _Generation
from pardec.gateway.openai_api import chat_request, streamed, with_defaults
from pardec.runtime.errors import PardecError

log = logging.getLogger(__name__)

# HTTP status -> Anthropic's error type (its SDK raises by status; the type is for people).
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
          429: "rate_limit_error",
          503: "overloaded_error", 504: "timeout_error"}


class AnthropicErrors(ErrorShape):
    def body(self, error: PardecError) -> tuple[int, dict[str, Any]]:
        status, body = error_body(error)
        status = exchange_status(error, status)
        return status, {"type": "error", "error": {"type": _KINDS.get(status, "api_error"),
                                                   "message": body["error"]["message"]}}


_ERRORS = AnthropicErrors()


def add_routes(front: OpenAIFront) -> None:
    """Serves the paths on ``front``'s app."""

    async def messages(request):
        return Messages(front, count_only=False)

    async def count_tokens(request):
        return Messages(front, count_only=True)

    front.app.add_route("/v1/messages", messages, methods=["POST"])
    front.app.add_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])


class Messages(_Generation):
    shape = _ERRORS
    stream_end = b""  # the stream ends with its message_stop event
    named_events = True

    def __init__(self, front: OpenAIFront, count_only: bool):
        super().__init__(front, "AnthropicCountTokens" if count_only else "AnthropicMessages", chat=True)
        self.count_only = count_only
        self.generates = not count_only

    async def _run(self, body: dict[str, Any], tenant: str, receive, send) -> None:
        generator, deadline = self.front.generator, self.deadline
        model = generator.model.model_name
        if self.count_only:  # the body of a message to come
            body = {name: value for name, value in body.items() if name != "stream"}
        chat, names = chat_body(body, counting=self.count_only)
        unknown = sorted(set(body) - FIELDS)
        if unknown:  # as chat completions logs its own: named, never taken as a chat field
            log.info("ignored unknown message fields: %s", ", ".join(ascii(name[:40]) for name in unknown[:8]))
        ignored = [name for name in IGNORED if body.get(name) not in (None, [], {})]
        if ignored:
            log.info("ignored message fields that mean nothing here: %s", ", ".join(ignored))
        try:
            request = chat_request(with_defaults(chat, generator.model.generation_defaults), tenant, model)
        except PardecError as error:
            raise renamed(error, names) from None
        answer = generator.answers.reader(request)

        async def respond() -> None:
            if self.count_only:
                tokens = await self._in_thread(generator.tokenize, request)
                await JSONResponse({"input_tokens": len(tokens)})({"type": "http"}, receive, self._bounded(send))
            elif streamed(body):
                await self._stream(generator.stream(request, deadline),
                                   MessageEvents(model, body, answer, tuple(request.stop), deadline.request_id), send)
            else:
                generation = await self._in_thread(generator.generate, request, deadline)
                reply = whole_message(generation, model, body, answer, tuple(request.stop), deadline.request_id)
                await JSONResponse(reply)({"type": "http"}, receive, self._bounded(send))

        try:
            await self._watching(receive, respond)
        except PardecError as error:
            if self.started:  # counted and answered as an event already
                raise
            raise renamed(error, names) from None
