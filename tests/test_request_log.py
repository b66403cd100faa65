"""The gateway's log of requests and of its load (gateway/request_log.py, gateway/load_log.py):
the lines from literal figures, then a real gateway's lines for gRPC and HTTP requests, answered
and refused, under the callers' request ids."""

from __future__ import annotations

import doctest
import json
import logging
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

import pardec.gateway.load_log
import pardec.gateway.request_log
from pardec.client import Client
from pardec.gateway.load_log import LoadLog
from pardec.gateway.metrics import GatewayMetrics
from pardec.gateway.server import start_gateway
from pardec.runtime import tracing
from pardec.runtime.errors import ConfigError
from pardec.runtime.security import BearerTokens
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.openai_front import TOKEN, gateway_config


def test_doctests():
    for module in (pardec.gateway.request_log, pardec.gateway.load_log, tracing):
        assert doctest.testmod(module).failed == 0


def test_an_idle_interval_says_what_it_can():
    line = pardec.gateway.load_log.load_line({}, {"pardec_requests_failed": 2.0}, 10.0)
    assert line == "load: 0 running; last 10 s: 0 finished (0 prompt tokens, 0 generated), 2 failed or refused"
    with pytest.raises(ConfigError, match="log_stats_interval_s: must be >= 0"):
        gateway_config_of(log_stats_interval_s=-1.0)


def test_the_load_log_is_quiet_while_idle(caplog):
    caplog.set_level(logging.INFO, logger="pardec.gateway")
    metrics = GatewayMetrics()
    load = LoadLog(metrics.registry, 0.05)
    try:
        time.sleep(0.3)
        assert not _lines(caplog, "pardec.gateway.load")
        metrics.step(draft_tokens=4, accepted=3, seconds=0.01)
        deadline = time.monotonic() + 5
        while not _lines(caplog, "pardec.gateway.load") and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        load.stop()
    (line,) = _lines(caplog, "pardec.gateway.load")
    assert "1 steps committed 4 tokens" in line and line.endswith("4.00 tokens per drafted step, 75.0% of 4 draft "
                                                                  "tokens accepted")


def gateway_config_of(**fields):
    from pardec.gateway.config import GatewayConfig

    return GatewayConfig(verifier_target="127.0.0.1:1", drafter_target="127.0.0.1:2", **fields)


def _lines(caplog, logger: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == logger]


def test_each_request_is_a_line_under_its_callers_id(stack, caplog):
    caplog.set_level(logging.INFO, logger="pardec.gateway")
    config = gateway_config(stack, log_requests=True, log_stats_interval_s=0.05,
                            tokens=BearerTokens.from_mapping({TOKEN: "tenant-log"}))
    running = start_gateway(config, "127.0.0.1:0", http_address="127.0.0.1:0")
    bearer = (("authorization", f"Bearer {TOKEN}"),)
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            gateway = gateway_pb2_grpc.GatewayStub(channel)
            answered = gateway.Generate(gateway_pb2.GenerateRequest(
                prompt="Repeat: red green blue red green blue red green blue", max_new_tokens=32),
                metadata=(*bearer, ("x-request-id", "grpc-1")), timeout=120)
            with pytest.raises(grpc.RpcError) as refused:
                gateway.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=10 ** 6),
                                 metadata=(*bearer, ("x-request-id", "grpc-2")), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError):  # refused by the front, before the generator
                gateway.Generate(gateway_pb2.GenerateRequest(prompt="Hi", n=2, decoding=gateway_pb2.DECODING_MODE_PLAIN),
                                 metadata=(*bearer, ("x-request-id", "grpc-3")), timeout=60)
            gateway.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=2), metadata=bearer, timeout=60)
        body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6}).encode()
        http = urllib.request.Request(f"http://{running.http_address}/v1/chat/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}", "X-Request-Id": "http-1"})
        with urllib.request.urlopen(http, timeout=120) as response:
            chat = json.loads(response.read())
        several = urllib.request.Request(http.full_url, data=json.dumps({**json.loads(body), "n": 2, "parallel_decoding":
                                         False}).encode(), headers={**http.headers, "X-request-id": "http-n"})
        with urllib.request.urlopen(several, timeout=120) as response:
            assert len(json.loads(response.read())["choices"]) == 2
        with Client(running.address, token=TOKEN, timeout=60) as client:  # the light client's request_id
            client.generate("Hi", max_new_tokens=2, request_id="client-1")
            assert "".join(chunk.text for chunk in client.stream("Hi", max_new_tokens=2, request_id="client-2"))
        said = subprocess.run([sys.executable, "-m", "pardec.gateway.cli", "generate", "Hi", "--addr", running.address,
                               "--max-new-tokens", "2", "--request-id", "cli-1", "--token", TOKEN],
                              capture_output=True, text=True, timeout=120)
        assert said.returncode == 0, said.stderr
        bad = urllib.request.Request(http.full_url, data=json.dumps({**json.loads(body), "temperature": "hot"}).encode(),
                                     headers={**http.headers, "X-request-id": "http-2"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=60)
        assert refused.value.code == 400
        beams = urllib.request.Request(http.full_url, data=json.dumps({  # refused by beam search's own rules
            **json.loads(body), "use_beam_search": True, "parallel_decoding": False, "stop": ["x"]}).encode(),
            headers={**http.headers, "X-request-id": "http-beam"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(beams, timeout=60)
        assert refused.value.code == 400
        late = urllib.request.Request(http.full_url, data=body, headers={**http.headers, "X-request-id": "http-3",
                                                                         "X-request-timeout": "soon"})
        with pytest.raises(urllib.error.HTTPError):  # refused before its deadline is known: still under its id
            urllib.request.urlopen(late, timeout=60)
        unscored = urllib.request.Request(f"http://{running.http_address}/tokenize", data=b"{}", headers={
            **http.headers, "X-request-id": "tokenize-1"})
        with pytest.raises(urllib.error.HTTPError):  # not a generation: answered, not logged
            urllib.request.urlopen(unscored, timeout=60)
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            with pytest.raises(grpc.RpcError) as unknown:  # anyone may send it: the metrics count it, no line
                gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(prompt="Hi"), metadata=(
                    ("authorization", "Bearer not-a-token-0123456789"), ("x-request-id", "grpc-4")), timeout=60)
            assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        running.stop()
    every = _lines(caplog, "pardec.gateway.requests")
    assert sorted(line.split()[2] for line in every if "id=http-n " in line) == ["sequence=0", "sequence=1"]
    lines = {line.split()[1].removeprefix("id="): line for line in every}
    stats = answered.stats
    assert lines["grpc-1"] == (
        f"request id=grpc-1 tenant=tenant-log status=OK prompt_tokens={stats.prompt_tokens}"
        + (f" cached_tokens={stats.cached_prompt_tokens}" if stats.cached_prompt_tokens else "")
        + f" completion_tokens={len(answered.token_ids)} method=memory_decoding steps={stats.steps}"
        + f" tokens_per_step={stats.mean_accepted_length:.2f}"
        + re.search(r" ttft_ms=\d+ e2e_ms=\d+$", lines["grpc-1"]).group(0))
    assert lines["grpc-2"].startswith("request id=grpc-2 tenant=tenant-log status=INVALID_ARGUMENT error=\"max_new_tokens")
    assert f"completion_tokens={chat['usage']['completion_tokens']} " in lines["http-1"]
    assert chat["id"] == "chatcmpl-http-1"  # the reply is named after its request, as vLLM names it
    assert lines["grpc-3"].startswith('request id=grpc-3 tenant=tenant-log status=INVALID_ARGUMENT error="n: ')
    assert lines["http-2"].startswith('request id=http-2 tenant=tenant-log status=INVALID_ARGUMENT error="temperature')
    assert all(f"request id={name} tenant=tenant-log status=OK" in lines[name] for name in ("client-1", "client-2", "cli-1"))
    assert 'status=INVALID_ARGUMENT error="X-Request-Timeout' in lines["http-3"]
    assert lines["http-beam"].startswith('request id=http-beam tenant=tenant-log status=INVALID_ARGUMENT error="stop')
    assert "tokenize-1" not in lines and "grpc-4" not in lines
    given = ("grpc-1", "grpc-2", "grpc-3", "http-1", "http-2", "http-3", "http-n", "http-beam", "client-1", "client-2", "cli-1")
    (new,) = [name for name in lines if name not in given]  # none given: a new id
    assert re.fullmatch("[0-9a-f]{32}", new)
    loads = _lines(caplog, "pardec.gateway.load")
    assert loads and all(line.startswith("load: ") for line in loads) and any("tokens/s" in line for line in loads)


def test_off_by_default(stack, caplog):
    caplog.set_level(logging.INFO, logger="pardec.gateway")
    running = start_gateway(gateway_config(stack, log_stats_interval_s=0), "127.0.0.1:0")
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=2),
                                                          timeout=60)
    finally:
        running.stop()
    assert not _lines(caplog, "pardec.gateway.requests") and not _lines(caplog, "pardec.gateway.load")


def test_every_api_names_its_reply_after_the_request(front):
    """Responses' and Anthropic's replies, whole and streamed, carry the request's id as chat's do."""
    bodies = {"/v1/responses": ({"input": "Hi", "max_output_tokens": 2}, "resp_"),
              "/v1/messages": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, "msg_")}
    for path, (body, prefix) in bodies.items():
        for stream in (False, True):
            asked = urllib.request.Request(f"http://{front.http_address}{path}", method="POST",
                                           data=json.dumps({**body, "stream": stream}).encode(),
                                           headers={"Content-Type": "application/json", "X-Request-Id": "named-1"})
            with urllib.request.urlopen(asked, timeout=120) as reply:
                text = reply.read().decode()
            assert f'"id":"{prefix}named-1"' in text.replace(" ", ""), (path, stream, text[:300])
