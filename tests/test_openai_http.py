"""The gateway's OpenAI-compatible HTTP API (gateway/http_front.py), called by OpenAI's own SDK,
unmodified, and by curl, against a real gateway on loopback over the shared verifier and drafter.
`pardec up` serving it by default: test_cli.py. The body <-> Request rules: test_openai_api.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
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

TOKEN = "http-front-token-0123456789"
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
    {"role": "user", "content": "What is a Python list?"},
    {"role": "assistant", "content": "A mutable ordered sequence of values."},
    {"role": "user", "content": "Write a Python function that returns the last element of a list."},
]


def _config(stack, **extra) -> GatewayConfig:
    return GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"],
                         **extra)


@pytest.fixture(scope="module")
def front(stack):
    running = start_gateway(_config(stack), "127.0.0.1:0", metrics_address="127.0.0.1:0",
                            http_address="127.0.0.1:0")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=f"http://{front.http_address}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        yield client


def _model(front) -> str:
    return front.generator.model.model_name


def _grpc_text(address: str, messages, max_new_tokens: int, plain: bool = False) -> str:
    roles = {"system": gateway_pb2.ROLE_SYSTEM, "user": gateway_pb2.ROLE_USER, "assistant": gateway_pb2.ROLE_ASSISTANT}
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.Message(role=roles[m["role"]], content=m["content"]) for m in messages],
        max_new_tokens=max_new_tokens,
        decoding=gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT,
    )
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        return gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300).text


def test_chat_completion_streamed_equals_unary_equals_grpc_and_plain(front, client):
    model = _model(front)
    unary = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=40, temperature=0)
    assert unary.object == "chat.completion" and unary.model == model
    choice = unary.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert unary.usage.completion_tokens > 0 and unary.usage.prompt_tokens > 20
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + unary.usage.completion_tokens
    pardec = unary.usage.model_extra["pardec"]
    assert pardec["decoding_method"] == "memory_decoding" and pardec["steps"] >= 1

    chunks = list(client.chat.completions.create(
        model=model, messages=CONVERSATION, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert len({chunk.id for chunk in chunks}) == 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content
    assert _grpc_text(front.address, CONVERSATION, 40) == streamed
    plain = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=40, temperature=0,
                                           extra_body={"parallel_decoding": False})
    assert plain.choices[0].message.content == streamed  # lossless
    assert plain.usage.model_extra["pardec"]["decoding_method"] == "plain"


def test_a_system_prompt_changes_the_output(front, client):
    model = _model(front)
    question = [{"role": "user", "content": "Name a colour."}]
    answers = {
        client.chat.completions.create(model=model, messages=system + question, max_tokens=16,
                                       temperature=0).choices[0].message.content
        for system in ([], [{"role": "system", "content": "Answer only in French, in capital letters."}])
    }
    assert len(answers) == 2


def test_completions_send_the_prompt_raw(front, client):
    model = _model(front)
    prompt = "def fibonacci(n):\n"
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text
    assert reply.usage.prompt_tokens == len(front.generator.model.tokenizer.encode_raw(prompt))
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True) if chunk.choices)
    assert streamed == reply.choices[0].text


def test_models_list_and_health(front, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [_model(front)]
    assert models.data[0].model_extra["max_model_len"] == front.generator.model.max_seq_len
    assert client.models.retrieve(_model(front)).id == _model(front)
    with urllib.request.urlopen(f"http://{front.http_address}/health", timeout=10) as reply:
        assert reply.status == 200


@pytest.mark.parametrize("call, status, param", [
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], n=2), 400, "n"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], logprobs=True),
     400, "logprobs"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "f", "parameters": {}}}]), 400, "tools"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                            response_format={"type": "json_object"}), 400, "response_format"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                            temperature=-1), 400, "temperature"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=10**6), 400, "max_tokens"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "tool", "content": "x"}]), 400,
     "messages[0].role"),
    (lambda c, m: c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}]), 404,
     "model"),
    (lambda c, m: c.models.retrieve("gpt-4o"), 404, "model"),
])
def test_errors_are_openai_errors_with_the_matching_status(front, client, call, status, param):
    with pytest.raises(openai.APIStatusError) as caught:
        call(client, _model(front))
    assert caught.value.status_code == status
    assert caught.value.body["param"] == param and caught.value.body["message"].startswith(param)


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
        with openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=300) as client:
            assert client.models.list().data[0].id == model
            with pytest.raises(openai.APIStatusError) as caught:  # over max_message_bytes
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * 5000}])
            assert caught.value.status_code == 413
            # One slot: a stream holds it, a second call is refused 429 over either front.
            stream = client.chat.completions.create(model=model, messages=messages, max_tokens=200,
                                                    temperature=0, stream=True)
            next(iter(stream))
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
            deadline = time.monotonic() + 5
            while running.generator.in_flight and time.monotonic() < deadline:
                time.sleep(0.02)
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
        return not front.generator.in_flight and not engine.sessions and _drafter_keys(redis_server) == before

    while not freed() and time.monotonic() - closed < 5:
        time.sleep(0.01)
    assert freed() and time.monotonic() - closed < 1.0


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events(front):
    body = json.dumps({"model": _model(front), "messages": CONVERSATION, "max_tokens": 24, "temperature": 0,
                       "stream": True})
    result = subprocess.run(
        ["curl", "-sS", "-N", f"http://{front.http_address}/v1/chat/completions",
         "-H", "Content-Type: application/json", "-d", body], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    events = [line[len("data: "):] for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == _grpc_text(front.address, CONVERSATION, 24)
    result = subprocess.run(["curl", "-sS", "-w", "%{http_code}", f"http://{front.http_address}/v1/nowhere"],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.endswith("404") and '"not_found_error"' in result.stdout


def test_requests_in_flight_over_both_fronts_do_not_mix(front, client):
    texts, errors = {}, []

    def ask(index: int) -> None:
        try:
            texts[index] = client.chat.completions.create(
                model=_model(front), messages=[{"role": "user", "content": f"Spell the number {index}."}],
                max_tokens=12, temperature=0).choices[0].message.content
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index in range(3):
        alone = client.chat.completions.create(
            model=_model(front), messages=[{"role": "user", "content": f"Spell the number {index}."}],
            max_tokens=12, temperature=0).choices[0].message.content
        assert texts[index] == alone


def test_http_errors_without_the_sdk(front):
    def post(body: bytes, headers=None):
        request = urllib.request.Request(f"http://{front.http_address}/v1/chat/completions", data=body,
                                         headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    status, body = post(b"{not json")
    assert status == 400 and body["error"]["message"].startswith("body: not valid JSON")
    status, body = post(b'{"messages": []}')
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}')
    assert status == 400 and body["error"]["message"] == "temperature: must be a number, got 'hot'"


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


def test_http_requests_are_counted_under_fixed_labels(front, client):
    client.models.list()
    client.chat.completions.create(model=_model(front), messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=_model(front), messages=[{"role": "user", "content": "Hi"}], n=3)
    for path in ("/v1/made-up-1", "/v1/made-up-2"):
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://{front.http_address}{path}", timeout=10)
    with urllib.request.urlopen(f"http://{front.metrics_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert 'pardec_requests_total{method="Models",status="OK"}' in text
    assert 'method="ChatCompletions",status="OK"' in text and 'method="ChatCompletions",status="INVALID_ARGUMENT"' in text
    assert "made-up" not in text


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
