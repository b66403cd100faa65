"""gRPC servicer of the drafter: converts messages, maps errors, and holds no session state.

Everything about a session lives in Redis, so any replica serves any call.
"""

from __future__ import annotations

import time

import grpc
import redis

from drafter.config import DrafterConfig
from drafter.trie import MemoryDecodingStore, SessionNotFound
from pardec.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from pardec.serving import maps_errors
from pardec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

# Trees are small: MindIE caps decoding_length at 16; the verifier accepts up to 64 nodes.
MAX_NODES = 64


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, config: DrafterConfig):
        self.store = MemoryDecodingStore(
            redis.Redis.from_url(config.redis_url),
            ttl_s=config.session_ttl_s,
            branch_length=config.branch_length,
            key_prefix=config.key_prefix,
        )

    def add_to(self, server: grpc.Server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(self, server)

    @maps_errors
    def StartSession(self, request, context):
        start = time.perf_counter()
        _require_session_id(request.session_id)
        plugin = request.config.plugin_type or "memory_decoding"
        if plugin != "memory_decoding":
            raise FailedPrecondition(
                f"config.plugin_type: {plugin!r} is not served by this drafter (memory_decoding only)"
            )
        with _redis_errors():
            self.store.start_session(request.session_id, list(request.prompt_token_ids))
        return drafter_pb2.StartSessionResponse(drafter_ms=(time.perf_counter() - start) * 1e3)

    @maps_errors
    def Propose(self, request, context):
        start = time.perf_counter()
        _require_session_id(request.session_id)
        if request.max_nodes > MAX_NODES:
            raise InvalidArgument(f"max_nodes: {request.max_nodes} exceeds {MAX_NODES}")
        with _redis_errors():
            tokens, parents = self.store.propose(
                request.session_id, list(request.new_token_ids), request.max_nodes, request.max_depth
            )
        return drafter_pb2.ProposeResponse(
            tree=common_pb2.TokenTree(token_ids=tokens, parents=parents),
            drafter_ms=(time.perf_counter() - start) * 1e3,
        )

    @maps_errors
    def EndSession(self, request, context):
        _require_session_id(request.session_id)
        with _redis_errors():
            self.store.end_session(request.session_id)
        return drafter_pb2.EndSessionResponse()


def _require_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidArgument("session_id: must not be empty")


class _redis_errors:
    """Translates store failures: unknown session → NOT_FOUND, Redis down → UNAVAILABLE."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if isinstance(error, SessionNotFound):
            raise NotFound(f"session_id: {error.args[0] if error.args else ''} has no drafter state (never started or expired)") from error
        if isinstance(error, redis.exceptions.ConnectionError):
            raise Unavailable(f"redis: {error}") from error
        if isinstance(error, ValueError):
            raise InvalidArgument(str(error)) from error
        return False
