"""The gateway's OpenAI-compatible HTTP API: Starlette routes served by uvicorn on a thread of
the gateway's process, over the same `Generator` as the gRPC servicer.

    POST /v1/chat/completions   messages, rendered with the chat template (stream: SSE)
    POST /v1/completions        a prompt sent as text, no template (stream: SSE)
    POST /v1/responses          OpenAI's Responses API (http_responses.py)
    POST /generate(_stream)     Text Generation Inference's API, GET /info (http_tgi.py)
    POST /v1/messages           Anthropic's Messages API, and its count_tokens (http_anthropic.py)
    GET  /v1/models             the served model (GET /v1/models/{id}: one)
    GET  /health, /version      whether it can serve (http_health.py), what it is

What the gRPC port guarantees holds here too: a bearer token (and its tenant) is checked from
the headers (``Authorization: Bearer``, or ``x-api-key`` as Anthropic's clients send it) before
the body is read, the body is read up to the gateway's message limit and no
further, a generation takes one of the same admission slots as a gRPC call (runtime/limits.py),
an optional ``X-Request-Timeout`` (seconds) is the request's deadline as gRPC's own is, and a
client that disconnects cancels the request's `Deadline` at once, which stops the call in
flight and releases its verifier and drafter sessions. Errors are OpenAI's error JSON with the
HTTP status of the gRPC status (gateway/openai_api.py); one after a stream began is an SSE
``error`` event, then ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from typing import Any, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from pardec.gateway.deadlines import Cancelled, Deadline, DeadlineExceeded
from pardec.gateway.decoding import text_tokenizer
from pardec.gateway.deadlines import close_when_idle
from pardec.gateway.generation import Generator
from pardec.gateway.http_errors import (
    OPENAI, AfterStart, BodyTimeout, BodyTooLarge, Counted, ErrorShape, NotJson, internal, json_media_type,
)
from pardec.gateway.openai_api import (
    chat_request, completion_requests, echoed, returns_token_ids, scores_only, streamed, with_defaults,
)
from pardec.gateway.choices import generate_sequences, prompt_named, stream_sequences
from pardec.gateway.openai_replies import (
    ChunkWriter, SequencesWriter, chat_response, completion_id, completion_response, merged, usage_options,
    with_token_ids,
)
from pardec.runtime.errors import InvalidArgument, NotFound, PardecError, ResourceExhausted, Unauthenticated
from pardec.runtime.limits import RESERVED_WORKERS, ConcurrencyLimit
from pardec.runtime.security import Authenticator
from pardec.runtime.tracing import trace_of

log = logging.getLogger(__name__)

_MAX_TIMEOUT_S = 24 * 3600.0
# A client gets this long to send its body whole, and to take each piece of the reply: beyond
# it, its connection is not worth a generation (gRPC's flow control bounds a stalled reader too).
_BODY_TIMEOUT_S = 30.0
_SEND_STALL_S = 60.0


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    # ASCII escapes: a U+2028 in the text would split the event's line for some SSE readers.
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"{head}data: {text}\n\n".encode()


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


class OpenAIFront:
    """The ASGI app (``.app``) over ``generator``; ``limit`` is the gRPC port's own admission limit."""

    def __init__(
        self, generator: Generator, authenticator: Authenticator, limit: ConcurrencyLimit, max_body_bytes: int
    ):
        self.generator = generator
        self.authenticator = authenticator
        self.limit = limit
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        # Generations block a thread each (the core is synchronous); anyio's shared pool is smaller
        # than the admission limit, so they get one of their own of the limit's size.
        self._threads = anyio.CapacityLimiter(limit.limit + RESERVED_WORKERS)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},
        )

    @property
    def _requests(self):
        return self.generator.metrics.requests

    async def _http_error(self, request: HttpRequest, error: HTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(error.status_code, "invalid_request_error")
        message = f"{request.method} {request.url.path[:200]}: {error.detail}"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=error.status_code)

    def _tenant(self, scope) -> str:
        """The caller's tenant from the Authorization header, as the gRPC port reads its metadata."""
        if not self.authenticator.tokens:
            return ""
        header = _header(scope, b"authorization")
        if header is None and _header(scope, b"x-api-key") is not None:  # where Anthropic's clients send it
            header = "Bearer " + _header(scope, b"x-api-key")
        return self.authenticator.tenant_of_metadata([("authorization", header)] if header is not None else [])

    async def _models(self, request: HttpRequest) -> JSONResponse:
        with self._counted("Models") as failed:
            self._tenant(request.scope)
            return JSONResponse({"object": "list", "data": [self._model_card()]})
        return failed.response

    async def _model(self, request: HttpRequest) -> JSONResponse:
        with self._counted("Models") as failed:
            self._tenant(request.scope)
            card = self._model_card()
            if request.path_params["model"] != card["id"]:
                raise NotFound(f"model: {request.path_params['model'][:200]!r} is not served here")
            return JSONResponse(card)
        return failed.response

    def _model_card(self) -> dict[str, Any]:
        served = self.generator.served_model()
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        return {"id": served.model, "object": "model", "created": self.created, "owned_by": "pardec",
                "root": served.model, "max_model_len": served.max_seq_len,
                "type": "model", "display_name": served.model, "created_at": created}  # as Anthropic's clients read it

    def _counted(self, method: str, shape: ErrorShape = OPENAI) -> Counted:
        return Counted(self._requests, method, shape)

    async def _chat(self, request: HttpRequest):
        return _Generation(self, "ChatCompletions", chat=True)

    async def _completions(self, request: HttpRequest):
        return _Generation(self, "Completions", chat=False)


def _prompts(generator, batch: list, ids: bool, echo: bool) -> tuple[list, list]:
    """Each prompt's tokens as prefilled, where the reply returns them (return_token_ids), and its
    echo: its text, or, where it was cut (truncate_prompt_tokens, truncation), the kept end's, as
    its scored tokens are. A prompt's error names it in a batch."""
    prompts, echoes, decode = [], [], generator.model.tokenizer.decode
    for index, one in enumerate(batch):
        kept, text = None, None
        cut = echo and (one.truncate_prompt_tokens is not None or generator.config.truncation)
        try:
            if ids or cut:
                kept = generator.prompt_tokens(one)
            if echo:
                whole = cut and len(kept) == len(generator.tokenize(one))
                text = decode(kept) if cut and not whole else one.prompt or decode(one.prompt_token_ids)
        except PardecError as error:
            raise prompt_named(error, index) if len(batch) > 1 else error from None
        prompts.append(kept if ids else None)
        echoes.append(text)
    return prompts, echoes


class _Generation:
    """The ASGI response of one POST: it owns the exchange. It reads the body itself, bounded, before
    taking an admission slot (a slow sender holds its connection, not a slot), hears the client's
    disconnect while the generation runs, and never waits on a client that stops reading for longer
    than the request's deadline or _SEND_STALL_S. Errors take the API's ``shape`` (OpenAI's by default)."""

    shape: ErrorShape = OPENAI
    stream_end = b"data: [DONE]\n\n"  # what ends a stream, after its last event (OpenAI's)
    named_events = False  # whether each SSE event is named by its data's type (Anthropic's)
    generates = True  # whether it is a generation, whose refusal has a span and a log line as its answer would

    def _error_event(self, error: PardecError, writer) -> tuple[dict[str, Any], str | None]:
        """An error after the stream began, as the API says it: (the event's data, its name)."""
        return self.shape.event(error)

    def __init__(self, front: OpenAIFront, method: str, chat: bool):
        self.front, self.method, self.chat = front, method, chat
        self.disconnected = False
        self.started = False  # the response's headers are sent: errors are SSE events from then on
        self.deadline = Deadline()

    async def __call__(self, scope, receive, send) -> None:
        front = self.front
        try:
            tenant = front._tenant(scope)
        except Unauthenticated as error:
            front._requests.refused(self.method, error.status)
            return await self.shape.response(error)(scope, receive, send)
        slot = False
        try:
            with front._counted(self.method, self.shape) as failed:
                self.deadline = Deadline(trace=trace_of(scope.get("headers", ())))  # its id, even if refused next
                self.deadline.at = _deadline_at(scope)
                body = await self._read_body(scope, receive)
                refusal = front.limit.enter(self.method, count_refusal=False)  # counted here, as any error
                if refusal is not None:
                    raise ResourceExhausted(refusal)
                slot = True
                await self._run(body, tenant, receive, send)
            if failed.error is not None and self.generates:  # its span and log line, unless the generator said it
                front.generator.reports.refused(self.deadline, tenant, failed.error)
            if failed.response is not None and not self.disconnected and not self.started:
                await failed.response(scope, receive, send)
        finally:
            # On every exit, a server shutdown's cancellation included: work left in a thread stops.
            self.deadline.cancel()
            if slot:
                front.limit.leave()

    async def _read_body(self, scope, receive) -> dict[str, Any]:
        limit = self.front.max_body_bytes
        media = _header(scope, b"content-type")
        if not json_media_type(media or ""):  # none said is refused too: a page may post a bare Blob unasked
            raise NotJson(f"Content-Type: {repr(media[:100]) if media else 'missing'}; the body must be JSON "
                          "(Content-Type: application/json)")
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(f"body: {declared} bytes; at most {limit} (--max-message-bytes)")
        left = self.deadline.left()
        bound = _BODY_TIMEOUT_S if left is None else max(0.0, min(_BODY_TIMEOUT_S, left))
        chunks, size = [], 0
        with anyio.move_on_after(bound) as waited:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnected = True
                    raise Cancelled("body: the client disconnected before sending it whole")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"body: more than {limit} bytes (--max-message-bytes)")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if waited.cancelled_caught:
            raise BodyTimeout(f"body: not received whole within {bound:.0f} s")
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as error:
            raise InvalidArgument(f"body: not valid JSON ({str(error)[:200]})") from None
        except RecursionError:
            raise InvalidArgument("body: JSON nested too deeply") from None
        if not isinstance(body, dict):
            raise InvalidArgument("body: must be a JSON object")
        return body

    async def _run(self, body: dict[str, Any], tenant: str, receive, send) -> None:
        front, deadline = self.front, self.deadline
        model = front.generator.model.model_name
        body = with_defaults(body, front.generator.model.generation_defaults)  # the model's sampling
        batch = [chat_request(body, tenant, model)] if self.chat else completion_requests(body, tenant, model)
        request, n = batch[0], max(1, batch[0].n)  # every prompt's request asks the same but for its prompt
        tokenizer = text_tokenizer(front.generator.model.tokenizer, request.keep_special_tokens)  # as its text reads
        only = not self.chat and scores_only(body)  # the prompt's text, sent back first
        answers = front.generator.answers  # each sequence's answer read on its own: thinking apart, tool calls
        ids, echo = returns_token_ids(body), not self.chat and echoed(body)
        include_usage, continuous = usage_options(body)

        async def answer() -> None:
            prompts, echoes = [None] * len(batch), [None] * len(batch)
            if ids or echo:  # the prompts' tokens and texts the reply carries
                prompts, echoes = await self._in_thread(_prompts, front.generator, batch, ids, echo)
            if streamed(body):
                writers = [ChunkWriter(self.chat, model, False, tokenizer if request.logprobs else None,
                                       echoes[index // n], only, self.chat and answers.reader(request), index,
                                       counter=tokenizer, prompt_ids=prompts[index // n], continuous_usage=continuous,
                                       reply_id=completion_id(self.chat, deadline.request_id))
                           for index in range(len(batch) * n)]
                await self._stream(stream_sequences(front.generator, batch, deadline),
                                   SequencesWriter(writers, include_usage, n), send)
            else:
                generations = await self._in_thread(generate_sequences, front.generator, batch, deadline)
                reply_id, created = completion_id(self.chat, deadline.request_id), int(time.time())
                scores = body.get("prompt_logprobs") is not None  # vLLM's: the prompt's tokens scored
                replies = [chat_response(generation, model, reply_id, created, tokenizer, answers.reader(request),
                                         scores) if self.chat else
                           completion_response(generation, model, reply_id, created, tokenizer, echoes[index // n],
                                               only, scores)
                           for index, generation in enumerate(generations)]
                if ids:
                    replies = [with_token_ids(reply, [] if only else generation.token_ids, prompts[index // n], self.chat)
                               for index, (reply, generation) in enumerate(zip(replies, generations))]
                await JSONResponse(merged(replies, generations, n))({"type": "http"}, receive, self._bounded(send))

        await self._watching(receive, answer)

    async def _watching(self, receive, work: Callable) -> None:
        """Awaits ``work()`` while hearing the client's disconnect, which cancels the request."""
        failure: Exception | None = None
        async with anyio.create_task_group() as watchers:
            watchers.start_soon(self._watch, receive)
            try:
                await work()
            except Exception as error:  # raised past the task group, which would wrap it in a group
                failure = error
            finally:
                watchers.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _watch(self, receive) -> None:
        """Cancels the request the moment its client goes away (the body is read by then, so the
        next message can only be the disconnect)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                self.deadline.cancel()
                return

    async def _in_thread(self, function: Callable, *args):
        return await anyio.to_thread.run_sync(function, *args, limiter=self.front._threads)

    def _bounded(self, send):
        """``send`` that gives up on a client that reads nothing for _SEND_STALL_S, or past the
        request's deadline, as gRPC's flow control does not let a stalled reader hold a call."""

        async def bounded(message) -> None:
            if message["type"] == "http.response.start":
                self.started = True
            left = self.deadline.left()
            bound = _SEND_STALL_S if left is None else max(0.0, min(_SEND_STALL_S, left))
            with anyio.move_on_after(bound) as waited:
                await send(message)
            if waited.cancelled_caught:
                self.deadline.cancel()
                if self.deadline.expired:
                    raise DeadlineExceeded("the request's deadline passed while the client was not reading")
                raise Cancelled(f"the client read nothing for {_SEND_STALL_S:.0f} s")

        return bounded

    async def _stream(self, chunks, writer: SequencesWriter, send) -> None:
        """The first chunk is awaited before the headers, so a request refused by the core gets
        its own status; after that an error is an SSE event."""
        send = self._bounded(send)
        finished = False
        try:
            chunk = await self._in_thread(next, chunks, None)
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),
            ]})
            try:
                while chunk is not None:
                    for data in writer.chunks(chunk):
                        event = data["type"] if self.named_events else None
                        await send({"type": "http.response.body", "body": _sse(data, event), "more_body": True})
                    chunk = await self._in_thread(next, chunks, None)
            except Exception as error:
                error = error if isinstance(error, PardecError) else internal(error)
                if not self.disconnected:
                    with contextlib.suppress(PardecError):  # a client that stopped reading gets nothing more
                        await send({"type": "http.response.body", "body": _sse(*self._error_event(error, writer)),
                                    "more_body": True})
                        await send({"type": "http.response.body", "body": self.stream_end, "more_body": False})
                # Counted with its status, and not answered again: the response has begun.
                raise AfterStart(error) from None
            await send({"type": "http.response.body", "body": self.stream_end, "more_body": False})
            finished = True
        finally:
            if not finished:
                self.deadline.cancel()
            # Closing a stream parked between steps releases its sessions (blocking calls: a thread);
            # shielded, as a server shutting down cancels this task and the release must still run.
            with anyio.CancelScope(shield=True):
                await self._in_thread(close_when_idle, chunks)


def _deadline_at(scope) -> float | None:  # the monotonic time X-Request-Timeout (seconds) sets
    value = _header(scope, b"x-request-timeout")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= _MAX_TIMEOUT_S:
        raise InvalidArgument(f"X-Request-Timeout: {value[:40]!r} must be seconds in (0, {_MAX_TIMEOUT_S:.0f}]")
    return time.monotonic() + seconds
