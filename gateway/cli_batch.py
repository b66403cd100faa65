"""`pardec run-batch`: a file of requests in OpenAI's batch format, run through a running
gateway's HTTP API (as vLLM's `run-batch` runs one through its engine), answers to a file.

Each input line is one request:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

with `url` one of BATCH_URLS and `custom_id` unique. Every line is checked before any is sent,
and a bad one is named by its line number. Up to ``--concurrency`` requests are in flight at
once (the gateway batches them in its verifier like any others). The output holds one line per
request, in the input's order, each written as soon as it and those before it are done:

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id":
     "...", "body": {...}}, "error": null}

`response` is the gateway's answer as it came, a refused request's too (its 4xx status and error
body, as OpenAI's batch output holds it); a request that got no answer (no gateway there, a
timeout) has `"response": null` and `"error": {"code", "message"}`. A gateway that is still
starting is waited for, once for the run, up to a request's timeout (which the gateway is told
too, X-Request-Timeout). Exit status: 0 when every request was answered 200, 1 otherwise, 2 when
the input is refused (not UTF-8, a bad line, no line at all), 130 on Ctrl-C (requests not sent
yet are dropped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pardec.gateway.cli_up import DEFAULT_HTTP

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
MAX_CONCURRENCY = 256
MAX_TIMEOUT_S = 24 * 3600.0  # the gateway's bound on X-Request-Timeout, which carries it
_RETRY_S = 0.5  # between tries to reach a gateway that refuses connections (still starting)


def add_batch_command(commands) -> None:
    batch = commands.add_parser("run-batch", help="run a file of requests (OpenAI's batch format) through a gateway")
    batch.add_argument("-i", "--input", required=True, help="JSONL requests, one a line ('-': standard input)")
    batch.add_argument("-o", "--output", required=True, help="JSONL answers, in the input's order ('-': standard output)")
    batch.add_argument("--url", default=f"http://{DEFAULT_HTTP}", help="the gateway's HTTP API")
    batch.add_argument("--token", default=os.environ.get("PARDEC_TOKEN"), help="bearer token (default: $PARDEC_TOKEN)")
    batch.add_argument("--tls-ca", help="PEM CA the gateway's certificate must chain to (an https --url)")
    batch.add_argument("--concurrency", type=_concurrency, default=8, help="requests in flight at once")
    batch.add_argument("--timeout", type=_seconds, default=600.0, help="seconds a request may take")
    batch.set_defaults(run=run_batch)


def _concurrency(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"{value} is not in [1, {MAX_CONCURRENCY}]")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_TIMEOUT_S:  # nan and inf too
        raise argparse.ArgumentTypeError(f"{text} is not seconds in (0, {MAX_TIMEOUT_S:.0f}]")
    return value


def checked_lines(lines: Iterator[str]) -> tuple[list[dict], list[str]]:
    """The requests of the input's lines (blank lines skipped), and a message per bad line.

    >>> good = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}'
    >>> checked_lines(iter([good, "", good, '{"custom_id": "b", "method": "GET"}']))[1]
    ['line 3: custom_id: "a" is also line 1\\'s', 'line 4: method: must be "POST"']
    """
    requests, problems, seen = [], [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        problem = _problem(line, seen, number)
        if problem:
            problems.append(f"line {number}: {problem}")
            continue
        request = json.loads(line)
        seen[request["custom_id"]] = number
        requests.append(request)
    return requests, problems


def _problem(line: str, seen: dict[str, int], number: int) -> str:
    try:
        request = json.loads(line)
    except ValueError as error:
        return f"not JSON ({error})"
    except RecursionError:
        return "not JSON (nested too deeply)"
    if not isinstance(request, dict):
        return "must be a JSON object with custom_id, method, url and body"
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "custom_id: must be a non-empty string"
    if custom_id in seen:
        return f"custom_id: {json.dumps(custom_id)} is also line {seen[custom_id]}'s"
    if request.get("method") != "POST":
        return 'method: must be "POST"'
    if request.get("url") not in BATCH_URLS:
        return f"url: must be one of {', '.join(BATCH_URLS)}"
    body = request.get("body")
    if not isinstance(body, dict):
        return "body: must be a JSON object (the request's body)"
    if body.get("stream"):
        return "body.stream: a batch's answers are whole, not streamed"
    return ""


def run_batch(args) -> int:
    try:
        text = (sys.stdin.buffer.read() if args.input == "-" else Path(args.input).read_bytes()).decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        print(f"pardec run-batch: --input: {error}", file=sys.stderr)
        return 2
    requests, problems = checked_lines(iter(text.splitlines()))
    if not requests and not problems:
        problems = ["no requests (every line is blank)"]
    if problems:
        for problem in problems[:20]:
            print(f"pardec run-batch: {args.input}: {problem}", file=sys.stderr)
        if len(problems) > 20:
            print(f"pardec run-batch: ... and {len(problems) - 20} more", file=sys.stderr)
        return 2
    try:
        context = ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca else None
    except (OSError, ssl.SSLError) as error:
        print(f"pardec run-batch: --tls-ca: {error}", file=sys.stderr)
        return 2
    try:
        sink = _opened(args.output, "w")
    except OSError as error:
        print(f"pardec run-batch: --output: {error}", file=sys.stderr)
        return 2
    base = args.url.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base  # an OpenAI client's base_url: the lines say /v1
    gateway = _Gateway(base, args.token, args.timeout, context)
    answered = failed = 0
    pool = ThreadPoolExecutor(args.concurrency)
    try:
        with sink:
            calls = [pool.submit(gateway.send, request) for request in requests]
            for call in calls:  # in the input's order
                line = call.result()
                sink.write(json.dumps(line) + "\n")
                sink.flush()
                ok = line["response"] is not None and line["response"]["status_code"] == 200
                answered, failed = answered + ok, failed + (not ok)
    except (KeyboardInterrupt, BrokenPipeError) as stopped:
        # Requests not sent yet are dropped; those in flight finish (their answers are lost).
        pool.shutdown(wait=False, cancel_futures=True)
        print(f"pardec run-batch: stopped ({type(stopped).__name__}) after {answered + failed} of {len(requests)} "
              "answers written", file=sys.stderr)
        return 130 if isinstance(stopped, KeyboardInterrupt) else 1
    pool.shutdown()
    print(f"pardec run-batch: {len(requests)} requests, {answered} answered, {failed} refused or unanswered",
          file=sys.stderr)
    return 0 if failed == 0 else 1


class _Gateway:
    """Where the requests go. A gateway that refuses connections is waited for once, for the
    whole run, up to one request's timeout (`pardec up & pardec run-batch ...`); once it has
    answered, a refused connection is a failure."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float, context):
        self.base_url, self.timeout_s, self.context = base_url, timeout_s, context
        self.headers = {"Content-Type": "application/json", "X-Request-Timeout": f"{timeout_s:g}"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self._waiting_until = time.monotonic() + timeout_s

    def send(self, request: dict) -> dict[str, Any]:
        """One request's output line; whatever fails, a line that says so."""
        line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request["custom_id"], "response": None,
                "error": None}
        url = self.base_url + request["url"]
        data = json.dumps(request["body"]).encode()
        while True:
            post = urllib.request.Request(url, data=data, headers=self.headers, method="POST")
            try:
                try:
                    with urllib.request.urlopen(post, timeout=self.timeout_s, context=self.context) as reply:
                        line["response"] = _response(reply.status, reply.headers, reply.read())
                except urllib.error.HTTPError as refused:  # the gateway's answer, a 4xx or 5xx
                    line["response"] = _response(refused.code, refused.headers, refused.read())
                self._waiting_until = 0.0  # it is up
                return line
            except Exception as error:  # noqa: BLE001 - any failure is this request's line, never the run's
                reason = getattr(error, "reason", error)
                if isinstance(reason, ConnectionRefusedError) and time.monotonic() + _RETRY_S < self._waiting_until:
                    time.sleep(_RETRY_S)  # a gateway still starting
                    continue
                timed_out = isinstance(reason, TimeoutError) or "timed out" in str(reason)
                line["response"] = None
                line["error"] = {"code": "timeout" if timed_out else "connection_error",
                                 "message": f"{url}: {type(reason).__name__}: {reason}"[:1000]}
                return line


def _response(status: int, headers, payload: bytes) -> dict[str, Any]:
    try:
        body: Any = json.loads(payload)
    except (ValueError, RecursionError):
        body = payload.decode("utf-8", "replace")
    named = body.get("id") if isinstance(body, dict) else None  # chatcmpl-..., cmpl-..., resp_..., msg_...
    return {"status_code": status, "request_id": headers.get("x-request-id") or named or f"req_{uuid.uuid4().hex}",
            "body": body}


def _opened(path: str, mode: str):
    """A file by its path, or standard input/output for '-' (left open)."""
    if path == "-":
        return contextlib.nullcontext(sys.stdin if mode == "r" else sys.stdout)
    return open(path, mode, encoding="utf-8")
