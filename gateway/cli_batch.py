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
starting is waited for, up to the request's timeout. Exit status: 0 when every request was
answered 200, 1 otherwise, 2 when the input is refused.
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
from typing import Any

from pardec.gateway.cli_up import DEFAULT_HTTP

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
MAX_CONCURRENCY = 256
_RETRY_S = 0.5  # between tries to reach a gateway that refuses connections (still starting)


def add_batch_command(commands) -> None:
    batch = commands.add_parser("run-batch", help="run a file of requests (OpenAI's batch format) through a gateway")
    batch.add_argument("-i", "--input", required=True, help="JSONL requests, one a line ('-': standard input)")
    batch.add_argument("-o", "--output", required=True, help="JSONL answers, in the input's order ('-': standard output)")
    batch.add_argument("--url", default=f"http://{DEFAULT_HTTP}", help="the gateway's HTTP API")
    batch.add_argument("--token", default=os.environ.get("PARDEC_TOKEN"), help="bearer token (default: $PARDEC_TOKEN)")
    batch.add_argument("--tls-ca", help="PEM CA the gateway's certificate must chain to (an https --url)")
    batch.add_argument("--concurrency", type=_concurrency, default=8, help="requests in flight at once")
    batch.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    batch.set_defaults(run=run_batch)


def _concurrency(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"{value} is not in [1, {MAX_CONCURRENCY}]")
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
        with _opened(args.input, "r") as source:
            requests, problems = checked_lines(iter(source))
    except OSError as error:
        print(f"pardec run-batch: --input: {error}", file=sys.stderr)
        return 2
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
    answered = failed = 0
    with sink as sink, ThreadPoolExecutor(args.concurrency) as pool:
        calls = [pool.submit(_send, args.url.rstrip("/"), request, args.token, args.timeout, context)
                 for request in requests]
        for call in calls:  # in the input's order
            line = call.result()
            sink.write(json.dumps(line, ensure_ascii=False) + "\n")
            sink.flush()
            ok = line["response"] is not None and line["response"]["status_code"] == 200
            answered, failed = answered + ok, failed + (not ok)
    print(f"pardec run-batch: {len(requests)} requests, {answered} answered, {failed} refused or unanswered",
          file=sys.stderr)
    return 0 if failed == 0 else 1


def _send(base_url: str, request: dict, token: str | None, timeout_s: float, context) -> dict[str, Any]:
    """One request's output line."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(request["body"]).encode()
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request["custom_id"], "response": None, "error": None}
    deadline = time.monotonic() + timeout_s
    while True:
        post = urllib.request.Request(base_url + request["url"], data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(post, timeout=max(0.1, deadline - time.monotonic()), context=context) as reply:
                line["response"] = _response(reply.status, reply.headers, reply.read())
            return line
        except urllib.error.HTTPError as refused:  # the gateway's answer, a 4xx or 5xx
            line["response"] = _response(refused.code, refused.headers, refused.read())
            return line
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, ConnectionRefusedError) and time.monotonic() + _RETRY_S < deadline:
                time.sleep(_RETRY_S)  # a gateway still starting
                continue
            code = "timeout" if isinstance(reason, TimeoutError) or "timed out" in str(reason) else "connection_error"
            line["error"] = {"code": code, "message": f"{base_url}{request['url']}: {reason}"}
            return line


def _response(status: int, headers, payload: bytes) -> dict[str, Any]:
    try:
        body: Any = json.loads(payload)
    except ValueError:
        body = payload.decode("utf-8", "replace")
    named = body.get("id") if isinstance(body, dict) else None  # chatcmpl-..., cmpl-..., resp_..., msg_...
    return {"status_code": status, "request_id": headers.get("x-request-id") or named or f"req_{uuid.uuid4().hex}",
            "body": body}


def _opened(path: str, mode: str):
    """A file by its path, or standard input/output for '-' (left open)."""
    if path == "-":
        return contextlib.nullcontext(sys.stdin if mode == "r" else sys.stdout)
    return open(path, mode, encoding="utf-8")
