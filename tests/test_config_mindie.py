"""MindIE config.json: the seed's two examples load, and every row of the rules table has a test.

Pure: no model, no servers (the model path is the bundled GGUF's, which only has to exist).
"""

from __future__ import annotations

import copy
import dataclasses
import doctest
import json
import logging
import os
import subprocess
import sys

import pytest

import pardec.gateway.config
from pardec.drafter.config import DrafterConfig
from pardec.gateway.clients import ModelInfo
from pardec.runtime.draft_params import DraftParams
from pardec.gateway.config import GatewayConfig, LoadPolicy
from pardec.gateway.chat import Message
from pardec.gateway.generation import Generator, Request
from pardec.gateway.mindie import load_mindie_config, parse_mindie_config
from pardec.gateway.rules import CONFIG, MODEL, REQUEST, RULES, Facts, broken_rule, check
from pardec.runtime.errors import ConfigError, InvalidArgument
from pardec.verifier.api import Sampling, ThinkingBudget
from pardec.verifier.structured_output import StructuredOutput
from pardec.gateway.stack import config_flags
from pardec.verifier.__main__ import config_from_args, parse_args
from pardec.verifier.config import VerifierConfig
from pardec.verifier.model.weights import default_model_path

MODEL_PATH = default_model_path()

# MindIE's parallel-decoding examples exactly as its documentation prints them (a fragment
# without outer braces), with modelWeightPath pointing at a real model.
MEMORY_DECODING_EXAMPLE = """
"ModelDeployConfig" :
{
    "maxSeqLen" : 2560,
    "maxInputTokenLen" : 2048,
    "truncation" : false,
    "speculationGamma": 16,
    "ModelConfig" : [
        {
            "plugin_params":"{\\"plugin_type\\":\\"memory_decoding\\",\\"decoding_length\\":16,\\"dynamic_algo\\":true}",
            "modelInstanceType" : "Standard",
            "modelName" : "llama3-70b",
            "modelWeightPath" : "/data/weights/llama3-70b",
            "worldSize" : 4,
            "cpuMemSize" : 5,
            "npuMemSize" : -1,
            "backendType" : "atb",
            "trustRemoteCode" : false
        }
    ]
}
""".replace("/data/weights/llama3-70b", MODEL_PATH)

LOOKAHEAD_EXAMPLE = """
"ModelDeployConfig" :
{
    "maxSeqLen" : 2560,
    "maxInputTokenLen" : 2048,
    "truncation" : false,
    "speculationGamma": 30,
    "ModelConfig" : [
        {
            "plugin_params":"{\\"plugin_type\\":\\"la\\",\\"level\\":4,\\"window\\":5,\\"guess_set_size\\":5}",
            "modelInstanceType" : "Standard",
            "modelName" : "Qwen2.5-7B-Instruct",
            "modelWeightPath" : "/data/weights/Qwen2.5-7B-Instruct",
            "worldSize" : 1,
            "cpuMemSize" : 5,
            "npuMemSize" : -1,
            "backendType" : "atb",
            "trustRemoteCode" : false
        }
    ]
}
""".replace("/data/weights/Qwen2.5-7B-Instruct", MODEL_PATH)


def full_file(fragment: str) -> dict:
    """The example inside a whole MindIE config.json, as a user's file holds it."""
    deploy = json.loads("{" + fragment + "}")["ModelDeployConfig"]
    return {
        "Version": "1.0.0",
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": 1025, "httpsEnabled": False, "inferMode": "standard"},
        "BackendConfig": {
            "backendName": "mindieservice_llm_engine", "modelInstanceNumber": 1, "npuDeviceIds": [[0, 1, 2, 3]],
            "multiNodesInferEnabled": False, "ModelDeployConfig": deploy,
            "ScheduleConfig": {"templateType": "Standard", "maxBatchSize": 200, "maxIterTimes": 512},
        },
    }


def test_memory_decoding_example_loads_as_printed_and_as_a_whole_file():
    for text in (MEMORY_DECODING_EXAMPLE, json.dumps(full_file(MEMORY_DECODING_EXAMPLE))):
        settings = parse_mindie_config(text, environ={})
        assert settings.draft == DraftParams("memory_decoding", decoding_length=16, dynamic_algo=True)
        assert (settings.max_seq_len, settings.max_input_tokens, settings.truncation) == (2560, 2048, False)
        assert settings.speculation_gamma == 16 and settings.model_path == MODEL_PATH
        assert (settings.model_name, settings.world_size, settings.npu_mem_size, settings.backend_type) == (
            "llama3-70b", 4, -1, "atb")
    assert parse_mindie_config(json.dumps(full_file(MEMORY_DECODING_EXAMPLE)), environ={}).max_iter_times == 512
    # The served name: modelName, or pardec up --served-model-name over it, checked by the same rule.
    assert settings.named("llama3-70b-w8a8").model_name == "llama3-70b-w8a8"
    with pytest.raises(ConfigError, match=r"^--served-model-name: .*modelName"):
        settings.named("two\nlines")
    with pytest.raises(ConfigError, match="served_model_name"):
        VerifierConfig(served_model_name=" padded")


def test_lookahead_example_loads_and_validates():
    settings = parse_mindie_config(LOOKAHEAD_EXAMPLE, environ={})
    assert settings.draft == DraftParams("la", level=4, window=5, guess_set_size=5)
    assert settings.draft.tokens_per_step == 30 == settings.speculation_gamma
    assert GatewayConfig("v:1", "d:1", **settings.gateway_overrides()).draft == settings.draft


def test_config_files_load_from_disk_and_the_verifier_gets_model_and_limits(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(full_file(MEMORY_DECODING_EXAMPLE)))
    settings = load_mindie_config(str(path), environ={})
    assert settings.verifier_overrides() == {"model_path": MODEL_PATH, "served_model_name": "llama3-70b",
                                             "max_seq_len": 2560, "max_input_tokens": 2048}
    # pardec up passes them as the verifier's flags, which set the same fields.
    config = config_from_args(parse_args(config_flags(settings)))
    assert {name: getattr(config, name) for name in settings.verifier_overrides()} == settings.verifier_overrides()
    assert settings.gateway_overrides()["max_iter_times"] == 512


def test_defaults_without_a_config_and_plain_decoding_without_plugin_params():
    assert load_mindie_config(None, environ={}).draft == DraftParams()
    assert DraftParams().decoding_length == 16 and (DraftParams().level, DraftParams().window,
                                                    DraftParams().guess_set_size) == (4, 5, 5)
    document = full_file(MEMORY_DECODING_EXAMPLE)
    del document["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["plugin_params"]
    # Without parallel decoding the feature exclusions do not bind.
    document["ServerConfig"]["inferMode"] = "dmi"
    assert parse_mindie_config(json.dumps(document), environ={}).draft is None


def test_unknown_keys_warn_and_mindie_keys_pardec_ignores_do_not(caplog):
    document = full_file(MEMORY_DECODING_EXAMPLE)
    document["BackendConfig"]["ModelDeployConfig"]["maxSeqLenn"] = 1
    document["BackendConfig"]["ScheduleConfig"]["prefillPolicyType"] = 0
    with caplog.at_level(logging.INFO, logger="pardec.gateway.mindie"):
        parse_mindie_config(json.dumps(document), environ={})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["ModelDeployConfig.maxSeqLenn is not a MindIE config key; ignored (a typo?)"]
    assert any("ScheduleConfig.prefillPolicyType" in r.getMessage() for r in caplog.records)


def _set(path: str, value):
    """A change to the whole-file memory_decoding example: path is dotted, [0] for the model."""

    def change(document):
        node = document
        *parents, last = path.split(".")
        for part in parents:
            node = node[0] if part == "[0]" else node.setdefault(part, {})
        node[last] = value

    return change


_B, _D, _S = "BackendConfig", "BackendConfig.ModelDeployConfig", "BackendConfig.ScheduleConfig"
_M = "BackendConfig.ModelDeployConfig.ModelConfig.[0]"


def _plugin(**params):
    return _set(f"{_M}.plugin_params", json.dumps(params))


# (a change that breaks exactly one row, the row's key, a fragment of its rule, environment)
CONFIG_CASES = [
    (_set(f"{_D}.ModelConfig", [{}, {}]), "ModelDeployConfig.ModelConfig", "exactly one model", {}),
    (_set(f"{_D}.maxSeqLen", "2560"), "ModelDeployConfig.maxSeqLen", "integer >= 2", {}),
    (_set(f"{_D}.maxInputTokenLen", 4096), "ModelDeployConfig.maxInputTokenLen", "below maxSeqLen", {}),
    (_set(f"{_D}.truncation", "no"), "ModelDeployConfig.truncation", "true or false", {}),
    (_set(f"{_M}.modelWeightPath", "/no/such/model"), "ModelDeployConfig.ModelConfig[0].modelWeightPath",
     "existing model", {}),
    (_set(f"{_M}.modelName", " llama3"), "ModelDeployConfig.ModelConfig[0].modelName", "printable characters", {}),
    (_set(f"{_M}.plugin_params", "{plugin_type: la"), "ModelDeployConfig.ModelConfig[0].plugin_params",
     "JSON object", {}),
    (_plugin(plugin_type="la,memory_decoding"), "plugin_params.plugin_type", "at the same time", {}),
    (_plugin(plugin_type="mtp", num_speculative_tokens=1), "plugin_params.plugin_type", "MTP", {}),
    (_plugin(plugin_type="splitfuse"), "plugin_params.plugin_type", "SplitFuse", {}),
    (_plugin(plugin_type="eagle"), "plugin_params.plugin_type", "memory_decoding or la", {}),
    (_plugin(plugin_type="memory_decoding", decoding_length=17), "plugin_params.decoding_length", "[1, 16]", {}),
    (_plugin(plugin_type="memory_decoding", decoding_length=0), "plugin_params.decoding_length", "[1, 16]", {}),
    (_plugin(plugin_type="memory_decoding", decoding_length="16"), "plugin_params.decoding_length", "[1, 16]", {}),
    (_plugin(plugin_type="memory_decoding", dynamic_algo="yes"), "plugin_params.dynamic_algo", "true or false", {}),
    (_plugin(plugin_type="la", level=2), "plugin_params.level", "[3, 16]", {}),
    (_plugin(plugin_type="la", level=17), "plugin_params.level", "[3, 16]", {}),
    (_plugin(plugin_type="la", window=17), "plugin_params.window", "[1, 16]", {}),
    (_plugin(plugin_type="la", guess_set_size=0), "plugin_params.guess_set_size", "[1, 16]", {}),
    (_set(f"{_D}.speculationGamma", -1), "ModelDeployConfig.speculationGamma", "uint32", {}),
    (_set(f"{_D}.speculationGamma", 15), "ModelDeployConfig.speculationGamma", ">= decoding_length", {}),
    (lambda d: (_plugin(plugin_type="la", level=4, window=5, guess_set_size=5)(d),
                _set(f"{_D}.speculationGamma", 29)(d)),
     "ModelDeployConfig.speculationGamma", "(level - 1) * (window + guess_set_size)", {}),
    (_set(f"{_S}.maxIterTimes", 0), "ScheduleConfig.maxIterTimes", "uint32 >= 1", {}),
    (_set(f"{_S}.maxIterTimes", 16), "ScheduleConfig.maxIterTimes", "expected output length", {}),
    (_set("ServerConfig.inferMode", "dmi"), "ServerConfig.inferMode", "prefill-decode disaggregation", {}),
    (_set(f"{_D}.LoraModules", [{"name": "a", "path": "/a", "baseModelName": "llama3-70b"}]),
     "ModelDeployConfig.LoraModules", "Multi-LoRA", {}),
    (_set(f"{_S}.templateType", "Mix"), "ScheduleConfig.templateType", "SplitFuse", {}),
    (_set(f"{_S}.enableSplit", True), "ScheduleConfig.enableSplit", "SplitFuse", {}),
    (_set(f"{_D}.maxSeqLen", 65536), "ModelDeployConfig.maxSeqLen", "long sequence", {}),
    (lambda d: None, "MINDIE_ASYNC_SCHEDULING_ENABLE", "asynchronous scheduling",
     {"MINDIE_ASYNC_SCHEDULING_ENABLE": "1"}),
    (_set(f"{_B}.multiNodesInferEnabled", True), "BackendConfig.multiNodesInferEnabled", "multi-server", {}),
]


@pytest.mark.parametrize("change, key, rule, environ", CONFIG_CASES, ids=[f"{c[1]}:{c[2]}" for c in CONFIG_CASES])
def test_each_config_rule_stops_startup_with_one_message_naming_key_value_and_rule(change, key, rule, environ):
    document = copy.deepcopy(full_file(MEMORY_DECODING_EXAMPLE))
    change(document)
    with pytest.raises(ConfigError) as caught:
        parse_mindie_config(json.dumps(document), environ=environ)
    message = str(caught.value)
    assert key in message and rule in message, message
    assert message.count("\n") == 0
    key_part = message.split(":", 1)[0]
    assert " = " in key_part  # "<key> = <value>: <rule> [<source>]"


MODEL_CASES = [
    ({"architecture": "llama", "quantization": "none"}, "quantization", "W8A8"),
    ({"architecture": "mistral", "quantization": "w8a8"}, "architecture", "Llama3, Qwen2, Qwen2.5 and Qwen3"),
]


@pytest.mark.parametrize("facts, key, rule", MODEL_CASES, ids=[c[1] for c in MODEL_CASES])
def test_each_model_rule_is_checked_against_the_verifiers_model(facts, key, rule):
    with pytest.raises(ConfigError, match=rule) as caught:
        check(MODEL, Facts(**facts))
    assert str(caught.value).startswith(f"{key} = ")
    model = ModelInfo("m", facts["quantization"], None, 2560, frozenset(), facts["architecture"])
    with pytest.raises(ConfigError, match=rule):  # the gateway refuses to start on such a verifier
        Generator(GatewayConfig("v:1", "d:1"), None, None, model)
    Generator(GatewayConfig("v:1", "d:1", draft=None), None, None, model)  # plain decoding only: fine


def test_sparse_w8a8_and_every_family_pass():
    for quantization in ("w8a8", "W8A8", "w8a8s", "w8a8sc"):
        for architecture in ("llama", "qwen2", "qwen3"):
            check(MODEL, Facts(architecture=architecture, quantization=quantization))


REQUEST_CASES = [
    ({"n": 2}, {}, "n", "one sequence"),
    ({"n": 17}, {"plugin_params": None}, "n", "at most 16 sequences"),
    ({"best_of": 2}, {}, "best_of", "multi-sequence"),
    ({"use_beam_search": True}, {}, "use_beam_search", "beam search"),
    *(({"use_beam_search": True, **fields}, {"plugin_params": None}, key, rule) for fields, key, rule in (
        ({"stop": ("x",)}, "stop", "stop strings are not"), ({"length_penalty": 1e999}, "length_penalty", "finite"),
        *(({k: v}, k, "not be set with use_beam") for k, v in (("logprobs", 1), ("prompt_logprobs", 0), ("bad_words", "x"))),
        *(({"sampling": Sampling(**{k: v})}, f"sampling.{k}", "not be set with use_beam") for k, v in (
            ("repetition_penalty", 1.1), ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("min_tokens", 1),
            ("logit_bias", ((5, 1.0),)), ("allowed_token_ids", (5,)), ("thinking_budget", ThinkingBudget(4)),
            ("structured_output", StructuredOutput("json_object")), ("bad_words", ((5,),)))))),
    ({"logprobs": True}, {}, "logprobs", "log-probabilities are not"),
    ({"top_logprobs": 3}, {}, "top_logprobs", "must be 0"),
    ({"logprobs": True, "top_logprobs": 21}, {"plugin_params": None}, "top_logprobs", r"must be in \[0, 20\]"),
    ({"top_logprobs": 2}, {"plugin_params": None}, "top_logprobs", "0 unless logprobs is set"),
    ({"prompt_logprobs": 0}, {}, "prompt_logprobs", "log-probabilities are not"),
    ({"sampling": Sampling(min_tokens=9)}, {}, "sampling.min_tokens", "must not exceed max_new_tokens"),
    ({"prompt_logprobs": 21}, {"plugin_params": None}, "prompt_logprobs", "0, 20]"),
    ({"sampling": Sampling(presence_penalty=0.5)}, {}, "sampling.presence_penalty", "must be 0 with parallel"),
    ({"sampling": Sampling(frequency_penalty=0.5)}, {}, "sampling.frequency_penalty", "must be 0 with parallel"),
    ({"stop": ("",)}, {}, "stop", "must not be empty"),
    ({"stop": ("x",) * 17}, {}, "stop", "at most 16 stop strings"),
    ({"stop": ("x" * 1001,)}, {}, "stop", "of at most 1000 characters"),
    ({"stop_token_ids": tuple(range(17))}, {}, "stop_token_ids", "at most 16 stop token ids"),
    ({"prompt": "x" * (4 * 1024 * 1024 + 1)}, {}, "prompt", "cap on message content"),
    ({"prompt": "", "messages": (Message("user", "x" * (4 * 1024 * 1024 + 1)),)}, {}, "messages",
     "characters of content in all"),
    ({"session_id": "a{b}"}, {}, "session_id", "without"),
    ({}, {"max_iter_times": 64, "max_new_tokens": 65}, "max_new_tokens", "most tokens one request"),
    ({}, {"max_iter_times": 64, "max_new_tokens": 49, "speculation_gamma": 16,
          "plugin_params": {"plugin_type": "memory_decoding", "dynamic_algo": True}},
     "max_new_tokens", "with dynamic_algo"),
]


@pytest.mark.parametrize("fields, facts, key, rule", REQUEST_CASES, ids=[f"{c[2]}:{c[3]}" for c in REQUEST_CASES])
def test_each_request_rule_gives_invalid_argument_naming_the_field(fields, facts, key, rule):
    with pytest.raises(InvalidArgument, match=rule) as caught:
        check(REQUEST, Facts(request=Request(**{"prompt": "hi", **fields}), **{"max_new_tokens": 8, **facts}))
    assert str(caught.value).startswith(f"{key} = ")


def test_plain_decoding_may_return_log_probabilities():
    """MindIE refuses logprobs with parallel decoding only: a plain request (or a server without
    parallel decoding) gets them."""
    check(REQUEST, Facts(request=Request("hi", logprobs=True, top_logprobs=20), plugin_params=None, max_new_tokens=8))
    penalised = Request("hi", sampling=Sampling(presence_penalty=0.5, frequency_penalty=-1.0))
    check(REQUEST, Facts(request=penalised, plugin_params=None, max_new_tokens=8))  # plain decoding applies them


def test_dynamic_algo_bound_is_exactly_max_iter_times_minus_gamma():
    plugin = {"plugin_type": "memory_decoding", "dynamic_algo": True}
    facts = Facts(request=Request("hi"), max_iter_times=64, speculation_gamma=16, plugin_params=plugin)
    check(REQUEST, dataclasses.replace(facts, max_new_tokens=48))
    # Without dynamic_algo, or for a plain request, only maxIterTimes itself caps the output.
    check(REQUEST, dataclasses.replace(facts, plugin_params=None, max_new_tokens=64))


def test_every_row_of_the_rules_table_has_a_test_case():
    cases = [(k, r) for _, k, r, _ in CONFIG_CASES] + [(k, r) for _, k, r in MODEL_CASES] + [
        (k, r) for _, _, k, r in REQUEST_CASES]
    untested = [
        row for row in RULES
        if not any((row.key == k or row.key.endswith("." + k)) and r in row.rule for k, r in cases)
    ]
    assert untested == [], [f"{row.stage} {row.key}: {row.rule}" for row in untested]


def test_configs_built_in_code_obey_the_same_table():
    with pytest.raises(ConfigError, match=r"decoding_length = 0: must be an integer in \[1, 16\]"):
        DraftParams(decoding_length=0)
    with pytest.raises(ConfigError, match="plugin_type"):
        DraftParams(plugin_type="mtp")
    with pytest.raises(ConfigError, match="speculationGamma = 8"):
        GatewayConfig("v:1", "d:1", speculation_gamma=8)
    with pytest.raises(ConfigError, match="maxIterTimes = 16"):
        GatewayConfig("v:1", "d:1", draft=DraftParams(dynamic_algo=True), max_iter_times=16)
    assert broken_rule(CONFIG, Facts()) is None


def test_load_policy_hard_switch_and_validation():
    assert [LoadPolicy().drafts_at(n) for n in (15, 16)] == [True, False]  # default: plain from 16
    assert LoadPolicy(plain_from=0).drafts_at(1000)  # off: the cost model and the governor decide
    policy = LoadPolicy(plain_from=6)
    assert [policy.drafts_at(n) for n in (1, 5, 6, 7)] == [True, True, False, False]
    for field, value in (("plain_from", -1), ("min_gain", 0.9), ("calibration_decay", 1.0), ("probe_every", 0),
                         ("govern_from", -1), ("epoch_rounds", 0), ("explore_every", 1),
                         ("epoch_min_s", -0.1)):
        with pytest.raises(ConfigError, match=field):
            LoadPolicy(**{field: value})


def test_a_request_opens_its_drafter_session_as_it_is_admitted_only_alone_or_feeding_a_memory():
    """With others in flight the start waits for a step that may draft (DraftSession.start)."""
    assert [LoadPolicy().starts_at_admission(n) for n in (1, 2, 4, 15, 16)] == [True, False, False, False, False]
    assert not LoadPolicy(plain_from=1).starts_at_admission(1)  # every step plain: never at once
    assert LoadPolicy(plain_from=0).starts_at_admission(1)
    # A conversation's or the shared memory's request: its EndSession hands the output over.
    assert [LoadPolicy().starts_at_admission(n, feeds_memory=True) for n in (1, 2, 15, 16)] == [True, True, True, False]
    assert doctest.testmod(pardec.gateway.config).failed == 0


@pytest.mark.parametrize("command", [["-m", "pardec.gateway"], ["-m", "pardec.gateway.cli", "up"]])
def test_a_broken_config_stops_startup_with_one_line(tmp_path, command):
    document = full_file(MEMORY_DECODING_EXAMPLE)
    document["BackendConfig"]["ModelDeployConfig"]["speculationGamma"] = 8
    path = tmp_path / "config.json"
    path.write_text(json.dumps(document))
    result = subprocess.run(
        [sys.executable, *command, "--config", str(path), "--log-level", "ERROR"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "ModelDeployConfig.speculationGamma = 8" in lines[0] and ">= decoding_length (16)" in lines[0]


def test_the_gateway_drafts_through_replicas_or_in_its_process_not_both():
    embedded = DrafterConfig(redis_url="unix:///tmp/redis.sock")
    assert GatewayConfig("v:1", embedded_drafter=embedded).embedded_drafter == embedded
    for drafting in ({}, {"drafter_target": "d:1", "embedded_drafter": embedded}):
        with pytest.raises(ConfigError, match="drafter_target and embedded_drafter: set exactly one"):
            GatewayConfig("v:1", **drafting)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--redis-url", "unix:///tmp/redis.sock"], "--redis-url: only with --drafter embedded"),
        (["--drafter", "embedded"], "redis_url: must be set"),
    ],
)
def test_gateway_drafting_flags_that_do_not_fit_stop_startup_with_one_line(flags, message):
    environ = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    result = subprocess.run(
        [sys.executable, "-m", "pardec.gateway", *flags, "--log-level", "ERROR"], capture_output=True, text=True,
        timeout=120, env=environ,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
