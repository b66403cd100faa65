from pardec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetModelInfoRequest(_message.Message):
    __slots__ = ("brief",)
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    brief: bool
    def __init__(self, brief: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "quantization", "tokenizer_json", "chat_template", "bos_token", "eos_token", "stop_token_ids", "max_seq_len", "vocab_size", "device", "max_tree_nodes", "kernel", "cost_curve", "prefix_block_tokens", "generation_defaults", "attention", "kv_cache_dtype", "embedding_dtype", "embedding_rounded")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    COST_CURVE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DTYPE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_ROUNDED_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    quantization: str
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_seq_len: int
    vocab_size: int
    device: str
    max_tree_nodes: int
    kernel: str
    cost_curve: _containers.RepeatedCompositeFieldContainer[CostPoint]
    prefix_block_tokens: int
    generation_defaults: _common_pb2.GenerationDefaults
    attention: str
    kv_cache_dtype: str
    embedding_dtype: str
    embedding_rounded: bool
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., quantization: _Optional[str] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_seq_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., device: _Optional[str] = ..., max_tree_nodes: _Optional[int] = ..., kernel: _Optional[str] = ..., cost_curve: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., prefix_block_tokens: _Optional[int] = ..., generation_defaults: _Optional[_Union[_common_pb2.GenerationDefaults, _Mapping]] = ..., attention: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., embedding_dtype: _Optional[str] = ..., embedding_rounded: _Optional[bool] = ...) -> None: ...

class CostPoint(_message.Message):
    __slots__ = ("tokens", "batch", "step_ms")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    batch: int
    step_ms: float
    def __init__(self, tokens: _Optional[int] = ..., batch: _Optional[int] = ..., step_ms: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "sampling", "resume", "max_new_tokens", "cache_scope", "logprobs", "prompt_logprobs", "stop_token_ids", "generated_tokens", "priority")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    resume: bool
    max_new_tokens: int
    cache_scope: str
    logprobs: int
    prompt_logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_tokens: int
    priority: int
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., cache_scope: _Optional[str] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., generated_tokens: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("next_token_id", "compute_ms", "cached_tokens", "logprob", "prompt_logprobs")
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    next_token_id: int
    compute_ms: float
    cached_tokens: int
    logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, next_token_id: _Optional[int] = ..., compute_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _common_pb2.TokenTree
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_token_ids", "accepted_node_indices", "bonus_token_id", "node_argmax", "compute_ms", "logprobs")
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODE_INDICES_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ARGMAX_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_node_indices: _containers.RepeatedScalarFieldContainer[int]
    bonus_token_id: int
    node_argmax: _containers.RepeatedScalarFieldContainer[int]
    compute_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, accepted_token_ids: _Optional[_Iterable[int]] = ..., accepted_node_indices: _Optional[_Iterable[int]] = ..., bonus_token_id: _Optional[int] = ..., node_argmax: _Optional[_Iterable[int]] = ..., compute_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
