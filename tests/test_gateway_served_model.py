"""The gateway's GetServedModel, what `pardec info` prints: the model, its limits and the
configured parallel decoding, through the real stack on loopback (auth: test_security.py), and
the protobuf-free core that computes it for every configuration."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from pardec.gateway.clients import ModelInfo
from pardec.gateway.config import DraftParams, GatewayConfig
from pardec.gateway.served import ParallelDecoding, ServedModel, served_model
from pardec.gateway.service import served_model_to_proto
from pardec.v1 import gateway_pb2, verifier_pb2

BUNDLED = "Smollm2 135M 8k Lc100K Mix1 Ep2"  # the bundled GGUF's general.name
PARDEC = [sys.executable, "-m", "pardec.gateway.cli"]


def test_the_gateway_says_what_it_serves(stack):
    served = stack.gateway.GetServedModel(gateway_pb2.GetServedModelRequest(), timeout=60)
    verifier = stack.verifier.GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=60)
    assert (served.model, served.architecture, served.quantization) == (BUNDLED, "llama", "w8a8")
    assert (served.max_seq_len, served.vocab_size, served.device) == (
        verifier.max_seq_len, verifier.vocab_size, verifier.device
    )
    assert served.vocab_size == 49152 and served.device  # SmolLM2's vocabulary; "cpu" or the test's --device
    assert (served.max_input_tokens, served.truncation, served.chat_template) == (2048, False, True)
    assert (served.default_max_new_tokens, served.max_new_tokens_limit) == (256, verifier.max_seq_len)
    assert served.verifier_replicas == 1
    assert served.prefix_block_tokens == verifier.prefix_block_tokens > 0  # the stack caches prefixes
    assert served.tool_call_layout == "hermes"  # SmolLM2's template has no place for tools: taught the tags
    assert (served.attention, served.kv_cache_dtype) == (verifier.attention, verifier.kv_cache_dtype)
    assert served.kv_cache_dtype in ("float32", "bfloat16") and served.attention  # bf16 in the device engine
    assert (served.embedding_dtype, served.embedding_rounded) == (verifier.embedding_dtype, verifier.embedding_rounded)
    assert (served.embedding_dtype, served.embedding_rounded) == ("float32", False)  # a prepared, rotated table
    assert served.decoding == gateway_pb2.ParallelDecoding(
        method="memory_decoding", decoding_length=16, speculation_gamma=16
    )
    # The name is the one every Generate reply carries.
    reply = stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=2), timeout=120)
    assert reply.model == served.model


def test_pardec_info_prints_it(stack):
    address = stack.addresses["gateway"]
    result = subprocess.run([*PARDEC, "info", "--addr", address], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines())
    assert lines["model"].strip() == BUNDLED and lines["architecture"].strip() == "llama"
    assert lines["quantization"].strip() == "w8a8"
    assert lines["decoding"].strip().startswith("memory_decoding (decoding_length 16, dynamic_algo off")
    assert "2048" in lines["context"] and "default 256" in lines["max_new_tokens"]
    assert lines["prefix caching"].strip().startswith("on, blocks of ")
    assert lines["tool calls"].strip() == "hermes layout"
    assert lines["embedding"].strip() == "float32"
    result = subprocess.run([*PARDEC, "info", "--addr", address, "--json"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["model"] == BUNDLED and reply["vocab_size"] == 49152
    # Every field is printed, those at their zero value included.
    assert reply["decoding"]["level"] == 0 and reply["truncation"] is False


# ---------------------------------------------------------------- the core, per configuration

MODEL = ModelInfo("m", "w8a8", None, 2560, frozenset(), "qwen2", vocab_size=1000, device="cuda:0",
                  verifier_replicas=3, prefix_block_tokens=16, generation_defaults=(("temperature", 0.5), ("top_k", 20)),
                  attention="triton", kv_cache_dtype="bfloat16")


def served(**config) -> ServedModel:
    return served_model(GatewayConfig(verifier_target="v:1", drafter_target="d:1", **config), MODEL)


def test_plain_serving_reports_no_drafting_parameters():
    info = served(draft=None, max_input_tokens=1000, truncation=True, default_max_new_tokens=64)
    assert info.decoding == ParallelDecoding(method="plain")
    assert (info.max_input_tokens, info.truncation, info.default_max_new_tokens) == (1000, True, 64)
    assert (info.max_seq_len, info.max_new_tokens_limit, info.vocab_size) == (2560, 2560, 1000)
    assert (info.model, info.architecture, info.device, info.verifier_replicas) == ("m", "qwen2", "cuda:0", 3)
    assert info.prefix_block_tokens == 16
    assert (info.attention, info.kv_cache_dtype) == ("triton", "bfloat16")
    assert info.chat_template is False  # no tokenizer here


def test_lookahead_reports_its_own_parameters_only():
    info = served(draft=DraftParams(plugin_type="la", level=5, window=3, guess_set_size=2), shared_memory=True)
    assert info.decoding == ParallelDecoding(
        method="la", level=5, window=3, guess_set_size=2, speculation_gamma=(5 - 1) * (3 + 2), shared_memory=True
    )


def test_max_iter_times_bounds_max_new_tokens_as_requests_are_checked():
    info = served(draft=DraftParams(dynamic_algo=True), speculation_gamma=20, max_iter_times=100,
                  default_max_new_tokens=256)
    assert info.decoding == ParallelDecoding(
        method="memory_decoding", decoding_length=16, dynamic_algo=True, speculation_gamma=20
    )
    # With dynamic_algo, max_new_tokens + speculationGamma <= maxIterTimes (MindIE Table 4).
    assert (info.max_new_tokens_limit, info.default_max_new_tokens) == (80, 80)
    assert served(max_iter_times=100).max_new_tokens_limit == 100


def test_the_proto_carries_every_field_of_the_core():
    info = served(draft=DraftParams(plugin_type="la", level=5, window=3, guess_set_size=2), shared_memory=True)
    message = served_model_to_proto(info)
    assert [f.name for f in gateway_pb2.ServedModel.DESCRIPTOR.fields] == [
        f.name for f in dataclasses.fields(ServedModel)
    ]
    assert [f.name for f in gateway_pb2.ParallelDecoding.DESCRIPTOR.fields] == [
        f.name for f in dataclasses.fields(ParallelDecoding)
    ]
    for field in dataclasses.fields(ServedModel):
        if field.name == "generation_defaults":
            named = {f.name: value for f, value in message.generation_defaults.ListFields()}
            assert named == dict(info.generation_defaults) == {"temperature": 0.5, "top_k": 20}
        elif field.name != "decoding":
            assert getattr(message, field.name) == getattr(info, field.name), field.name
    for field in dataclasses.fields(ParallelDecoding):
        assert getattr(message.decoding, field.name) == getattr(info.decoding, field.name), field.name
