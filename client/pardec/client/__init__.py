"""A small typed client of a pardec gateway, blocking (Client) and asyncio (AsyncClient):

    from pardec.client import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("Write a Python function that reverses a string.", max_new_tokens=128).text)

It needs grpcio and protobuf only; the contract's generated code, for callers that want the
raw messages, is pardec.v1 in the same distribution (pardec-client).
"""

from pardec.client._aio import AsyncClient
from pardec.client._sync import DEFAULT_TARGET, Client
from pardec.client._types import (
    Chunk,
    GenerateOptions,
    Message,
    MessageLike,
    ParallelDecoding,
    PardecError,
    Reply,
    Role,
    ServedModel,
    Stats,
    TokenLogprob,
    ToolCall,
)

__all__ = [
    "DEFAULT_TARGET", "AsyncClient", "Chunk", "Client", "GenerateOptions", "Message", "MessageLike",
    "ParallelDecoding", "PardecError", "Reply", "Role", "ServedModel", "Stats",
    "TokenLogprob", "ToolCall",
]
