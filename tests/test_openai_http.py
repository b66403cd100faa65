"""The gateway's OpenAI-compatible HTTP API (gateway/http_front.py), called by OpenAI's own SDK,
unmodified, and by curl, against a real gateway on loopback over the shared verifier and drafter.
`pardec up` serving it by default: test_cli.py. The body <-> Request rules: test_openai_api.py."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from pardec.client import Client
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.openai_front import model_of as _model

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
    {"role": "user", "content": "What is a Python list?"},
    {"role": "assistant", "content": "A mutable ordered sequence of values."},
    {"role": "user", "content": "Write a Python function that returns the last element of a list."},
]


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
    with urllib.request.urlopen(f"http://{front.http_address}/ping", timeout=10) as reply:
        assert reply.status == 200  # SageMaker's probe
    with urllib.request.urlopen(f"http://{front.http_address}/version", timeout=10) as reply:
        assert json.loads(reply.read())["version"] == importlib.metadata.version("pardec")


@pytest.mark.parametrize("call, status, param", [
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], n=2), 400, "n"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], logprobs=True),
     400, "logprobs"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "f g", "parameters": {}}}]), 400, "tools[0].function.name"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                            response_format={"type": "xml"}), 400, "response_format"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                            temperature=-1), 400, "temperature"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=10**6), 400, "max_tokens"),
    (lambda c, m: c.chat.completions.create(model=m, messages=[{"role": "tool", "content": "x"}]), 400,
     "messages[0].tool_call_id"),
    (lambda c, m: c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}]), 404,
     "model"),
    (lambda c, m: c.models.retrieve("gpt-4o"), 404, "model"),
])
def test_errors_are_openai_errors_with_the_matching_status(front, client, call, status, param):
    with pytest.raises(openai.APIStatusError) as caught:
        call(client, _model(front))
    assert caught.value.status_code == status
    assert caught.value.body["param"] == param and caught.value.body["message"].startswith(param)


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
                                         headers={"Content-Type": "application/json", **(headers or {})})
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
    with urllib.request.urlopen(f"http://{front.http_address}/metrics", timeout=10) as reply:  # where vLLM serves them
        assert reply.headers["Content-Type"].startswith("text/plain")
        on_the_api = reply.read().decode()
    assert 'pardec_requests_total{method="Models",status="OK"}' in on_the_api and "pardec_generation_tokens_total" in on_the_api
    assert 'method="ChatCompletions",status="OK"' in text and 'method="ChatCompletions",status="INVALID_ARGUMENT"' in text
    assert "made-up" not in text




def test_sagemaker_invocations_are_routed_by_the_body(front, client):
    """SageMaker posts every request to /invocations: a chat body is a chat completion, a prompt's a
    completion, each answered as on its own path; neither is a 400 naming the rule."""
    def post(body: dict) -> tuple[int, bytes]:
        call = urllib.request.Request(f"http://{front.http_address}/invocations", data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(call, timeout=300) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as refused:
            return refused.code, refused.read()

    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0}
    direct = client.chat.completions.create(model=_model(front), **chat).choices[0].message.content
    status, answer = post(chat)
    assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"] == direct
    completion = {"prompt": "Colors: red,", "max_tokens": 6, "temperature": 0}
    text = client.completions.create(model=_model(front), **completion).choices[0].text
    status, answer = post(completion)
    assert status == 200 and json.loads(answer)["choices"][0]["text"] == text
    status, events = post({**chat, "stream": True})
    assert status == 200 and events.rstrip().endswith(b"data: [DONE]")
    status, answer = post({**completion, **chat})  # both: a chat's, as vLLM reads it
    assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"] == direct
    status, answer = post({"max_tokens": 4})
    assert status == 400 and "/invocations takes" in json.loads(answer)["error"]["message"]


def test_token_ids_come_back_beside_the_text(front, client):
    """vLLM's return_token_ids: the answer's token ids (the same under parallel decoding as plain), and the
    prompt's, whole and streamed, for chat and for each prompt of a completions batch."""
    model, tokenizer = _model(front), front.generator.model.tokenizer
    asked = {"model": model, "messages": CONVERSATION, "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**asked, extra_body={"return_token_ids": True})
    ids, prompt = whole.choices[0].model_extra["token_ids"], whole.model_extra["prompt_token_ids"]
    assert len(ids) == whole.usage.completion_tokens and len(prompt) == whole.usage.prompt_tokens
    assert tokenizer.decode(ids) == whole.choices[0].message.content
    plain = client.chat.completions.create(**asked, extra_body={"return_token_ids": True, "parallel_decoding": False})
    assert plain.choices[0].model_extra["token_ids"] == ids and plain.model_extra["prompt_token_ids"] == prompt
    chunks = list(client.chat.completions.create(**asked, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert [t for chunk in chunks for t in (chunk.choices[0].model_extra.get("token_ids") or [])] == ids
    assert "token_ids" not in client.chat.completions.create(**asked).choices[0].model_extra
    prompts = ["def add(a, b):", "The capital of France is"]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0,
                                      extra_body={"return_token_ids": True})
    for choice, text in zip(batch.choices, prompts):
        assert choice.model_extra["prompt_token_ids"] == tokenizer.encode_raw(text)
        assert tokenizer.decode(choice.model_extra["token_ids"]) == choice.text
    streamed = list(client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                              extra_body={"return_token_ids": True}))
    for index, choice in enumerate(batch.choices):
        mine = [chunk.choices[0].model_extra for chunk in streamed if chunk.choices and chunk.choices[0].index == index]
        assert [t for extra in mine for t in (extra.get("token_ids") or [])] == choice.model_extra["token_ids"]
        assert mine[0]["prompt_token_ids"] == choice.model_extra["prompt_token_ids"]
    with pytest.raises(openai.BadRequestError, match="return_token_ids: must be true or false"):
        client.chat.completions.create(**asked, extra_body={"return_token_ids": "yes"})
    with pytest.raises(openai.BadRequestError, match=r"^Error code: 400 - .*prompt\[1\]: \d+ tokens exceed"):
        client.completions.create(model=model, prompt=["hi", "word " * 3000], max_tokens=4,
                                  extra_body={"return_token_ids": True})  # a batch's error names its prompt


def test_continuous_usage_counts_every_chunk(front, client):
    """vLLM's stream_options.continuous_usage_stats: each chunk says the usage so far."""
    chunks = list(client.chat.completions.create(
        model=_model(front), messages=CONVERSATION, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
    counted = [chunk.usage.completion_tokens for chunk in chunks]
    assert all(chunk.usage is not None for chunk in chunks) and counted == sorted(counted) and counted[0] == 0
    assert counted[-1] == chunks[-1].usage.completion_tokens and chunks[-1].choices == []
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {chunks[-1].usage.prompt_tokens}
    with pytest.raises(openai.BadRequestError, match="stream_options.include_usage: must be true or false"):
        client.chat.completions.create(model=_model(front), messages=CONVERSATION, max_tokens=4, stream=True,
                                       extra_body={"stream_options": {"include_usage": "false"}})


def test_a_prompt_is_cut_to_its_last_tokens(front, client):
    """vLLM's truncate_prompt_tokens (TGI's truncate, gRPC's field): only the prompt's last N tokens are prefilled."""
    model, tokenizer = _model(front), front.generator.model.tokenizer
    prompt = "Once upon a time there was a lighthouse keeper who counted ships. The capital of France is"
    tail = tokenizer.decode(tokenizer.encode_raw(prompt)[-6:])
    cut = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 6, "return_token_ids": True})
    alone = client.completions.create(model=model, prompt=tail, max_tokens=8, temperature=0)
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == alone.choices[0].text
    assert cut.choices[0].model_extra["prompt_token_ids"] == tokenizer.encode_raw(prompt)[-6:]
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=0,
                                       extra_body={"truncate_prompt_tokens": 6, "parallel_decoding": False})
    assert echoed.choices[0].text.startswith(tail) and not echoed.choices[0].text.startswith(prompt)  # the kept end
    assert "".join(echoed.choices[0].logprobs.tokens) == echoed.choices[0].text
    whole = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=4, temperature=0,
                                           extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens > 6  # -1: up to maxInputTokenLen, here the whole conversation
    for keep in (0, -2, 10**6):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens: must be -1"):
            client.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body={"truncate_prompt_tokens": keep})
    with grpc.insecure_channel(front.address, options=CHANNEL_OPTIONS) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            prompt=prompt, raw=True, max_new_tokens=8, truncate_prompt_tokens=6), timeout=300)
    assert reply.stats.prompt_tokens == 6 and reply.text == alone.choices[0].text
    with Client(front.address, timeout=120) as light:
        assert light.generate(prompt, raw=True, max_new_tokens=8, truncate_prompt_tokens=6).text == reply.text


def test_a_priority_travels_to_the_verifier_and_changes_no_token(front, client):
    """vLLM's priority (lower first where the verifier must choose: tests/test_verifier_batching.py)."""
    asked = {"model": _model(front), "messages": CONVERSATION, "max_tokens": 12, "temperature": 0}
    texts = {client.chat.completions.create(**asked, extra_body={"priority": p}).choices[0].message.content
             for p in (-5, 0, 7)}
    assert len(texts) == 1
    with pytest.raises(openai.BadRequestError, match="priority: must be in"):
        client.chat.completions.create(**asked, extra_body={"priority": 2**40})
    with grpc.insecure_channel(front.address, options=CHANNEL_OPTIONS) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, content=CONVERSATION[1]["content"])],
            max_new_tokens=4, priority=-2), timeout=300)
    assert reply.text
