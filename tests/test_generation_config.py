"""A checkpoint's generation_config.json as HTTP requests' default sampling (vLLM's
--generation-config; verifier/generation_config.py): read and checked, named in GetModelInfo and
GetServedModel, filled into the HTTP bodies that leave a field out (never over a field they
send), and never applied to gRPC requests. Its max_new_tokens caps what an HTTP request asks (as
vLLM reads it) and lowers the server's default for any request that names none."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys

import grpc
import openai
import pytest

from pardec.gateway import openai_api
from pardec.gateway.config import GatewayConfig
from pardec.gateway.openai_api import chat_request, with_defaults
from pardec.gateway.server import start_gateway
from pardec.runtime.errors import ConfigError
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2
from pardec.verifier import generation_config
from pardec.verifier.config import VerifierConfig
from pardec.verifier.generation_config import FILE, generation_defaults
from pardec.verifier.model.weights import load_checkpoint
from pardec.verifier import server as verifier_server
from pardec.verifier.server import build_servicer
from tests.tiny_checkpoints import transformers_model, write_hf

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [151645, 151643]}


def test_the_file_is_read_checked_and_named(tmp_path):
    assert doctest.testmod(generation_config).failed == 0 and doctest.testmod(openai_api).failed == 0
    model, elsewhere = tmp_path / "model", tmp_path / "elsewhere"
    for directory, config in ((model, QWEN3), (elsewhere, {"temperature": 0.0, "repetition_penalty": 1.1})):
        directory.mkdir()
        (directory / FILE).write_text(json.dumps(config))
    assert generation_defaults("auto", str(model)) == (("temperature", 0.6), ("top_k", 20), ("top_p", 0.95))
    assert generation_defaults("none", str(model)) == ()
    assert generation_defaults(str(elsewhere), str(model)) == (("repetition_penalty", 1.1), ("temperature", 0.0))
    assert generation_defaults("auto", str(tmp_path / "model.gguf")) == generation_defaults("auto", None) == ()
    (elsewhere / FILE).write_text('{"top_p": 2}')
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p: 2 must be a number in \[0, 1\]"):
        generation_defaults(str(elsewhere), None)
    (elsewhere / FILE).write_text('{"temperature": 1e-7}')  # every request would refuse it
    with pytest.raises(ConfigError, match=r"temperature: 1e-07 must be 0 \(greedy\) or at least 1e-06"):
        generation_defaults(str(elsewhere), None)
    (elsewhere / FILE).write_text('\ufeff{"top_p": 0.8}', encoding="utf-8")  # a byte order mark first
    assert generation_defaults(str(elsewhere), None) == (("top_p", 0.8),)
    assert generation_defaults("vllm", str(model)) == ()  # vLLM's spelling of none
    (elsewhere / FILE).write_text('{"max_new_tokens": 0}')
    with pytest.raises(ConfigError, match=r"max_new_tokens: 0 must be an integer in \[1, 2.14748e\+09\]"):
        generation_defaults(str(elsewhere), None)
    (elsewhere / FILE).write_text('{"max_new_tokens": 512, "max_length": 20}')
    assert generation_defaults(str(elsewhere), None) == (("max_new_tokens", 512),)
    # Without the file, config.json's sampling where it is not transformers' default (vLLM's fallback).
    older = tmp_path / "older"
    older.mkdir()
    assert generation_defaults("auto", str(older)) == ()
    (older / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "temperature": 0.7,
                                                   "top_k": 50, "top_p": 1.0, "max_new_tokens": 512}))
    assert generation_defaults("auto", str(older)) == (("max_new_tokens", 512), ("temperature", 0.7))
    (older / "config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 2, "top_k": "many"}))
    assert generation_defaults("auto", str(older)) == (("temperature", 0.7),)  # the others left out, with a warning
    (older / FILE).write_text(json.dumps({"top_p": 0.9}))  # the file, where there is one, says it all
    assert generation_defaults("auto", str(older)) == (("top_p", 0.9),)
    (elsewhere / FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON file"):
        generation_defaults(str(elsewhere), None)
    with pytest.raises(ConfigError, match="generation_config: 'nowhere' must be auto, none, or a directory"):
        VerifierConfig(generation_config="nowhere")
    refused = subprocess.run([sys.executable, "-m", "pardec.gateway.cli", "up", "--generation-config", "nowhere",
                              "--workdir", str(tmp_path / "up")], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "generation_config: 'nowhere'" in refused.stderr, refused.stderr


def test_defaults_fill_only_what_a_body_leaves_out():
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    defaults = (("temperature", 0.0), ("top_k", 20), ("top_p", 0.95))
    sampling = chat_request(with_defaults(body, defaults), "", "m").sampling
    assert (sampling.greedy, sampling.top_k, sampling.top_p) == (True, 20, 0.95)
    sent = chat_request(with_defaults({**body, "temperature": 0.7, "top_k": None}, defaults), "", "m").sampling
    assert (sent.temperature, sent.top_k) == (pytest.approx(0.7), 20)  # null is left out
    assert chat_request(body, "", "m").sampling.temperature == 1.0  # without any: OpenAI's default


def test_the_models_max_new_tokens_caps_a_body_and_lowers_the_default():
    from pardec.gateway.clients import ModelInfo
    from pardec.gateway.served import default_max_new_tokens

    limit = (("max_new_tokens", 64), ("temperature", 0.0))
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    for asked, got in ((500, 64), (64, 64), (8, 8)):
        for field in ("max_tokens", "max_completion_tokens"):
            assert chat_request(with_defaults({**body, field: asked}, limit), "", "m").max_new_tokens == got
    assert chat_request(with_defaults(body, limit), "", "m").max_new_tokens == 0  # the server's default, below
    assert with_defaults({"max_output_tokens": 100}, limit)["max_output_tokens"] == 64  # the Responses API's
    assert with_defaults({"max_tokens": "many"}, limit)["max_tokens"] == "many"  # the request's checks refuse it
    config = GatewayConfig(verifier_target="v:1", drafter_target="d:1", default_max_new_tokens=256)
    model = ModelInfo("m", "w8a8", None, 2560, frozenset(), "qwen3", generation_defaults=limit)
    assert default_max_new_tokens(config, config.facts(), model) == 64
    assert default_max_new_tokens(config, config.facts(), ModelInfo("m", "w8a8", None, 2560, frozenset(), "qwen3")) == 256


@pytest.fixture(scope="module")
def served(tmp_path_factory, stack):
    """A tiny Qwen3 checkpoint whose generation config makes sampling greedy, behind a gateway
    with its HTTP API."""
    directory = write_hf(transformers_model("qwen3"), tmp_path_factory.mktemp("qwen3"), load_checkpoint(None).tokenizer)
    written = json.loads((directory / FILE).read_text())  # save_pretrained's
    # A base model's end-of-sequence id, past this model's vocabulary (the tokenizer's <|im_end|> is
    # in it): left out at start.
    (directory / FILE).write_text(json.dumps({**written, "do_sample": True, "temperature": 0.0, "top_k": 20,
                                                "top_p": 0.95, "eos_token_id": 151645, "max_new_tokens": 8}))
    config = VerifierConfig(model_path=str(directory), measure_cost_curve=False, prepared_cache_dir="")
    server, address = start_server([build_servicer(config).add_to], "127.0.0.1:0")
    gateway = start_gateway(GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"]),
                            "127.0.0.1:0", http_address="127.0.0.1:0")
    yield address, gateway
    gateway.stop()
    server.stop(None)


def test_the_models_defaults_reach_http_requests_and_no_grpc_one(served):
    address, gateway = served
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        from pardec.v1 import verifier_pb2_grpc

        info = verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(verifier_pb2.GetModelInfoRequest())
    assert info.generation_defaults.temperature == 0.0 and info.generation_defaults.HasField("temperature")
    assert info.generation_defaults.top_k == 20 and info.generation_defaults.top_p == 0.95  # as the file wrote it
    assert 151645 not in info.stop_token_ids and len(info.stop_token_ids) >= 1
    with grpc.insecure_channel(gateway.address, options=CHANNEL_OPTIONS) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        shown = stub.GetServedModel(gateway_pb2.GetServedModelRequest()).generation_defaults
        assert shown.HasField("temperature") and shown.top_k == 20
        asked = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12}
        with openai.OpenAI(base_url=f"http://{gateway.http_address}/v1", api_key="x", max_retries=0) as client:
            model = client.models.list().data[0].id
            left_out = [client.chat.completions.create(model=model, **asked).choices[0].message.content
                        for _ in range(2)]
            greedy = client.chat.completions.create(model=model, temperature=0, **asked).choices[0].message.content
            sampled = {client.chat.completions.create(model=model, temperature=1.0, seed=seed, **asked)
                       .choices[0].message.content for seed in range(4)}
        assert left_out == [greedy, greedy]  # the model's temperature 0: greedy
        assert len(sampled) > 1  # a temperature the request sends wins
        with openai.OpenAI(base_url=f"http://{gateway.http_address}/v1", api_key="x", max_retries=0) as client:
            capped = client.chat.completions.create(model=model, **asked)  # 12 asked, 8 the model's most
            defaulted = client.chat.completions.create(model=model, messages=asked["messages"])
        assert (capped.usage.completion_tokens, capped.choices[0].finish_reason) == (8, "length")
        assert (defaulted.usage.completion_tokens, defaulted.choices[0].finish_reason) == (8, "length")
        assert shown.max_new_tokens == 8 and stub.GetServedModel(gateway_pb2.GetServedModelRequest()) \
            .default_max_new_tokens == 8
        # gRPC: what a request names is its own; naming none, it gets the default the model lowered.
        assert len(stub.Generate(gateway_pb2.GenerateRequest(prompt="Say something.", max_new_tokens=12)).token_ids) == 12
        assert len(stub.Generate(gateway_pb2.GenerateRequest(prompt="Say something.")).token_ids) == 8
        # gRPC requests are as they are sent: the same prompt, sampled by its own fields.
        grpc_sampled = {stub.Generate(gateway_pb2.GenerateRequest(
            prompt="Say something.", max_new_tokens=12, sampling={"temperature": 1.0, "seed": seed})).text
            for seed in range(4)}
        assert len(grpc_sampled) > 1



def test_end_of_sequence_ids_the_model_cannot_generate_are_left_out():
    assert doctest.testmod(verifier_server).failed == 0  # none left stops the start
