"""What a gateway serves, protobuf-free: the model, its limits and the parallel decoding that a
request with the default decoding gets. The gRPC servicer (GetServedModel) converts it; an HTTP
front (GET /v1/models) may read the same."""

from __future__ import annotations

from dataclasses import dataclass

from pardec.gateway.call_layouts import layout_of
from pardec.gateway.clients import ModelInfo
from pardec.gateway.config import GatewayConfig
from pardec.gateway.rules import Facts
from pardec.runtime.draft_params import PARAMS

PLAIN = "plain"


@dataclass(frozen=True)
class ParallelDecoding:
    """The server's plugin_params; a parameter its method does not read is 0 (False)."""

    method: str = PLAIN  # "memory_decoding", "la" or "plain": DecodingStats.decoding_method's names
    decoding_length: int = 0
    dynamic_algo: bool = False
    level: int = 0
    window: int = 0
    guess_set_size: int = 0
    speculation_gamma: int = 0  # most draft tokens per step; 0 with plain
    shared_memory: bool = False


@dataclass(frozen=True)
class ServedModel:
    model: str
    architecture: str
    quantization: str
    max_seq_len: int  # prompt + generated tokens
    max_input_tokens: int
    truncation: bool
    vocab_size: int
    device: str
    default_max_new_tokens: int
    max_new_tokens_limit: int  # for a request with the default decoding
    chat_template: bool
    decoding: ParallelDecoding
    verifier_replicas: int = 1
    prefix_block_tokens: int = 0  # 0: no prefix caching
    tool_call_layout: str = ""  # how the model writes tool calls (gateway/call_layouts.py)
    generation_defaults: tuple[tuple[str, float], ...] = ()  # HTTP requests' sampling defaults (the model's)
    attention: str = ""  # the verifiers' attention kernel ("" unknown)
    kv_cache_dtype: str = ""  # what their KV cache stores ("" unknown)
    embedding_dtype: str = ""  # what they keep the embedding table in ("" unknown)
    embedding_rounded: bool = False  # an entry of it rounded to fit


def iteration_room(facts: Facts) -> int | None:
    """Tokens a request may generate under maxIterTimes (less speculationGamma with dynamic_algo),
    None when the config sets no maxIterTimes."""
    if facts.max_iter_times is None:
        return None
    room = facts.max_iter_times
    if facts.parallel and facts.param("dynamic_algo") is True:
        room -= facts.gamma
    return room


def default_max_new_tokens(config: GatewayConfig, facts: Facts, model: ModelInfo | None = None) -> int:
    """The server default, lowered to what maxIterTimes (and speculationGamma) allow and to the
    model's generation_config.json max_new_tokens (which caps HTTP requests too: openai_api.py)."""
    default = config.default_max_new_tokens
    if model is not None:
        default = min(default, int(dict(model.generation_defaults).get("max_new_tokens", default)))
    room = iteration_room(facts)
    return default if room is None else max(1, min(default, room))


def served_model(config: GatewayConfig, model: ModelInfo) -> ServedModel:
    """What ``config`` serves over ``model`` (the verifier's ModelInfo)."""
    facts = config.facts()
    room = iteration_room(facts)
    limit = model.max_seq_len if room is None else room
    default = default_max_new_tokens(config, facts, model)
    return ServedModel(
        model=model.model_name,
        architecture=model.architecture,
        quantization=model.quantization,
        max_seq_len=model.max_seq_len,
        max_input_tokens=config.max_input_tokens,
        truncation=config.truncation,
        vocab_size=model.vocab_size,
        device=model.device,
        default_max_new_tokens=default,
        max_new_tokens_limit=max(0, limit),
        chat_template=bool(model.tokenizer is not None and model.tokenizer.chat_template),
        decoding=_decoding(config, facts.gamma if facts.parallel else 0),
        verifier_replicas=model.verifier_replicas,
        prefix_block_tokens=model.prefix_block_tokens,
        tool_call_layout=layout_of(model.tokenizer).name if model.tokenizer is not None else "",
        generation_defaults=model.generation_defaults,
        attention=model.attention,
        kv_cache_dtype=model.kv_cache_dtype,
        embedding_dtype=model.embedding_dtype,
        embedding_rounded=model.embedding_rounded,
    )


def _decoding(config: GatewayConfig, gamma: int) -> ParallelDecoding:
    draft = config.draft
    if draft is None:
        return ParallelDecoding()
    params = {param.name: getattr(draft, param.name) for param in PARAMS if param.plugin == draft.plugin_type}
    return ParallelDecoding(
        method=draft.plugin_type, speculation_gamma=gamma, shared_memory=config.shared_memory, **params
    )
