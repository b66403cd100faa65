"""The HTTP API's cross-origin (CORS) and request-id answers (gateway/http_options.py): the
options' rules with literal values, then a browser's exchanges with a real gateway's HTTP port."""

from __future__ import annotations

import argparse
import doctest
import http.client
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import pardec.gateway.http_errors
import pardec.gateway.http_options
from pardec.gateway.http_options import HttpOptions, add_http_flags, http_options_from_flags
from pardec.gateway.server import start_gateway
from pardec.runtime.errors import ConfigError
from pardec.runtime.security import BearerTokens
from tests.openai_front import TOKEN, gateway_config

APP = "http://app.example:3000"


def test_doctests():
    assert doctest.testmod(pardec.gateway.http_options).failed == 0
    assert doctest.testmod(pardec.gateway.http_errors).failed == 0  # what a JSON media type is


@pytest.mark.parametrize("flags, message", [
    ({"allowed_origins": "http://localhost:3000/"}, "with no path"),
    ({"allowed_origins": "localhost:3000"}, "SCHEME://HOST"),
    ({"allowed_origins": "https://a.example/app"}, "with no path"),
    ({"allowed_origins": '["http://a.example", 3]'}, "array of strings"),
    ({"allowed_origins": "[http://a.example"}, "JSON array"),
    ({"allowed_origins": APP, "allowed_methods": "POST GET"}, "--allowed-methods: 'POST GET' is not an HTTP token"),
    ({"allowed_origins": APP, "allowed_headers": ""}, "--allowed-headers: must name at least one"),
    ({"allowed_origins": "*", "allow_credentials": True}, "--allow-credentials: not with --allowed-origins '*'"),
    ({"allowed_methods": "GET"}, "only with --allowed-origins"),
])
def test_options_refused_name_the_flag_and_rule(flags, message):
    with pytest.raises(ConfigError, match="^--") as caught:
        HttpOptions.from_flags(**flags)
    assert message in str(caught.value)


def test_lists_as_json_or_commas_and_back_through_the_flags():
    assert HttpOptions.from_flags(' http://a.example , tauri://localhost,https://[::1]:8443 ').allowed_origins == (
        "http://a.example", "tauri://localhost", "https://[::1]:8443")
    options = HttpOptions.from_flags('["http://a.example", "https://b.example:8443"]', "GET,POST", '["Authorization"]',
                                     allow_credentials=True, request_id_headers=True)
    assert options.allowed_methods == ("GET", "POST") and options.allowed_headers == ("Authorization",)
    # As a browser writes them, or nothing would ever match.
    written = HttpOptions.from_flags("HTTPS://Chat.Example:443,http://LOCALHOST:80,http://a.example:8080", "get,post")
    assert written.allowed_origins == ("https://chat.example", "http://localhost", "http://a.example:8080")
    assert written.allowed_methods == ("GET", "POST")
    parser = argparse.ArgumentParser()
    add_http_flags(parser)
    assert http_options_from_flags(parser.parse_args(options.flags())) == options  # what `pardec up` passes on
    assert http_options_from_flags(parser.parse_args([])) == HttpOptions()  # off: no CORS, no ids


def _exchange(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None):
    """(status, headers, body) of one HTTP exchange, an error status included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.headers, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def test_a_browser_page_of_an_allowed_origin_calls_and_reads_its_request_id(stack):
    options = HttpOptions(allowed_origins=(APP,), request_id_headers=True)
    running = start_gateway(gateway_config(stack, http_options=options,
                                           tokens=BearerTokens.from_mapping({TOKEN: "tenant-cors"})),
                            "127.0.0.1:0", http_address="127.0.0.1:0")
    base = f"http://{running.http_address}"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    try:
        # The preflight carries no token, and is answered before routes and tokens.
        asking = {"Origin": APP, "Access-Control-Request-Method": "POST",
                  "Access-Control-Request-Headers": "authorization,content-type"}
        status, headers, _ = _exchange(f"{base}/v1/chat/completions", "OPTIONS", asking)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == APP
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"].lower() == "authorization,content-type"
        assert len(headers["X-Request-Id"]) == 32  # a preflight has an id too
        status, headers, _ = _exchange(f"{base}/v1/chat/completions", "OPTIONS", {**asking, "Origin": "http://evil.example"})
        assert status == 400 and "Access-Control-Allow-Origin" not in headers

        # The call itself: its answer, readable by the page, with a new request id it may read too.
        authorized = {"Origin": APP, "Authorization": f"Bearer {TOKEN}"}
        status, headers, body = _exchange(f"{base}/v1/chat/completions", "POST", authorized, chat)
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"]
        assert headers["Access-Control-Allow-Origin"] == APP and "X-Request-Id" in headers["Access-Control-Expose-Headers"]
        assert len(headers["X-Request-Id"]) == 32
        # A client's own id comes back, on a stream too; a refusal is readable (and has an id).
        status, headers, body = _exchange(f"{base}/v1/chat/completions", "POST",
                                          {**authorized, "X-Request-Id": "trace-7f3a"}, {**chat, "stream": True})
        assert status == 200 and headers["X-Request-Id"] == "trace-7f3a" and body.endswith(b"data: [DONE]\n\n")
        assert b'"id":"chatcmpl-trace-7f3a"' in body  # each chunk's id, named after the request
        assert headers["Access-Control-Allow-Origin"] == APP
        status, headers, body = _exchange(f"{base}/v1/chat/completions", "POST", {"Origin": APP}, chat)
        assert status == 401 and "bearer token" in json.loads(body)["error"]["message"]
        assert headers["Access-Control-Allow-Origin"] == APP and len(headers["X-Request-Id"]) == 32
        # Another site's page gets the answer with no CORS header, so its browser withholds it.
        status, headers, _ = _exchange(f"{base}/v1/models", "GET", {**authorized, "Origin": "http://evil.example"})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
        # An id that is not one line of visible characters is replaced.
        status, headers, _ = _exchange(f"{base}/health", "GET", {"X-Request-Id": "a b"})
        assert status == 200 and len(headers["X-Request-Id"]) == 32
    finally:
        running.stop()


def test_a_body_must_be_sent_as_json(front):
    """As vLLM's and TGI's servers: a page of any site may post a form or text/plain body without
    a preflight, so such a body starts nothing."""
    base, body = f"http://{front.http_address}", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for media in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, headers, answer = _exchange(f"{base}/v1/chat/completions", "POST", {"Content-Type": media}, body)
        assert status == 415 and "the body must be JSON (Content-Type: application/json)" in json.loads(answer)[
            "error"]["message"]
    status, _, answer = _exchange(f"{base}/generate", "POST", {"Content-Type": "text/plain"}, {"inputs": "Hi"})
    assert status == 415 and json.loads(answer)["error_type"] == "validation"  # TGI's shape
    status, _, answer = _exchange(f"{base}/v1/messages", "POST", {"Content-Type": "text/plain"}, {})
    assert status == 415 and json.loads(answer)["error"]["type"] == "invalid_request_error"  # Anthropic's
    for media in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert _exchange(f"{base}/v1/chat/completions", "POST", {"Content-Type": media}, body)[0] == 200
    host, port = front.http_address.rsplit(":", 1)
    bare = http.client.HTTPConnection(host, int(port), timeout=120)  # no Content-Type at all (urllib adds one)
    try:  # as a page's fetch of a bare Blob sends it, unasked: refused too, as vLLM and TGI refuse it
        bare.request("POST", "/v1/chat/completions", json.dumps(body).encode())
        answer = bare.getresponse()
        assert answer.status == 415 and b"Content-Type: missing; the body must be JSON" in answer.read()
    finally:
        bare.close()


def test_off_by_default_and_only_with_the_http_api(stack):
    running = start_gateway(gateway_config(stack), "127.0.0.1:0", http_address="127.0.0.1:0")
    try:
        status, headers, _ = _exchange(f"http://{running.http_address}/v1/chat/completions", "OPTIONS",
                                       {"Origin": APP, "Access-Control-Request-Method": "POST"})
        assert status == 405 and "Access-Control-Allow-Origin" not in headers
        status, headers, _ = _exchange(f"http://{running.http_address}/health", "GET", {"Origin": APP})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers and "X-Request-Id" not in headers
    finally:
        running.stop()
    with pytest.raises(ConfigError, match="HTTP API, which is off"):
        start_gateway(gateway_config(stack, http_options=HttpOptions(request_id_headers=True)), "127.0.0.1:0")
    # `pardec up` refuses them too, before anything starts.
    refused = subprocess.run([sys.executable, "-m", "pardec.gateway.cli", "up", "--http-addr", "", "--allowed-origins",
                              APP], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "HTTP API, which is off" in refused.stderr
    refused = subprocess.run([sys.executable, "-m", "pardec.gateway", "--http-addr", "127.0.0.1:0",
                              "--allowed-origins", "*", "--allow-credentials"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--allow-credentials: not with --allowed-origins '*'" in refused.stderr
