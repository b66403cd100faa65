"""One streamed request to an OpenAI-compatible HTTP server, timed chunk by chunk.

`pardec bench serve` (bench/serve.py) sends its requests through `send`; what it measures of one
request is an `Outcome`. The stream is read by `StreamReader`, which takes the server-sent
events' lines with the time each arrived, so the arithmetic is tested with literal lines:

    >>> reader = StreamReader(sent_at=10.0)
    >>> for raw, at in [(b'data: {"choices": [{"delta": {"content": "Hel"}, "token_ids": [1, 2]}]}', 10.5),
    ...                 (b'', 10.5),
    ...                 (b'data: {"choices": [{"delta": {"content": "lo"}, "token_ids": [3]}]}', 10.75),
    ...                 (b'', 10.75),
    ...                 (b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}', 10.8),
    ...                 (b'', 10.8)]:
    ...     _ = reader.line(raw, at)
    >>> reader.line(b'data: [DONE]', 10.8)  # the end: True, stop reading
    True
    >>> outcome = reader.outcome(10.8)
    >>> outcome.ttft_s, outcome.chunk_gaps_s, outcome.output_tokens, outcome.token_ids, outcome.text
    (0.5, [0.25], 3, [1, 2, 3], 'Hello')

Works against any server of OpenAI's streaming format (pardec, vLLM, llama.cpp's server, TGI's
Messages API): the first chunk with text (or thinking, a tool call, or token ids) is the time to
the first token (vLLM's benchmark also counts a first chunk that only names the role), usage comes
from `stream_options.include_usage`, and the token ids and parallel decoding's steps and method are
read where the server sends them (pardec's and vLLM's `return_token_ids`, pardec's `usage.pardec`).
An event's `data:` lines are joined as the SSE format says; one choice (index 0) is read.
"""

from __future__ import annotations

import functools
import http.client
import json
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Sequence

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
        try:
            parts.port  # noqa: B018 -- raises for a port out of range
        except ValueError as error:
            raise ValueError(f"--base-url: {error}, got {self.base_url!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--base-url: must be http(s)://host[:port][/v1], got {self.base_url!r}")
        if parts.username is not None or parts.password is not None:
            raise ValueError("--base-url: must not hold credentials (user:password@): give a token with --api-key")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint: must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if not (0 < self.timeout_s < 10**6):
            raise ValueError(f"--timeout-s: must be a number of seconds in (0, 1e6), got {self.timeout_s}")
        if not all(32 < ord(c) < 127 for c in self.api_key):
            raise ValueError("--api-key: must be visible ASCII characters, no spaces")
        if self.tls_ca and parts.scheme != "https":
            raise ValueError("--tls-ca: only with an https --base-url")
        if self.tls_ca:
            try:
                _tls_context(self.tls_ca)
            except (OSError, ssl.SSLError) as error:
                raise ValueError(f"--tls-ca {self.tls_ca}: {error}") from None

    def path(self, name: str) -> str:
        """The path of an API route (``chat/completions``, ``models``) under the base URL."""
        prefix = urllib.parse.urlsplit(self.base_url).path.rstrip("/")
        if not prefix.endswith("/v1"):
            prefix += "/v1"
        return f"{prefix}/{name}"

    def connection(self) -> http.client.HTTPConnection:
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme == "https":
            return http.client.HTTPSConnection(parts.hostname, parts.port, timeout=self.timeout_s,
                                               context=_tls_context(self.tls_ca))
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout_s)

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@functools.lru_cache(maxsize=8)
def _tls_context(ca_file: str) -> ssl.SSLContext:
    """One context per CA bundle (building one reads the system's CAs: not per request)."""
    return ssl.create_default_context(cafile=ca_file or None)


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
    steps: int | None = None  # pardec's forward passes after the prefill (usage.pardec.steps)
    decoding_method: str | None = None  # pardec's usage.pardec.decoding_method ("plain", "memory_decoding", ...)
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
        self._data: list[str] = []  # the event's data lines so far
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._saw_ids = False

    def line(self, raw: bytes, at: float) -> bool:
        """Takes one line; True once the stream has said it is done (``data: [DONE]``)."""
        text = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not text:
            self._dispatch(at)
        elif text.startswith("data:"):
            data = text[len("data:"):].removeprefix(" ")
            if not self._data and data.strip() == "[DONE]":
                self._done = True
            else:
                self._data.append(data)
        return self._done  # comments (":") and other fields (event:, id:) carry nothing read here

    def fail(self, message: str) -> None:
        """What went wrong outside the stream's events (a status, the network, a time limit)."""
        self._outcome.error = message

    def _dispatch(self, at: float) -> None:
        if not self._data:
            return
        data, self._data = "\n".join(self._data), []
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self._outcome.error = self._outcome.error or f"a chunk that is not JSON: {data[:120]!r}"
            return
        if not isinstance(event, dict):
            self._outcome.error = self._outcome.error or f"a chunk that is not a JSON object: {data[:120]!r}"
            return
        if "error" in event:
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self._outcome.error = f"error in the stream: {message}"
            return
        if isinstance(event.get("usage"), dict):
            self._read_usage(event["usage"])
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._read_choice(choice, at)

    def _read_usage(self, usage: dict) -> None:
        if _count(usage.get("prompt_tokens")):
            self._outcome.prompt_tokens = usage["prompt_tokens"]
        if _count(usage.get("completion_tokens")):
            self._outcome.output_tokens = usage["completion_tokens"]
        pardec = usage.get("pardec")
        if isinstance(pardec, dict):
            if _count(pardec.get("steps")):
                self._outcome.steps = pardec["steps"]
            if isinstance(pardec.get("decoding_method"), str):
                self._outcome.decoding_method = pardec["decoding_method"]

    def _read_choice(self, choice: dict, at: float) -> None:
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        piece = _text(choice.get("text")) or _text(delta.get("content"))
        thinking = _text(delta.get("reasoning_content")) or _text(delta.get("reasoning"))
        ids = choice.get("token_ids")
        ids = ids if isinstance(ids, list) and all(_count(i) for i in ids) else None
        if ids is not None:
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
        if isinstance(choice.get("finish_reason"), str):
            self._outcome.finish_reason = choice["finish_reason"]

    def outcome(self, ended_at: float) -> Outcome:
        self._dispatch(ended_at)  # an event the stream did not close with a blank line
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


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def body(target: Target, prompt: str | Sequence[int], max_tokens: int, extra: dict) -> dict:
    """The request's JSON body: a streamed request with usage, plus ``extra``'s fields."""
    request = {"model": target.model, "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}}
    if target.endpoint == "chat":
        request["messages"] = [{"role": "user", "content": prompt}]
    else:
        request["prompt"] = prompt if isinstance(prompt, str) else list(prompt)  # token ids as they are
    request.update(extra)
    return request


def send(target: Target, request: dict) -> Outcome:
    """Sends one streamed request and reads it to its end, at most ``target.timeout_s`` from when
    it was sent (the connection is made first, as a client's pool would have it open); never
    raises: what went wrong is the outcome's ``error``."""
    route = target.path("chat/completions" if target.endpoint == "chat" else "completions")
    reader, connection = StreamReader(time.perf_counter()), None
    try:
        payload = json.dumps(request).encode()
        connection = target.connection()
        connection.connect()
        sent_at = time.perf_counter()
        reader = StreamReader(sent_at)
        connection.request("POST", route, body=payload, headers=target.headers())
        response = connection.getresponse()
        if response.status != 200:
            reader.fail(f"HTTP {response.status}: {_message(response.read(65536))}")
            return reader.outcome(time.perf_counter())
        while True:
            raw = response.readline()
            now = time.perf_counter()
            if not raw or reader.line(raw, now):
                break
            if now - sent_at > target.timeout_s:
                reader.fail(f"no end within --timeout-s {target.timeout_s:g}")
                break
        return reader.outcome(time.perf_counter())
    except Exception as error:  # noqa: BLE001 -- a failed request is a measurement, never the run's end
        reader.fail(f"{type(error).__name__}: {error}")
        return reader.outcome(time.perf_counter())
    finally:
        if connection is not None:
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
