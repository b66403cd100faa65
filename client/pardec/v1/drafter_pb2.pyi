from pardec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftConfig(_message.Message):
    __slots__ = ("plugin_type", "decoding_length", "dynamic_algo", "level", "window", "guess_set_size")
    PLUGIN_TYPE_FIELD_NUMBER: _ClassVar[int]
    DECODING_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_ALGO_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    GUESS_SET_SIZE_FIELD_NUMBER: _ClassVar[int]
    plugin_type: str
    decoding_length: int
    dynamic_algo: bool
    level: int
    window: int
    guess_set_size: int
    def __init__(self, plugin_type: _Optional[str] = ..., decoding_length: _Optional[int] = ..., dynamic_algo: _Optional[bool] = ..., level: _Optional[int] = ..., window: _Optional[int] = ..., guess_set_size: _Optional[int] = ...) -> None: ...

class StartSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "config", "client_session_id", "shared_memory")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CLIENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    config: DraftConfig
    client_session_id: str
    shared_memory: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., config: _Optional[_Union[DraftConfig, _Mapping]] = ..., client_session_id: _Optional[str] = ..., shared_memory: _Optional[str] = ...) -> None: ...

class StartSessionResponse(_message.Message):
    __slots__ = ("drafter_ms",)
    DRAFTER_MS_FIELD_NUMBER: _ClassVar[int]
    drafter_ms: float
    def __init__(self, drafter_ms: _Optional[float] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "new_token_ids", "max_nodes", "max_depth", "last_node_argmax", "verified_depth", "committed_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    LAST_NODE_ARGMAX_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DEPTH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_nodes: int
    max_depth: int
    last_node_argmax: _containers.RepeatedScalarFieldContainer[int]
    verified_depth: int
    committed_length: int
    def __init__(self, session_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., max_nodes: _Optional[int] = ..., max_depth: _Optional[int] = ..., last_node_argmax: _Optional[_Iterable[int]] = ..., verified_depth: _Optional[int] = ..., committed_length: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tree", "drafter_ms", "accept_probabilities")
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    tree: _common_pb2.TokenTree
    drafter_ms: float
    accept_probabilities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., drafter_ms: _Optional[float] = ..., accept_probabilities: _Optional[_Iterable[float]] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id", "new_token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
