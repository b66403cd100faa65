"""POST /v1/responses: OpenAI's Responses API over the same `Generator` as chat completions, with
the same body bounds, authentication, admission, counting, deadlines and errors (http_front.py).
The body means a chat request (openai_responses.py); the answer is a response object, or its
events (openai_response_events.py). Errors name the Responses body's fields (``input[2]``,
``max_output_tokens``, ``text.format``)."""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.responses import JSONResponse

from pardec.gateway.http_front import OpenAIFront, _Generation
from pardec.gateway.openai_api import chat_request, streamed, with_defaults
from pardec.gateway.openai_response_events import ResponseEvents
from pardec.gateway.openai_responses import FIELDS, chat_body, renamed, whole_response
from pardec.runtime.errors import PardecError

log = logging.getLogger(__name__)


def add_routes(front: OpenAIFront) -> None:
    """Serves the path on ``front``'s app."""

    async def responses(request):
        return Responses(front)

    front.app.add_route("/v1/responses", responses, methods=["POST"])


class Responses(_Generation):
    """OpenAI's Responses: each event named by its type, none after the last (no [DONE])."""

    stream_end = b""
    named_events = True

    def __init__(self, front: OpenAIFront):
        super().__init__(front, "Responses", chat=True)

    def _error_event(self, error: PardecError, writer: ResponseEvents) -> tuple[dict[str, Any], str | None]:
        said = self.shape.body(error)[1]["error"]
        return writer.error(said.get("code") or said["type"], said["message"], said.get("param")), "error"

    async def _run(self, body: dict[str, Any], tenant: str, receive, send) -> None:
        generator, deadline = self.front.generator, self.deadline
        model = generator.model.model_name
        body = with_defaults(body, generator.model.generation_defaults)  # the model's sampling, echoed too
        chat, names = chat_body(body)
        unknown = sorted(set(body) - FIELDS)
        if unknown:  # as chat completions logs its own: named, never taken as a chat field
            log.info("ignored unknown response fields: %s", ", ".join(ascii(name[:40]) for name in unknown[:8]))
        try:
            request = chat_request(chat, tenant, model)
        except PardecError as error:
            raise renamed(error, names) from None
        answer = generator.answers.reader(request)

        async def respond() -> None:
            if streamed(body):
                await self._stream(generator.stream(request, deadline),
                                   ResponseEvents(model, body, answer, generator.model.tokenizer, deadline.request_id), send)
            else:
                generation = await self._in_thread(generator.generate, request, deadline)
                reply = whole_response(generation, model, body, int(time.time()), answer, generator.model.tokenizer,
                                       deadline.request_id)
                await JSONResponse(reply)({"type": "http"}, receive, self._bounded(send))

        try:
            await self._watching(receive, respond)
        except PardecError as error:
            if self.started:  # counted and answered as an event already
                raise
            raise renamed(error, names) from None
