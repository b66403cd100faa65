"""The HTTP API's protections, as the gRPC port's (gateway/http_front.py): bearer tokens, the
body limit, admission slots shared with gRPC, deadlines, disconnects, clients that send or read
slowly, TLS; and one error of each status through a real `pardec up`. The API itself:
test_openai_http.py."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import redis

from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import start_gateway
from pardec.runtime.security import BearerTokens
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.openai_front import TOKEN
from tests.openai_front import gateway_config as _config
from tests.openai_front import model_of as _model


def _wait_for_free_slots(running, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while running.limit.active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running.limit.active == 0


def test_tokens_admission_deadline_and_body_limit(stack):
    config = _config(stack, tokens=BearerTokens.from_mapping({TOKEN: "tenant-h"}), max_concurrent_rpcs=1,
                     max_message_bytes=4096)
    running = start_gateway(config, "127.0.0.1:0", http_address="127.0.0.1:0")
    base = f"http://{running.http_address}/v1"
    messages = [{"role": "user", "content": "Count from one to fifty in words."}]
    try:
        model = _model(running)
        with openai.OpenAI(base_url=base, api_key="wrong-token-0123456789", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError) as caught:
                wrong.chat.completions.create(model=model, messages=messages)
            assert caught.value.status_code == 401 and "bearer token" in caught.value.body["message"]
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
            with pytest.raises(openai.AuthenticationError):
                wrong.responses.create(model=model, input="hi")
        refused = urllib.request.Request(f"http://{running.http_address}/generate", json.dumps({"inputs": "hi"}).encode(),
                                         {"Content-Type": "application/json"})  # TGI's route, TGI's error JSON
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(refused, timeout=60)
        assert caught.value.code == 401 and json.loads(caught.value.read())["error_type"] == "unauthorized"
        with pytest.raises(urllib.error.HTTPError) as caught:  # the API port's metrics need a token too
            urllib.request.urlopen(f"http://{running.http_address}/metrics", timeout=10)
        assert caught.value.code == 401
        scrape = urllib.request.Request(f"http://{running.http_address}/metrics",
                                        headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(scrape, timeout=10) as reply:
            assert b"pardec_requests_total" in reply.read()
        with openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=300) as client:
            assert client.models.list().data[0].id == model
            with pytest.raises(openai.APIStatusError) as caught:  # over max_message_bytes
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * 5000}])
            assert caught.value.status_code == 413
            # One slot: a stream holds it, a second call is refused 429 over either front.
            stream = client.chat.completions.create(model=model, messages=messages, max_tokens=200,
                                                    temperature=0, stream=True)
            next(iter(stream))
            with pytest.raises(openai.RateLimitError):
                client.responses.create(model=model, input="hi", max_output_tokens=4)  # the same slots
            with pytest.raises(openai.RateLimitError) as caught:
                client.chat.completions.create(model=model, messages=messages, max_tokens=4)
            assert "--max-concurrent-rpcs" in caught.value.body["message"]
            with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    gateway_pb2_grpc.GatewayStub(channel).Generate(
                        gateway_pb2.GenerateRequest(prompt="hi"), metadata=(("authorization", f"Bearer {TOKEN}"),),
                        timeout=60)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stream.close()
            _wait_for_free_slots(running)
            # A deadline the generation cannot meet: 504.
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0,
                                               extra_headers={"X-Request-Timeout": "0.01"})
            assert caught.value.status_code == 504
    finally:
        running.stop()


def _drafter_keys(redis_server) -> set:
    return set(redis.Redis.from_url(redis_server.url).keys("pardec:*"))


def test_a_client_disconnect_frees_the_sessions_within_a_second(front, engine, redis_server):
    """Gone everywhere: the gateway's request, the verifier's session, the drafter's state."""
    before = _drafter_keys(redis_server)
    assert engine.sessions == 0
    body = json.dumps({"model": _model(front), "messages": [{"role": "user", "content": "Tell a long story."}],
                       "max_tokens": 400, "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(f"http://{front.http_address}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    reply = urllib.request.urlopen(request, timeout=60)
    assert reply.readline().startswith(b"data: ")
    assert front.generator.in_flight == 1 and engine.sessions == 1 and len(_drafter_keys(redis_server)) > len(before)
    reply.close()  # the client goes away mid-stream
    closed = time.monotonic()

    def freed() -> bool:
        return (not front.generator.in_flight and not front.limit.active and not engine.sessions
                and _drafter_keys(redis_server) == before)

    while not freed() and time.monotonic() - closed < 5:
        time.sleep(0.01)
    assert freed() and time.monotonic() - closed < 1.0


def test_an_error_after_the_stream_began_is_an_sse_error_event(front, client):
    counting = [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}]
    # The deadline passes mid-stream: the model counts on for 2,000 tokens, which plain decoding
    # makes in many times the deadline.
    headers = {"X-Request-Timeout": "3"}
    stream = client.chat.completions.create(model=_model(front), messages=counting, max_tokens=2000, temperature=0,
                                            stream=True, extra_headers=headers,
                                            extra_body={"parallel_decoding": False})
    with pytest.raises(openai.APIError) as caught:
        for _chunk in stream:
            pass
    assert "deadline" in str(caught.value.message)
    body = json.dumps({"model": _model(front), "messages": counting, "max_tokens": 2000, "temperature": 0,
                       "stream": True, "parallel_decoding": False}).encode()
    request = urllib.request.Request(f"http://{front.http_address}/v1/chat/completions", data=body,
                                     headers={**headers, "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200
        lines = [line.decode().strip() for line in reply if line.strip()]
    assert lines[-3:-1] == ["event: error", lines[-2]] and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "DEADLINE_EXCEEDED" and error["type"] == "timeout"


def test_each_error_status_through_pardec_up(tmp_path):
    """OpenAI's SDK, unmodified, against a real `pardec up`: one error of each status the gateway
    gives (403 has no case: the public API has no per-tenant permissions; 503: the next test, as
    `pardec up` stops the whole stack when its verifier dies)."""
    import os
    import re
    import sys

    workdir = tmp_path / "up"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = subprocess.Popen(
        [sys.executable, "-m", "pardec.gateway.cli", "up", "--gateway-addr", "127.0.0.1:0", "--http-addr",
         "127.0.0.1:0", "--workdir", str(workdir), "--token", f"tenant-h={TOKEN}", "--max-concurrent-rpcs", "1",
         "--max-message-bytes", "4096"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "pardec is up" in line:
                break
        http = re.search(r"OpenAI-compatible API on (\S+)", "".join(lines))
        assert http, "".join(lines)
        hi = [{"role": "user", "content": "Hi"}]
        with openai.OpenAI(base_url=http.group(1), api_key=TOKEN, max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            ok = client.chat.completions.create(model=model, messages=hi, max_tokens=4, temperature=0)
            assert ok.choices[0].message.content

            def status_of(call) -> int:
                with pytest.raises(openai.APIStatusError) as caught:
                    call()
                return caught.value.status_code

            create = client.chat.completions.create
            assert status_of(lambda: create(model=model, messages=hi, n=2)) == 400
            assert status_of(lambda: create(model="gpt-4o", messages=hi)) == 404
            assert status_of(lambda: create(model=model, messages=[{"role": "user", "content": "x" * 5000}])) == 413
            assert status_of(lambda: create(model=model, messages=hi, max_tokens=64,
                                            extra_headers={"X-Request-Timeout": "0.01"})) == 504
            stream = create(model=model, messages=[{"role": "user", "content": "Tell a long story."}],
                            max_tokens=300, temperature=0, stream=True)
            next(iter(stream))  # holds the one admission slot
            assert status_of(lambda: create(model=model, messages=hi)) == 429
            stream.close()
            with openai.OpenAI(base_url=http.group(1), api_key="not-the-token-0123456789", max_retries=0) as other:
                assert status_of(lambda: other.chat.completions.create(model=model, messages=hi)) == 401
    finally:
        up.terminate()
        up.wait(60)


def test_a_verifier_gone_is_503(stack, engine):
    from pardec.runtime.serving import start_server
    from pardec.verifier.service import VerifierServicer

    verifier, address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    config = GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"], rpc_timeout_s=5.0)
    running = start_gateway(config, "127.0.0.1:0", http_address="127.0.0.1:0")
    try:
        verifier.stop(None)
        with openai.OpenAI(base_url=f"http://{running.http_address}/v1", api_key="x", max_retries=0,
                           timeout=120) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                               model=_model(running))
        assert caught.value.status_code == 503 and caught.value.body["type"] == "service_unavailable"
    finally:
        running.stop()


def _limited_gateway(stack, **extra):
    return start_gateway(_config(stack, max_concurrent_rpcs=1, **extra), "127.0.0.1:0", http_address="127.0.0.1:0")


def test_a_slow_body_holds_no_admission_slot_and_times_out(stack, monkeypatch):
    import socket

    from pardec.gateway import http_front

    monkeypatch.setattr(http_front, "_BODY_TIMEOUT_S", 1.5)
    running = _limited_gateway(stack)
    host, port = running.http_address.rsplit(":", 1)
    try:
        slow = socket.create_connection((host, int(port)), timeout=30)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")  # and nothing more
        with openai.OpenAI(base_url=f"http://{running.http_address}/v1", api_key="x", max_retries=0) as client:
            reply = client.chat.completions.create(model=_model(running), messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2, temperature=0)  # the one slot is free
        assert reply.choices[0].message.content is not None
        answer = b""
        while chunk := slow.recv(4096):  # headers and body may come in separate segments; the server then closes
            answer += chunk
        answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "body: not received whole" in answer
        assert "connection: close" in answer.lower()
        slow.close()
    finally:
        running.stop()


def test_a_client_that_stops_reading_is_let_go_at_its_deadline(stack):
    import socket

    running = _limited_gateway(stack)
    host, port = running.http_address.rsplit(":", 1)
    try:
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # the server's sends block soon
        reader.connect((host, int(port)))
        body = json.dumps({"model": _model(running), "stream": True, "max_tokens": 2000, "temperature": 0,
                           "parallel_decoding": False,
                           "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}]})
        reader.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Request-Timeout: 3\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        assert reader.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
        started = time.monotonic()
        with openai.OpenAI(base_url=f"http://{running.http_address}/v1", api_key="x", max_retries=0) as client:
            while True:  # the slot comes back once the deadline lets the stalled reader go
                try:
                    client.chat.completions.create(model=_model(running), max_tokens=2,
                                                   messages=[{"role": "user", "content": "Hi"}])
                    break
                except openai.RateLimitError:
                    assert time.monotonic() - started < 8, "the stalled reader still holds the slot"
                    time.sleep(0.1)
        assert running.generator.in_flight == 0
        reader.close()
    finally:
        running.stop()


def test_mutual_tls_with_tokens_serves_http(stack, pki):
    import ssl

    from pardec.runtime.security import ServerTLS

    running = _limited_gateway(stack, tls=ServerTLS(pki.server_cert, pki.server_key, pki.ca),
                               tokens=BearerTokens.from_mapping({TOKEN: "tenant-h"}))
    try:
        context = ssl.create_default_context(cafile=pki.ca)
        context.load_cert_chain(pki.client_a_cert, pki.client_a_key)
        request = urllib.request.Request(f"https://{running.http_address}/v1/models",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=60, context=context) as reply:
            assert json.loads(reply.read())["data"][0]["id"] == _model(running)
        bare = ssl.create_default_context(cafile=pki.ca)  # no client certificate: refused by TLS itself
        with pytest.raises(OSError):
            urllib.request.urlopen(request, timeout=60, context=bare)
    finally:
        running.stop()
