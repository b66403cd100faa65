"""One streamed request to an OpenAI-compatible HTTP server, timed chunk by chunk.

`pardec bench serve` (bench/serve.py) sends its requests through `send`; what it measures of one
request is an `Outcome`. The stream is read by `StreamReader`, which takes the server-sent
events' lines with the time each arrived, so the arithmetic is tested with literal lines:

    >>> reader = StreamReader(sent_at=10.0)
    >>> reader.line(b'data: {"choices": [{"delta": {"content": "Hel"}, "token_ids": [1, 2]}]}', 10.5)
    >>> reader.line(b'data: {"choices": [{"delta": {"content": "lo"}, "token_ids": [3]}]}', 10.75)
    >>> reader.line(b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}', 10.8)
    >>> reader.line(b'data: [DONE]', 10.8)
    >>> outcome = reader.outcome(10.8)
    >>> outcome.ttft_s, outcome.chunk_gaps_s, outcome.output_tokens, outcome.token_ids, outcome.text
    (0.5, [0.25], 3, [1, 2, 3], 'Hello')

Works against any server of OpenAI's streaming format (pardec, vLLM, llama.cpp's server, TGI's
Messages API): the first chunk with text (or thinking, or a tool call) is the time to the first
token, usage comes from `stream_options.include_usage`, and the token ids and parallel decoding's
steps are read where the server sends them (pardec's and vLLM's `return_token_ids`, pardec's
`usage.pardec`).
"""

from __future__ import annotations

import http.client
import json
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field

ENDPOINTS = ("chat", "completions")


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are sent."""

    base_url: str  # http(s)://host:port, with or without /v1
    endpoint: str = "chat"  # chat: /v1/chat/completions with one user message; completions: /v1/completions
    model: str = ""
    api_key: str = ""
    timeout_s: float = 600.0
    tls_ca: str = ""  # a CA bundle for an https server whose certificate the system's CAs do not sign

    def __post_init__(self):
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--base-url: must be http(s)://host[:port][/v1], got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint: must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout-s: must be > 0, got {self.timeout_s}")

    def path(self, name: str) -> str:
        """The path of an API route (``chat/completions``, ``models``) under the base URL."""
        prefix = urllib.parse.urlsplit(self.base_url).path.rstrip("/")
        if not prefix.endswith("/v1"):
            prefix += "/v1"
        return f"{prefix}/{name}"

    def connection(self) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=self.tls_ca or None)
            return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self.timeout_s, context=context)
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout_s)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass
class Outcome:
    """What one request measured. Times are seconds from when it was sent."""

    ok: bool = False
    error: str = ""  # the HTTP status and the server's message, or what failed on the way
    sent_at: float = 0.0  # time.perf_counter() when the request was sent
    ttft_s: float | None = None  # to the first chunk with text
    e2e_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)  # between chunks with text, after the first
    chunks: int = 0  # chunks with text
    prompt_tokens: int | None = None  # as the server's usage counts them
    output_tokens: int | None = None  # the server's usage, else the token ids it sent
    token_ids: list[int] | None = None  # where the server sends them
    text: str = ""
    steps: int | None = None  # pardec's forward passes for the answer (usage.pardec.steps)
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, OpenAI-benchmark style."""
        if self.ttft_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class StreamReader:
    """Builds an `Outcome` from a stream's lines, each with the perf_counter time it arrived."""

    def __init__(self, sent_at: float):
        self._outcome = Outcome(sent_at=sent_at)
        self._last_chunk: float | None = None
        self._done = False
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._saw_ids = False

    def line(self, raw: bytes, at: float) -> None:
        text = raw.decode("utf-8", "replace").strip()
        if not text.startswith("data:"):
            return  # blank separators, comments, `event:` lines
        data = text[len("data:"):].strip()
        if data == "[DONE]":
            self._done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self._outcome.error = self._outcome.error or f"a chunk that is not JSON: {data[:120]!r}"
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self._outcome.error = f"error in the stream: {message}"
            return
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._read_usage(usage)
        for choice in event.get("choices") or []:
            self._read_choice(choice, at)

    def fail(self, message: str) -> None:
        """What went wrong outside the stream's events (a status, the network)."""
        self._outcome.error = message

    def _read_usage(self, usage: dict) -> None:
        if isinstance(usage.get("prompt_tokens"), int):
            self._outcome.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            self._outcome.output_tokens = usage["completion_tokens"]
        pardec = usage.get("pardec")
        if isinstance(pardec, dict) and isinstance(pardec.get("steps"), int):
            self._outcome.steps = pardec["steps"]

    def _read_choice(self, choice: dict, at: float) -> None:
        delta = choice.get("delta") or {}
        piece = choice.get("text") or delta.get("content") or ""
        thinking = delta.get("reasoning_content") or delta.get("reasoning") or ""
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self._saw_ids = True
            self._ids += ids
        if piece or thinking or delta.get("tool_calls") or ids:
            outcome = self._outcome
            if outcome.ttft_s is None:
                outcome.ttft_s = at - outcome.sent_at
            elif self._last_chunk is not None:
                outcome.chunk_gaps_s.append(at - self._last_chunk)
            self._last_chunk = at
            outcome.chunks += 1
        self._texts.append(piece)
        if choice.get("finish_reason"):
            self._outcome.finish_reason = choice["finish_reason"]

    def outcome(self, ended_at: float) -> Outcome:
        outcome = self._outcome
        outcome.e2e_s = ended_at - outcome.sent_at
        outcome.text = "".join(self._texts)
        if self._saw_ids:
            outcome.token_ids = list(self._ids)
            if outcome.output_tokens is None:
                outcome.output_tokens = len(self._ids)
        if not outcome.error and not self._done:
            outcome.error = "the stream ended without [DONE]"
        outcome.ok = not outcome.error
        return outcome


def body(target: Target, prompt: str, max_tokens: int, extra: dict) -> dict:
    """The request's JSON body: a streamed request with usage, plus ``extra``'s fields."""
    request = {"model": target.model, "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}}
    if target.endpoint == "chat":
        request["messages"] = [{"role": "user", "content": prompt}]
    else:
        request["prompt"] = prompt
    request.update(extra)
    return request


def send(target: Target, request: dict) -> Outcome:
    """Sends one streamed request and reads it to its end; never raises for what the server or
    the network does (that is the outcome's ``error``)."""
    route = target.path("chat/completions" if target.endpoint == "chat" else "completions")
    payload = json.dumps(request).encode()
    sent_at = time.perf_counter()
    reader = StreamReader(sent_at)
    connection = target.connection()
    try:
        connection.request("POST", route, body=payload, headers=target.headers())
        response = connection.getresponse()
        if response.status != 200:
            reader.fail(f"HTTP {response.status}: {_message(response.read())}")
            return reader.outcome(time.perf_counter())
        while True:
            raw = response.readline()
            if not raw:
                break
            reader.line(raw, time.perf_counter())
        return reader.outcome(time.perf_counter())
    except (OSError, http.client.HTTPException) as error:
        reader.fail(f"{type(error).__name__}: {error}")
        return reader.outcome(time.perf_counter())
    finally:
        connection.close()


def get_json(target: Target, route: str) -> dict:
    """GET a JSON route (``models``); raises ConnectionError with the reason."""
    connection = target.connection()
    try:
        connection.request("GET", target.path(route), headers=target.headers())
        response = connection.getresponse()
        status, payload = response.status, response.read()
    except (OSError, http.client.HTTPException) as error:
        raise ConnectionError(f"cannot reach {target.base_url}: {error}") from error
    finally:
        connection.close()
    if status != 200:
        raise ConnectionError(f"GET {target.path(route)}: HTTP {status}: {_message(payload)}")
    try:
        return json.loads(payload)
    except ValueError as error:
        raise ConnectionError(f"GET {target.path(route)}: the reply is not JSON: {payload[:120]!r}") from error


def _message(payload: bytes) -> str:
    """The error message of an OpenAI-style error body, else the body's start."""
    try:
        error = json.loads(payload).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return payload[:200].decode("utf-8", "replace")
