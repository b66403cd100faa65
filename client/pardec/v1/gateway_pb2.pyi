from pardec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODING_MODE_DEFAULT: _ClassVar[DecodingMode]
    DECODING_MODE_PLAIN: _ClassVar[DecodingMode]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]
    ROLE_TOOL: _ClassVar[Role]
DECODING_MODE_DEFAULT: DecodingMode
DECODING_MODE_PLAIN: DecodingMode
ROLE_UNSPECIFIED: Role
ROLE_SYSTEM: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
ROLE_TOOL: Role

class Message(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: Role
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("function",)
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    function: Function
    def __init__(self, function: _Optional[_Union[Function, _Mapping]] = ...) -> None: ...

class Function(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "function")
    ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    id: str
    function: FunctionCall
    def __init__(self, id: _Optional[str] = ..., function: _Optional[_Union[FunctionCall, _Mapping]] = ...) -> None: ...

class FunctionCall(_message.Message):
    __slots__ = ("name", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments: str
    def __init__(self, name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: _Optional[str] = ..., function: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "max_new_tokens", "decoding", "sampling", "n", "best_of", "use_beam_search", "logprobs", "top_logprobs", "prompt_logprobs", "prompt_token_ids", "stop", "session_id", "draft", "messages", "raw", "cache_salt", "ignore_eos", "stop_token_ids", "include_stop_str_in_output", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "continue_final_message", "bad_words", "truncate_prompt_tokens", "priority", "prediction", "keep_special_tokens", "length_penalty")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    max_new_tokens: int
    decoding: DecodingMode
    sampling: _common_pb2.SamplingParams
    n: int
    best_of: int
    use_beam_search: bool
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    draft: DraftOverrides
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    raw: bool
    cache_salt: str
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    chat_template_kwargs: str
    continue_final_message: bool
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    truncate_prompt_tokens: int
    priority: int
    prediction: str
    keep_special_tokens: bool
    length_penalty: float
    def __init__(self, prompt: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., decoding: _Optional[_Union[DecodingMode, str]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., use_beam_search: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ..., draft: _Optional[_Union[DraftOverrides, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., raw: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ..., continue_final_message: _Optional[bool] = ..., bad_words: _Optional[_Iterable[str]] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., prediction: _Optional[str] = ..., keep_special_tokens: _Optional[bool] = ..., length_penalty: _Optional[float] = ...) -> None: ...

class DraftOverrides(_message.Message):
    __slots__ = ("decoding_length", "level", "window", "guess_set_size")
    DECODING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    GUESS_SET_SIZE_FIELD_NUMBER: _ClassVar[int]
    decoding_length: int
    level: int
    window: int
    guess_set_size: int
    def __init__(self, decoding_length: _Optional[int] = ..., level: _Optional[int] = ..., window: _Optional[int] = ..., guess_set_size: _Optional[int] = ...) -> None: ...

class DecodingStats(_message.Message):
    __slots__ = ("prompt_tokens", "steps", "draft_tokens", "accepted_draft_tokens", "mean_accepted_length", "decoding_method", "ttft_ms", "total_ms", "gateway_ms", "drafter_ms", "verifier_ms", "verifier_compute_ms", "cached_prompt_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DECODING_METHOD_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    steps: int
    draft_tokens: int
    accepted_draft_tokens: int
    mean_accepted_length: float
    decoding_method: str
    ttft_ms: float
    total_ms: float
    gateway_ms: float
    drafter_ms: float
    verifier_ms: float
    verifier_compute_ms: float
    cached_prompt_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., decoding_method: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., gateway_ms: _Optional[float] = ..., drafter_ms: _Optional[float] = ..., verifier_ms: _Optional[float] = ..., verifier_compute_ms: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "stats", "model", "logprobs", "prompt_token_ids", "prompt_logprobs", "tool_calls", "reasoning_content", "index")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: DecodingStats
    model: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reasoning_content: str
    index: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[DecodingStats, _Mapping]] = ..., model: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reasoning_content: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class GetServedModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("model", "architecture", "quantization", "max_seq_len", "max_input_tokens", "truncation", "vocab_size", "device", "default_max_new_tokens", "max_new_tokens_limit", "chat_template", "decoding", "verifier_replicas", "prefix_block_tokens", "tool_call_layout", "generation_defaults", "attention", "kv_cache_dtype", "embedding_dtype", "embedding_rounded")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DTYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_ROUNDED_FIELD_NUMBER: _ClassVar[int]
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
    prefix_block_tokens: int
    tool_call_layout: str
    generation_defaults: _common_pb2.GenerationDefaults
    attention: str
    kv_cache_dtype: str
    embedding_dtype: str
    embedding_rounded: bool
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., quantization: _Optional[str] = ..., max_seq_len: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., truncation: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., device: _Optional[str] = ..., default_max_new_tokens: _Optional[int] = ..., max_new_tokens_limit: _Optional[int] = ..., chat_template: _Optional[bool] = ..., decoding: _Optional[_Union[ParallelDecoding, _Mapping]] = ..., verifier_replicas: _Optional[int] = ..., prefix_block_tokens: _Optional[int] = ..., tool_call_layout: _Optional[str] = ..., generation_defaults: _Optional[_Union[_common_pb2.GenerationDefaults, _Mapping]] = ..., attention: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., embedding_dtype: _Optional[str] = ..., embedding_rounded: _Optional[bool] = ...) -> None: ...

class ParallelDecoding(_message.Message):
    __slots__ = ("method", "decoding_length", "dynamic_algo", "level", "window", "guess_set_size", "speculation_gamma", "shared_memory")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DECODING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_ALGO_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    GUESS_SET_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_GAMMA_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    method: str
    decoding_length: int
    dynamic_algo: bool
    level: int
    window: int
    guess_set_size: int
    speculation_gamma: int
    shared_memory: bool
    def __init__(self, method: _Optional[str] = ..., decoding_length: _Optional[int] = ..., dynamic_algo: _Optional[bool] = ..., level: _Optional[int] = ..., window: _Optional[int] = ..., guess_set_size: _Optional[int] = ..., speculation_gamma: _Optional[int] = ..., shared_memory: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "raw", "tools", "chat_template_kwargs", "continue_final_message")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    raw: bool
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    chat_template_kwargs: str
    continue_final_message: bool
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., raw: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., chat_template_kwargs: _Optional[str] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_input_tokens", "max_seq_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_input_tokens: int
    max_seq_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_input_tokens: _Optional[int] = ..., max_seq_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
