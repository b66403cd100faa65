"""MindIE's parallel-decoding rules as one table of data.

Every rule of MindIE's parallel-decoding documentation (Tables 2-6 and "Constraints") is one
``Rule`` row, plus the few limits pardec adds. A row is checked at the stage where its facts are
known: ``config`` when config.json is read, ``model`` when the gateway has the verifier's
ModelInfo, ``request`` for each request. The first broken row gives one message naming the key,
the value and the rule; at ``config``/``model`` stage it stops startup (ConfigError), at
``request`` stage the client gets INVALID_ARGUMENT.

Constraints deliberately not rows: the hardware list (Atlas 800I A2 / 300I Duo; pardec runs on
CPU, CUDA or NPU), and "streaming is not supported" (pardec streams: GenerateStream).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from pardec.runtime.draft_params import (
    BY_NAME, DEFAULTS, LOOKAHEAD, MINDIE_PLUGIN_PARAMS, PARAMS, PLUGIN_TYPES, lookahead_nodes, show,
)
from pardec.gateway.chat import input_chars
from pardec.runtime.architectures import ARCHITECTURES
from pardec.runtime.errors import ConfigError, InvalidArgument
from pardec.verifier.api import MAX_LOGPROBS, MAX_MODEL_NAME, valid_model_name

CONFIG, MODEL, REQUEST = "config", "model", "request"

# MindIE's "long sequence" feature is defined as sequences over 32K tokens.
LONG_SEQUENCE_TOKENS = 32 * 1024
# "W8A8 quantization and sparse quantization": MindIE's quantize names w8a8, w8a8s, w8a8sc.
W8A8_QUANTIZATIONS = ("w8a8", "w8a8s", "w8a8sc")
# What a config without plugin_params means when no config file is given at all.
DEFAULT_PLUGIN_PARAMS = '{"plugin_type": "memory_decoding"}'

_UNPARSABLE = "<not a JSON object>"


@dataclass(frozen=True)
class Facts:
    """Everything a rule may look at, named after MindIE's keys; raw values, checked by rows."""

    # ModelConfig[0].plugin_params: a JSON string (MindIE), a dict, or None (no parallel decoding).
    plugin_params: Any = DEFAULT_PLUGIN_PARAMS
    # ModelDeployConfig
    speculation_gamma: Any = None  # None: derived from plugin_params (MindIE's recommended value)
    max_seq_len: Any = 2560
    max_input_tokens: Any = 2048
    truncation: Any = False
    model_count: int = 1
    model_path: str | None = None
    model_name: Any = None  # ModelConfig[0].modelName: the served name (None: the checkpoint's)
    lora_modules: Any = None
    # ScheduleConfig
    max_iter_times: Any = None  # None: no cap beyond maxSeqLen
    template_type: Any = "Standard"
    enable_split: Any = False
    # BackendConfig / ServerConfig
    multi_nodes_infer: Any = False
    infer_mode: Any = "standard"
    # Environment: MindIE switches asynchronous scheduling on with MINDIE_ASYNC_SCHEDULING_ENABLE=1.
    async_scheduling: Any = None
    # The verifier's ModelInfo (model stage).
    architecture: str | None = None
    quantization: str | None = None
    # The request (request stage): any object with GenerateRequest's field names, and the
    # resolved max_new_tokens.
    request: Any = None
    max_new_tokens: int = 0

    @cached_property
    def plugin(self) -> dict | str | None:
        """plugin_params parsed; None when absent or empty, _UNPARSABLE when not a JSON object."""
        raw = self.plugin_params
        if raw is None or raw == "":
            return None
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError:
                return _UNPARSABLE
        return dict(raw) if isinstance(raw, dict) else _UNPARSABLE

    @property
    def plugin_types(self) -> tuple[str, ...]:
        """plugin_type split on commas (MindIE combines plugins that way); () = plain decoding."""
        plugin = self.plugin
        if not isinstance(plugin, dict):
            return ()
        value = plugin.get("plugin_type", "")
        if not isinstance(value, str):
            return (repr(value),)
        return tuple(part.strip() for part in value.split(",") if part.strip())

    @property
    def parallel(self) -> bool:
        return bool(self.plugin_types)

    @property
    def lookahead(self) -> bool:
        return LOOKAHEAD in self.plugin_types

    def param(self, name: str) -> Any:
        plugin = self.plugin if isinstance(self.plugin, dict) else {}
        return plugin.get(BY_NAME[name].mindie_key, DEFAULTS[name])

    @property
    def tokens_per_step(self) -> int:
        """Draft tokens one step may carry, MindIE's lower bound for speculationGamma."""
        if self.lookahead:
            return lookahead_nodes(self.param("level"), self.param("window"), self.param("guess_set_size"))
        return self.param("decoding_length")

    @property
    def gamma(self) -> int:
        return self.tokens_per_step if self.speculation_gamma is None else self.speculation_gamma


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_SEQUENCES = 16  # OpenAI's n: each sequence is a session of its own


def bounded_sequences(n: int) -> int:
    """``n``, refused past MAX_SEQUENCES in its rule's words before any sequence (a session, a
    stream's writer) exists: a fuzzed n of 2**32 - 1 once filled the memory."""
    if n > MAX_SEQUENCES:
        raise InvalidArgument(f"n = {n}: at most {MAX_SEQUENCES} sequences a request")
    return n

@dataclass(frozen=True)
class Rule:
    stage: str
    key: str  # as the user writes it: a config.json path, a request field, an environment variable
    value: Callable[[Facts], Any]
    holds: Callable[[Facts], bool]
    rule: str  # str.format()ted with f=the facts
    source: str  # where the rule comes from


def _int_in(value: Any, low: int, high: float = float("inf")) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _uint32(value: Any) -> bool:
    return value is None or _int_in(value, 0, 2**32 - 1)


def _true(value: Any) -> bool:
    # MindIE writes booleans as JSON true/false; a string "true" is read the same, to be safe.
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def _param_row(name: str) -> Rule:
    """A plugin_params parameter's row, from its row in the parameter table
    (runtime/draft_params.py): an integer is only checked while its algorithm is on."""
    param = BY_NAME[name]
    return Rule(CONFIG, f"{_PP}.{param.mindie_key}", lambda f: f.param(name),
                lambda f: param.accepts(f.param(name), f.plugin_types), param.rule, param.source)


def _off_or(check: Callable[[Facts], bool]) -> Callable[[Facts], bool]:
    """Feature exclusions bind only when parallel decoding is on."""
    return lambda f: not f.parallel or check(f)


_PP = MINDIE_PLUGIN_PARAMS
_CON = "MindIE Constraints"
# What beam search cannot honour (gateway/beam_search.py): its beams are ranked by the model's raw
# log-probabilities, a token a round; each of these is refused with it (its unset value passes).
_NOT_WITH_BEAMS = "must not be set with use_beam_search, whose beams are ranked by the model's raw log-probabilities"
_BEAM_CONFLICTS: tuple[tuple[str, Callable[[Any], Any], Any], ...] = (  # (key, its value, its value when unset)
    ("stop", lambda r: r.stop, ()),
    ("logprobs", lambda r: r.logprobs, False),
    ("prompt_logprobs", lambda r: r.prompt_logprobs, None),
    ("sampling.repetition_penalty", lambda r: r.sampling.repetition_penalty, 1.0),
    ("sampling.presence_penalty", lambda r: r.sampling.presence_penalty, 0.0),
    ("sampling.frequency_penalty", lambda r: r.sampling.frequency_penalty, 0.0),
    ("sampling.logit_bias", lambda r: r.sampling.logit_bias, ()),
    ("sampling.allowed_token_ids", lambda r: r.sampling.allowed_token_ids, ()),
    ("sampling.min_tokens", lambda r: r.sampling.min_tokens, 0),
    ("sampling.structured_output", lambda r: r.sampling.structured_output and r.sampling.structured_output.kind, None),
    ("sampling.thinking_budget", lambda r: r.sampling.thinking_budget and r.sampling.thinking_budget.tokens, None),
    ("bad_words", lambda r: r.bad_words, ()),
    ("sampling.bad_words", lambda r: r.sampling.bad_words, ()),
)

RULES: tuple[Rule, ...] = (
    # --- config.json structure (pardec's own limits) ---
    Rule(CONFIG, "ModelDeployConfig.ModelConfig", lambda f: f.model_count, lambda f: f.model_count == 1,
         "must list exactly one model (one verifier serves one model)", "pardec"),
    Rule(CONFIG, "ModelDeployConfig.maxSeqLen", lambda f: f.max_seq_len, lambda f: _int_in(f.max_seq_len, 2),
         "must be an integer >= 2", "MindIE ModelDeployConfig"),
    Rule(CONFIG, "ModelDeployConfig.maxInputTokenLen", lambda f: f.max_input_tokens,
         lambda f: _int_in(f.max_input_tokens, 1) and f.max_input_tokens < f.max_seq_len,
         "must be an integer >= 1 and below maxSeqLen ({f.max_seq_len})", "MindIE ModelDeployConfig"),
    Rule(CONFIG, "ModelDeployConfig.truncation", lambda f: f.truncation, lambda f: isinstance(f.truncation, bool),
         "must be true or false", "MindIE ModelDeployConfig"),
    Rule(CONFIG, "ModelDeployConfig.ModelConfig[0].modelName", lambda f: f.model_name,
         lambda f: f.model_name is None or valid_model_name(f.model_name),
         f"must be a name of 1 to {MAX_MODEL_NAME} printable characters, without leading or trailing spaces "
         "(the model's name in replies and the OpenAI API's model)", "MindIE ModelConfig"),
    Rule(CONFIG, "ModelDeployConfig.ModelConfig[0].modelWeightPath", lambda f: f.model_path,
         lambda f: f.model_path is None or os.path.exists(f.model_path),
         "must name an existing model directory or GGUF file", "pardec"),
    # --- plugin_params (Tables 2 and 5) ---
    Rule(CONFIG, _PP, lambda f: f.plugin_params, lambda f: f.plugin != _UNPARSABLE,
         "must be a string holding a JSON object, or absent for no parallel decoding", "MindIE Tables 2 and 5"),
    Rule(CONFIG, f"{_PP}.plugin_type", lambda f: ",".join(f.plugin_types),
         lambda f: not {"la", "memory_decoding"} <= set(f.plugin_types),
         "lookahead (la) and memory_decoding cannot be enabled at the same time", _CON),
    # MTP is itself a plugin in MindIE: plugin_params {"plugin_type": "mtp", "num_speculative_tokens": 1}.
    Rule(CONFIG, f"{_PP}.plugin_type", lambda f: ",".join(f.plugin_types),
         _off_or(lambda f: "mtp" not in f.plugin_types),
         "parallel decoding cannot be combined with MTP (plugin_type mtp)", _CON),
    # SplitFuse is switched on by plugin_type splitfuse plus ScheduleConfig (rows below).
    Rule(CONFIG, f"{_PP}.plugin_type", lambda f: ",".join(f.plugin_types),
         _off_or(lambda f: "splitfuse" not in f.plugin_types),
         "parallel decoding cannot be combined with SplitFuse (plugin_type splitfuse)", _CON),
    Rule(CONFIG, f"{_PP}.plugin_type", lambda f: ",".join(f.plugin_types),
         lambda f: not f.plugin or (len(f.plugin_types) == 1 and f.plugin_types[0] in PLUGIN_TYPES),
         f"must be {' or '.join(PLUGIN_TYPES)}", "MindIE Tables 2 and 5"),
    # One row per parameter of the table in runtime/draft_params.py.
    *(_param_row(param.name) for param in PARAMS),
    # --- speculationGamma and maxIterTimes (Tables 3, 4, 6) ---
    Rule(CONFIG, "ModelDeployConfig.speculationGamma", lambda f: f.speculation_gamma,
         lambda f: _uint32(f.speculation_gamma), "must be a uint32", "MindIE Tables 3 and 6"),
    Rule(CONFIG, "ModelDeployConfig.speculationGamma", lambda f: f.speculation_gamma,
         lambda f: "memory_decoding" not in f.plugin_types or f.speculation_gamma is None
         or f.speculation_gamma >= f.param("decoding_length"),
         "must be >= decoding_length ({f.tokens_per_step}) with memory_decoding", "MindIE Table 3"),
    Rule(CONFIG, "ModelDeployConfig.speculationGamma", lambda f: f.speculation_gamma,
         lambda f: not f.lookahead or f.speculation_gamma is None or f.speculation_gamma >= f.tokens_per_step,
         "must be >= (level - 1) * (window + guess_set_size) = {f.tokens_per_step} with la", "MindIE Table 6"),
    Rule(CONFIG, "ScheduleConfig.maxIterTimes", lambda f: f.max_iter_times,
         lambda f: f.max_iter_times is None or _int_in(f.max_iter_times, 1, 2**32 - 1), "must be a uint32 >= 1",
         "MindIE ScheduleConfig"),
    Rule(CONFIG, "ScheduleConfig.maxIterTimes", lambda f: f.max_iter_times,
         lambda f: f.max_iter_times is None or f.param("dynamic_algo") is not True
         or f.max_iter_times >= f.gamma + 1,
         "with dynamic_algo must be >= expected output length + speculationGamma ({f.gamma}), "
         "so at least {f.gamma} + 1", "MindIE Table 4"),
    # --- features parallel decoding cannot be combined with (Constraints) ---
    # Prefill-decode disaggregation: ServerConfig.inferMode "dmi" (MindIE's PD docs; "standard" =
    # mixed deployment). The PD deployment tooling sets it from MINDIE_INFER_MODE.
    Rule(CONFIG, "ServerConfig.inferMode", lambda f: f.infer_mode,
         _off_or(lambda f: str(f.infer_mode).lower() != "dmi"),
         "parallel decoding cannot be combined with prefill-decode disaggregation (inferMode dmi)", _CON),
    # Multi-LoRA: a LoraModules list in config.json (MindIE Service's Multi LoRA docs; it replaced
    # the sunset lora_adapter.json).
    Rule(CONFIG, "ModelDeployConfig.LoraModules", lambda f: f.lora_modules, _off_or(lambda f: not f.lora_modules),
         "parallel decoding cannot be combined with Multi-LoRA (LoraModules must be absent or empty)", _CON),
    # SplitFuse: ScheduleConfig.templateType "Mix" with enableSplit true (MindIE's SplitFuse docs).
    Rule(CONFIG, "ScheduleConfig.templateType", lambda f: f.template_type,
         _off_or(lambda f: str(f.template_type).lower() != "mix"),
         "parallel decoding cannot be combined with SplitFuse (templateType Mix)", _CON),
    Rule(CONFIG, "ScheduleConfig.enableSplit", lambda f: f.enable_split, _off_or(lambda f: not _true(f.enable_split)),
         "parallel decoding cannot be combined with SplitFuse (enableSplit true)", _CON),
    # Long sequence has no switch in config.json: MindIE defines it as sequences over 32K tokens
    # (enabled through rope_scaling in the model's own config.json), so maxSeqLen decides.
    Rule(CONFIG, "ModelDeployConfig.maxSeqLen", lambda f: f.max_seq_len,
         _off_or(lambda f: not _int_in(f.max_seq_len, LONG_SEQUENCE_TOKENS + 1)),
         f"parallel decoding cannot be combined with long sequence (over {LONG_SEQUENCE_TOKENS} tokens)", _CON),
    # Asynchronous scheduling is switched on by the environment variable, not config.json
    # (ModelConfig.async_scheduler_wait_time only tunes it once on).
    Rule(CONFIG, "MINDIE_ASYNC_SCHEDULING_ENABLE", lambda f: f.async_scheduling,
         _off_or(lambda f: str(f.async_scheduling or "0").strip().lower() in ("0", "false", "")),
         "parallel decoding cannot be combined with asynchronous scheduling (environment variable set)", _CON),
    # Multi-server (multi-node) inference: BackendConfig.multiNodesInferEnabled.
    Rule(CONFIG, "BackendConfig.multiNodesInferEnabled", lambda f: f.multi_nodes_infer,
         _off_or(lambda f: not _true(f.multi_nodes_infer)),
         "parallel decoding cannot be combined with multi-server inference", _CON),
    # --- the served model (Constraints), from the verifier's ModelInfo ---
    Rule(MODEL, "quantization", lambda f: f.quantization,
         _off_or(lambda f: str(f.quantization).lower() in W8A8_QUANTIZATIONS),
         f"parallel decoding supports only W8A8 or sparse W8A8 quantization {W8A8_QUANTIZATIONS}", _CON),
    Rule(MODEL, "architecture", lambda f: f.architecture,
         _off_or(lambda f: str(f.architecture).lower() in ARCHITECTURES),
         f"parallel decoding supports only Llama3, Qwen2, Qwen2.5 and Qwen3 models {ARCHITECTURES}", _CON),
    # --- requests (Constraints; MindIE's maxIterTimes) ---
    Rule(REQUEST, "n", lambda f: f.request.n, _off_or(lambda f: f.request.n <= 1),
         "must be 0 or 1 with parallel decoding: it returns one sequence (plain decoding returns n)", _CON),
    Rule(REQUEST, "n", lambda f: f.request.n, lambda f: f.request.n <= MAX_SEQUENCES,
         f"at most {MAX_SEQUENCES} sequences a request", "pardec"),
    Rule(REQUEST, "best_of", lambda f: f.request.best_of, lambda f: f.request.best_of <= 1,
         "must be 0 or 1: multi-sequence inference is not supported", _CON),
    Rule(REQUEST, "use_beam_search", lambda f: f.request.use_beam_search, _off_or(lambda f: not f.request.use_beam_search),
         "beam search is not supported with parallel decoding (plain decoding runs it)", _CON),
    *(Rule(REQUEST, key, lambda f, read=read: read(f.request),
           lambda f, read=read, unset=unset: not f.request.use_beam_search or read(f.request) == unset,
           "stop strings are not supported with use_beam_search (stop_token_ids are)" if key == "stop"
           else _NOT_WITH_BEAMS, "pardec") for key, read, unset in _BEAM_CONFLICTS),
    Rule(REQUEST, "length_penalty", lambda f: f.request.length_penalty, lambda f: math.isfinite(f.request.length_penalty),
         "must be a finite number", "vLLM"),
    # Plain decoding returns them: the request's decoding PLAIN, or a server without parallel decoding.
    Rule(REQUEST, "logprobs", lambda f: f.request.logprobs, _off_or(lambda f: not f.request.logprobs),
         "log-probabilities are not supported with parallel decoding (plain decoding returns them)", _CON),
    Rule(REQUEST, "top_logprobs", lambda f: f.request.top_logprobs, _off_or(lambda f: f.request.top_logprobs == 0),
         "must be 0: log-probabilities are not supported with parallel decoding", _CON),
    Rule(REQUEST, "top_logprobs", lambda f: f.request.top_logprobs,
         lambda f: f.request.top_logprobs <= MAX_LOGPROBS and (f.request.logprobs or not f.request.top_logprobs),
         f"must be in [0, {MAX_LOGPROBS}], and 0 unless logprobs is set", "OpenAI"),
    Rule(REQUEST, "sampling.min_tokens", lambda f: f.request.sampling.min_tokens,
         lambda f: f.request.sampling.min_tokens <= f.max_new_tokens, "must not exceed max_new_tokens ({f.max_new_tokens})",
         "vLLM"),
    Rule(REQUEST, "prompt_logprobs", lambda f: f.request.prompt_logprobs,
         _off_or(lambda f: f.request.prompt_logprobs is None),
         "log-probabilities are not supported with parallel decoding (plain decoding returns them)", _CON),
    Rule(REQUEST, "prompt_logprobs", lambda f: f.request.prompt_logprobs,
         lambda f: f.request.prompt_logprobs is None or 0 <= f.request.prompt_logprobs <= MAX_LOGPROBS,
         f"must be in [0, {MAX_LOGPROBS}]", "vLLM"),
    # Plain decoding applies them (the verifier's acceptance does, path by path in a tree too).
    Rule(REQUEST, "sampling.presence_penalty", lambda f: f.request.sampling.presence_penalty,
         _off_or(lambda f: f.request.sampling.presence_penalty == 0),
         "must be 0 with parallel decoding: it supports only repetition_penalty (plain decoding applies it)", _CON),
    Rule(REQUEST, "sampling.frequency_penalty", lambda f: f.request.sampling.frequency_penalty,
         _off_or(lambda f: f.request.sampling.frequency_penalty == 0),
         "must be 0 with parallel decoding: it supports only repetition_penalty (plain decoding applies it)", _CON),
    Rule(REQUEST, "stop", lambda f: f.request.stop, lambda f: all(f.request.stop), "stop strings must not be empty",
         "pardec"),
    # Text that could still become a stop string is held back and re-checked every step: the cost
    # grows with count x length, so both are capped (figures: docs/benchmarks.md).
    Rule(REQUEST, "stop", lambda f: len(f.request.stop),
         lambda f: len(f.request.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in f.request.stop),
         f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters each", "pardec"),
    Rule(REQUEST, "stop_token_ids", lambda f: len(f.request.stop_token_ids),
         lambda f: len(f.request.stop_token_ids) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop token ids",
         "pardec"),
    # Checked before tokenizing, whose cost grows with the prompt: a huge prompt would hold the
    # gateway's CPU only to be refused (figures: docs/benchmarks.md).
    Rule(REQUEST, "prompt", lambda f: len(f.request.prompt), lambda f: len(f.request.prompt) <= MAX_PROMPT_CHARS,
         f"at most {MAX_PROMPT_CHARS} characters (MindIE's cap on message content)", "MindIE"),
    Rule(REQUEST, "messages", lambda f: input_chars("", f.request.messages),
         lambda f: input_chars("", f.request.messages) <= MAX_PROMPT_CHARS,
         f"at most {MAX_PROMPT_CHARS} characters of content in all (MindIE's cap on message content)", "MindIE"),
    # The drafter keys a conversation's memory by it inside a Redis Cluster hash tag.
    Rule(REQUEST, "session_id", lambda f: f.request.session_id,
         lambda f: len(f.request.session_id) <= 200 and not set("{}") & set(f.request.session_id),
         "must be at most 200 characters without '{{' or '}}'", "pardec"),
    Rule(REQUEST, "max_new_tokens", lambda f: f.max_new_tokens,
         lambda f: f.max_iter_times is None or f.max_new_tokens <= f.max_iter_times,
         "must not exceed ScheduleConfig.maxIterTimes ({f.max_iter_times}), the most tokens one request generates",
         "MindIE ScheduleConfig"),
    Rule(REQUEST, "max_new_tokens", lambda f: f.max_new_tokens,
         lambda f: f.max_iter_times is None or not f.parallel or f.param("dynamic_algo") is not True
         or f.max_new_tokens + f.gamma <= f.max_iter_times,
         "with dynamic_algo, max_new_tokens + speculationGamma ({f.gamma}) must not exceed "
         "ScheduleConfig.maxIterTimes ({f.max_iter_times})", "MindIE Table 4"),
)


def broken_rule(stage: str, facts: Facts) -> str | None:
    """The message of the first row of ``stage`` that ``facts`` break, or None."""
    for row in RULES:
        if row.stage == stage and not row.holds(facts):
            return f"{row.key} = {show(row.value(facts))}: {row.rule.format(f=facts)} [{row.source}]"
    return None


def check(stage: str, facts: Facts) -> None:
    """Raises ConfigError (config/model stage) or InvalidArgument (request stage) for the first
    broken row."""
    message = broken_rule(stage, facts)
    if message is not None:
        raise (InvalidArgument if stage == REQUEST else ConfigError)(message)
