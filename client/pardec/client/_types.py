"""What the clients take and return: plain dataclasses, so that callers never handle protobuf."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Union

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """A call of a function: one the model made (Reply.tool_calls), or one in a conversation's history."""

    name: str
    arguments: str  # a JSON object's text
    id: str = ""  # what a tool message answering it names (the server's "call_..." on a reply)


@dataclass(frozen=True)
class Message:
    """One message of a conversation: an optional system message first, then user and
    assistant messages (an assistant's may make tool calls, each answered by a tool message
    right after it), the last one from the user or a tool."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's
    tool_call_id: str = ""  # a tool's: the id of the call it answers


# A message may also be written as OpenAI-style {"role": ..., "content": ...} (with "tool_calls"
# or "tool_call_id" as OpenAI's API writes them).
MessageLike = Union[Message, Mapping[str, Any]]


class GenerateOptions(TypedDict, total=False):
    """The keyword arguments of generate, stream and chat (the server checks every value and
    refuses a bad one with INVALID_ARGUMENT)."""

    system: str | None  # a system message before the prompt or the messages
    request_id: str  # sent as x-request-id metadata: the request's id in the gateway's log line and trace span
    raw: bool  # prompt is continued as raw text, without the chat template
    max_new_tokens: int  # 0: the server's default
    temperature: float  # 0: greedy
    top_p: float  # 0 or 1: no nucleus filter
    top_k: int  # 0: no top-k filter
    min_p: float  # 0: no min-p filter; else keep tokens at least this share of the likeliest's probability
    seed: int | None  # None: a fresh random seed
    repetition_penalty: float | None
    presence_penalty: float  # in [-2, 2], off the logit of each token the output holds (plain decoding)
    frequency_penalty: float  # in [-2, 2], off a token's logit per time the output holds it (plain decoding)
    min_tokens: int  # no end of sequence or stop token before this many tokens
    logit_bias: Mapping[int, float]  # added to these tokens' logits, each in [-100, 100]
    allowed_token_ids: Sequence[int]  # only these tokens may be generated
    stop: str | Sequence[str]  # the text ends before the first of these
    stop_token_ids: Sequence[int]  # generation also ends at any of these tokens
    include_stop_str_in_output: bool  # the text keeps the stop string (or stop token) that ended it
    keep_special_tokens: bool  # control tokens the model writes stay in the text (<|im_start|>, ...)
    ignore_eos: bool  # generate past end of sequence, up to max_new_tokens (a fixed length)
    session_id: str  # a conversation's id: later turns draft from earlier answers
    cache_salt: str  # shares cached prompt blocks only with the tenant's requests of the same salt
    plain: bool  # plain decoding: one token per step, no drafting
    n: int  # sequences (stream only, with plain: each chunk's index says its sequence); seed + i samples sequence i
    use_beam_search: bool  # n beams, best first, each whole at the end (with plain; stream for n > 1)
    length_penalty: float | None  # beam search ranks by log-probability / length ** this (None: 1.0)
    logprobs: int | None  # each token's log-probability and this many likeliest beside it (0-20; plain only)
    prompt_logprobs: int | None  # the same for the prompt's tokens (Reply.prompt_logprobs; plain only)
    prompt_token_ids: Sequence[int]  # the prompt as token ids, sent as they are (instead of prompt)
    # At most one structured output: the text is held to this language (lossless with drafting).
    json_schema: Mapping[str, Any] | str | None  # one JSON value the schema validates
    regex: str | None  # a match of this regular expression (Rust syntax)
    choice: Sequence[str] | None  # exactly one of these strings
    grammar: str | None  # a word of this Lark grammar (from its `start` rule)
    json_object: bool  # any one JSON object
    # Functions the model may call, as OpenAI's API writes them: {"type": "function", "function":
    # {"name", "description", "parameters"}} (or the inner {"name", ...} alone).
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None  # "auto", "none", "required" or {"function": {"name": ...}}
    parallel_tool_calls: bool | None  # False: at most one call
    # The chat template's own variables (vLLM's chat_template_kwargs), e.g. {"enable_thinking": False}.
    chat_template_kwargs: Mapping[str, Any] | None
    # True: the answer goes on from the last message, an assistant's text (vLLM's continue_final_message).
    continue_final_message: bool
    # A thinking model's thinking bounded: after this many tokens its closing tag (</think>) is forced.
    thinking_budget: int | None
    truncate_prompt_tokens: int | None  # keep the prompt's last N tokens (-1: the server's longest prompt)
    priority: int  # lower goes first where the verifier must choose between sessions (vLLM's)
    bad_words: str | Sequence[str]  # words never generated (vLLM's bad_words), as written and after a space
    # Text the answer will mostly be (OpenAI's Predicted Outputs: a file to edit), drafted from.
    prediction: str
    draft: Mapping[str, int] | None  # lowers the server's drafting limits: decoding_length, level, ...


@dataclass(frozen=True)
class Stats:
    """How a reply was made; times are wall-clock milliseconds."""

    prompt_tokens: int
    steps: int  # verifier forward passes, prefill excluded
    draft_tokens: int
    accepted_draft_tokens: int
    mean_accepted_length: float  # tokens committed per step
    decoding_method: str  # "plain", "memory_decoding" or "la"
    ttft_ms: float
    total_ms: float
    gateway_ms: float
    drafter_ms: float
    verifier_ms: float
    verifier_compute_ms: float
    cached_prompt_tokens: int  # of the prompt's, found in the verifier's prefix cache (not computed)
    accepted_prediction_tokens: int = 0  # with a prediction: its tokens that appeared in the answer
    rejected_prediction_tokens: int = 0  # and those that did not


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw distribution (before
    temperature, penalties and top-k / top-p), and the likeliest tokens' as (token id,
    log-probability) pairs, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Reply:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "length", "stop", "eos" or "tool_calls"
    model: str
    stats: Stats
    tool_calls: tuple[ToolCall, ...] = ()  # with tools: the calls made (the text holds what is outside them)
    reasoning_content: str = ""  # a thinking model's thinking (Qwen3, DeepSeek-R1), apart from the text
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them
    # With prompt_logprobs: the prompt's tokens as the model saw them, and each one's but the first's.
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """The tokens one step committed. Only the last chunk has finish_reason and stats; the
    chunks' texts concatenate to generate's text."""

    text: str
    token_ids: tuple[int, ...]
    model: str
    finish_reason: str = ""
    stats: Stats | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # the calls this chunk completes, each once
    reasoning_content: str = ""  # this chunk's part of a thinking model's thinking
    index: int = 0  # its sequence's, among the request's n
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them
    prompt_token_ids: tuple[int, ...] = ()  # as Reply's, on the first chunk only
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ParallelDecoding:
    """The server's parallel decoding; a parameter its method does not read is 0 (False)."""

    method: str  # "memory_decoding", "la" or "plain"
    decoding_length: int
    dynamic_algo: bool
    level: int
    window: int
    guess_set_size: int
    speculation_gamma: int
    shared_memory: bool


@dataclass(frozen=True)
class ServedModel:
    """What the gateway serves: the model, its limits and its parallel decoding."""

    model: str
    architecture: str
    quantization: str
    max_seq_len: int
    max_input_tokens: int
    truncation: bool
    vocab_size: int
    device: str
    default_max_new_tokens: int
    max_new_tokens_limit: int
    chat_template: bool
    decoding: ParallelDecoding
    verifier_replicas: int
    prefix_block_tokens: int = 0  # positions per block of the verifiers' prefix cache; 0: none
    tool_call_layout: str = ""  # how the model writes tool calls: "hermes" or "llama3_json"
    # HTTP requests' sampling for the fields they leave out (the model's generation_config.json):
    # {"temperature": 0.6, ...}; empty: the APIs' own. The requests of this client are not changed.
    generation_defaults: Mapping[str, float] = field(default_factory=dict)
    attention: str = ""  # the verifiers' attention kernel: "native", "fp64", "triton", "fixed_order"
    kv_cache_dtype: str = ""  # what their KV cache stores: "float32" or "bfloat16"
    embedding_dtype: str = ""  # what they keep the embedding table in: "bfloat16", "float16", "float32"
    embedding_rounded: bool = False  # an entry of that table rounded to fit it (--embedding-dtype bfloat16)


class PardecError(Exception):
    """A call the gateway refused or could not serve. ``code`` is the gRPC status's name
    ("INVALID_ARGUMENT", "UNAVAILABLE", ...); ``message`` is the server's, which names the
    field and the rule for a refused request."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
