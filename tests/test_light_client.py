"""The light client, pardec-client (client/: the contract pardec.v1 and pardec.client), against
real gateways on loopback: the blocking and asyncio clients agree with the raw stubs, refusals
arrive as PardecError with the server's message, TLS and tokens work, and the distribution
installs alone in a fresh venv, without torch, and calls a running gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import json_format

from pardec.client import AsyncClient, Client, Message, PardecError
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import start_gateway
from pardec.runtime.security import BearerTokens, ServerTLS
from pardec.v1 import common_pb2, gateway_pb2
from tests.secure import TOKEN_A

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
PROMPT = "Write a Python function that reverses a string."
TURNS = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


def raw_generate(stack, **fields) -> gateway_pb2.GenerateResponse:
    return stack.gateway.Generate(gateway_pb2.GenerateRequest(**fields), timeout=TIMEOUT_S)


def raw_turns() -> list[gateway_pb2.Message]:
    roles = {"system": gateway_pb2.ROLE_SYSTEM, "user": gateway_pb2.ROLE_USER}
    return [gateway_pb2.Message(role=roles[t["role"]], content=t["content"]) for t in TURNS]


def test_generate_is_the_stubs_reply_and_the_concatenated_stream(stack):
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        reply = client.generate(PROMPT, max_new_tokens=16)
        chunks = list(client.stream(PROMPT, max_new_tokens=16))
    raw = raw_generate(stack, prompt=PROMPT, max_new_tokens=16)
    assert (reply.text, reply.token_ids, reply.finish_reason, reply.model) == (
        raw.text, tuple(raw.token_ids), raw.finish_reason, raw.model)
    assert reply.stats.prompt_tokens == raw.stats.prompt_tokens and reply.stats.steps >= 1
    assert "".join(c.text for c in chunks) == reply.text
    assert sum((c.token_ids for c in chunks), ()) == reply.token_ids
    assert all(c.stats is None and c.finish_reason == "" for c in chunks[:-1])
    assert chunks[-1].finish_reason == reply.finish_reason and chunks[-1].stats is not None


def test_beams_are_the_stubs(stack):
    options = dict(max_new_tokens=6, plain=True, use_beam_search=True, length_penalty=0.5)
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        beams = {chunk.index: chunk.token_ids for chunk in client.stream(PROMPT, n=2, **options)}
        best = client.generate(PROMPT, **options)
    raw = raw_generate(stack, prompt=PROMPT, max_new_tokens=6, decoding=gateway_pb2.DECODING_MODE_PLAIN,
                       use_beam_search=True, length_penalty=0.5)
    assert sorted(beams) == [0, 1] and best.token_ids == tuple(raw.token_ids) and raw.stats.decoding_method == (
        "beam_search")


def test_logprobs_are_the_stubs_and_arrive_with_each_chunk(stack):
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        reply = client.generate(PROMPT, max_new_tokens=8, plain=True, logprobs=2)
        chunks = list(client.stream(PROMPT, max_new_tokens=8, plain=True, logprobs=2))
        assert client.generate(PROMPT, max_new_tokens=4).logprobs == ()
    raw = raw_generate(stack, prompt=PROMPT, max_new_tokens=8, logprobs=True, top_logprobs=2,
                       decoding=gateway_pb2.DECODING_MODE_PLAIN)
    assert [(lp.logprob, [t for t, _ in lp.top]) for lp in reply.logprobs] == [
        (lp.logprob, list(lp.top_token_ids)) for lp in raw.logprobs]
    assert len(reply.logprobs) == len(reply.token_ids) and sum((c.logprobs for c in chunks), ()) == reply.logprobs
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        scored = client.generate(PROMPT, max_new_tokens=2, plain=True, prompt_logprobs=0)
        assert scored.prompt_token_ids == tuple(client.tokenize(PROMPT)) and scored.logprobs == ()
        by_ids = client.generate(prompt_token_ids=scored.prompt_token_ids, max_new_tokens=2, plain=True)
        assert by_ids.token_ids == scored.token_ids
        first = by_ids.token_ids[0]
        assert client.generate(PROMPT, max_new_tokens=2, logit_bias={first: -100}).token_ids[0] != first
        only = client.generate(PROMPT, max_new_tokens=3, min_tokens=3, allowed_token_ids=[first])
        assert only.token_ids == (first,) * 3
    assert len(scored.prompt_logprobs) == len(scored.prompt_token_ids) - 1


def test_structured_output_is_the_stubs_language(stack):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"],
              "additionalProperties": False}
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        reply = client.generate(PROMPT, max_new_tokens=48, json_schema=schema)
        assert client.generate(PROMPT, max_new_tokens=48, json_schema=json.dumps(schema)).text == reply.text
        assert client.generate(PROMPT, max_new_tokens=8, choice=["yes", "no"]).text in ("yes", "no")
        with pytest.raises(TypeError, match="at most one of"):
            client.generate(PROMPT, regex="a+", grammar='start: "a"')
        with pytest.raises(PardecError) as refused:
            client.generate(PROMPT, regex="(a")
    language = common_pb2.StructuredOutput(json_schema=json.dumps(schema))
    raw = raw_generate(stack, prompt=PROMPT, max_new_tokens=48, sampling=common_pb2.SamplingParams(
        structured_output=language))
    assert reply.text == raw.text and json.loads(reply.text)["answer"]
    assert refused.value.code == "INVALID_ARGUMENT" and "structured_output.regex" in refused.value.message


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tool_calls_are_the_stubs_and_a_history_with_them_is_sent_whole(stack):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        reply = client.chat(ask, tools=[WEATHER], tool_choice=choice, max_new_tokens=40)
        streamed = list(client.stream(messages=ask, tools=[WEATHER["function"]], tool_choice="required",
                                      parallel_tool_calls=False, max_new_tokens=40))
        call = reply.tool_calls[0]
        history = [*ask, Message("assistant", tool_calls=(call,)),
                   {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
        answer = client.chat(history, tools=[WEATHER], max_new_tokens=8)
        longer = client.tokenize(messages=history, tools=[WEATHER])
        with pytest.raises(PardecError) as refused:
            client.chat(ask, tools=[WEATHER], tool_choice={"function": {"name": "nope"}})
    raw = stack.gateway.Generate(gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, content=ask[0]["content"])], max_new_tokens=40,
        tools=[gateway_pb2.Tool(function=gateway_pb2.Function(name="get_weather", parameters=json.dumps(
            WEATHER["function"]["parameters"])))], tool_choice=gateway_pb2.ToolChoice(function="get_weather")),
        timeout=TIMEOUT_S)
    assert (call.name, call.arguments, reply.text, reply.finish_reason) == (
        raw.tool_calls[0].function.name, raw.tool_calls[0].function.arguments, "", raw.finish_reason)
    assert call.id.startswith("call_") and json.loads(call.arguments)["city"]
    assert [c.name for chunk in streamed for c in chunk.tool_calls] == ["get_weather"]
    assert streamed[-1].finish_reason == "tool_calls"
    assert answer.text and not answer.tool_calls and len(longer) == answer.stats.prompt_tokens
    assert refused.value.code == "INVALID_ARGUMENT" and refused.value.message.startswith("tool_choice")


def test_chat_with_a_system_message_is_the_conversation_the_stubs_send(stack):
    raw = raw_generate(stack, messages=raw_turns(), max_new_tokens=16)
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        as_dicts = client.chat(TURNS, max_new_tokens=16)
        as_messages = client.chat([Message(t["role"], t["content"]) for t in TURNS], max_new_tokens=16)
        as_system = client.generate(TURNS[1]["content"], system=TURNS[0]["content"], max_new_tokens=16)
        salted = client.chat(TURNS, max_new_tokens=16, cache_salt="light-client")  # its own cached blocks
    assert as_dicts.text == as_messages.text == as_system.text == salted.text == raw.text
    assert salted.stats.cached_prompt_tokens <= as_messages.stats.prompt_tokens
    assert as_dicts.stats.prompt_tokens == raw.stats.prompt_tokens


def test_a_refusal_raises_pardec_error_with_the_servers_message(stack):
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        with pytest.raises(PardecError) as refused:
            client.generate(PROMPT, top_p=1.5)
        with pytest.raises(PardecError) as refused_stream:
            list(client.stream(PROMPT, top_p=1.5))
        with pytest.raises(ValueError, match="role"):
            client.chat([{"role": "function", "content": "{}"}])  # not a role of the contract
    assert refused.value.code == refused_stream.value.code == "INVALID_ARGUMENT"
    assert "top_p" in refused.value.message and refused.value.message == refused_stream.value.message
    assert str(refused.value).startswith("INVALID_ARGUMENT: ")


def test_served_model_carries_every_field_of_the_stubs(stack):
    with Client(stack.addresses["gateway"], timeout=TIMEOUT_S) as client:
        served = client.served_model()
    raw = stack.gateway.GetServedModel(gateway_pb2.GetServedModelRequest(), timeout=TIMEOUT_S)
    assert dataclasses.asdict(served) == json_format.MessageToDict(
        raw, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def test_the_async_client_answers_as_the_blocking_one(stack):
    address = stack.addresses["gateway"]
    with Client(address, timeout=TIMEOUT_S) as client:
        expected = (client.generate(PROMPT, max_new_tokens=16), client.chat(TURNS, max_new_tokens=16),
                    client.served_model())

    async def main():
        async with AsyncClient(address, timeout=TIMEOUT_S) as client:
            reply = await client.generate(PROMPT, max_new_tokens=16)
            chunks = [chunk async for chunk in client.stream(PROMPT, max_new_tokens=16)]
            chat = await client.chat(TURNS, max_new_tokens=16)
            served = await client.served_model()
            with pytest.raises(PardecError) as refused:
                await client.generate(PROMPT, temperature=-1.0)
            return reply, chunks, chat, served, refused.value

    reply, chunks, chat, served, refused = asyncio.run(main())
    assert (reply.text, reply.token_ids) == (expected[0].text, expected[0].token_ids)
    assert "".join(c.text for c in chunks) == reply.text and chunks[-1].finish_reason == reply.finish_reason
    assert chat.text == expected[1].text and served == expected[2]
    assert refused.code == "INVALID_ARGUMENT" and "temperature" in refused.message


def test_tls_client_certificates_and_tokens(stack, pki):
    """A gateway over mutual TLS that also requires a bearer token, in front of the shared stack."""
    config = GatewayConfig(
        verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"],
        tls=ServerTLS(pki.server_cert, pki.server_key, pki.ca), tokens=BearerTokens.from_mapping({TOKEN_A: "a"}),
    )
    gateway = start_gateway(config, "127.0.0.1:0")
    try:
        files = {"tls_ca": pki.ca, "tls_cert": pki.client_a_cert, "tls_key": pki.client_a_key}
        with Client(gateway.address, token=TOKEN_A, timeout=TIMEOUT_S, **files) as client:
            assert client.generate(PROMPT, max_new_tokens=8).text == raw_generate(
                stack, prompt=PROMPT, max_new_tokens=8).text
        with Client(gateway.address, timeout=TIMEOUT_S, **files) as client, pytest.raises(PardecError) as refused:
            client.served_model()
        assert refused.value.code == "UNAUTHENTICATED"
        with pytest.raises(ValueError, match="tls_key"):
            Client(gateway.address, tls_ca=pki.ca, tls_cert=pki.client_a_cert)
    finally:
        gateway.stop()


SCRIPT = """
import sys
from pardec.client import Client

with Client(sys.argv[1], timeout=300) as client:
    print(client.generate(sys.argv[2], max_new_tokens=16).text)
assert "torch" not in sys.modules
"""


def test_the_client_installs_alone_without_torch_and_calls_the_gateway(stack, tmp_path):
    """pip install of client/ (not editable) in a venv without the system's site-packages."""
    source = tmp_path / "client"  # setuptools writes build/ beside pyproject.toml: not into the checkout
    shutil.copytree(ROOT / "client", source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True, env=env)
    python = str(tmp_path / "venv" / "bin" / "python")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([python, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)

    installed = run("-m", "pip", "install", "-q", "--disable-pip-version-check", str(source))
    assert installed.returncode == 0, installed.stderr
    names = {line.split("==")[0].lower() for line in run("-m", "pip", "freeze", "--all").stdout.split()}
    assert "pardec-client" in names and not names & {"torch", "pardec", "grpcio-tools"}, names
    assert run("-c", "import torch").returncode != 0
    called = run("-c", SCRIPT, stack.addresses["gateway"], PROMPT)
    assert called.returncode == 0, called.stderr
    assert called.stdout == raw_generate(stack, prompt=PROMPT, max_new_tokens=16).text + "\n"
