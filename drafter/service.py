"""gRPC servicer of the drafter: converts messages, maps errors, and holds no session state.

Everything about a session lives in Redis, so any replica serves any call.
"""

from __future__ import annotations

import time

import grpc
import redis

from drafter.config import DrafterConfig
from drafter.encoding import SessionNotFound
from drafter.lookahead import GUESS_SET_RANGE, LEVEL_RANGE, WINDOW_RANGE, LookaheadParams
from drafter.redis_server import connect
from drafter.sessions import DECODING_LENGTH_RANGE, PLUGIN_TYPES, DraftSettings, SessionStore
from pardec.errors import InvalidArgument, NotFound, Unavailable
from pardec.parsing import add_servicer
from pardec.serving import maps_errors
from pardec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

# The verifier's limit: lookahead's trees reach (level-1) * (window+guess_set_size) = 480 nodes.
MAX_NODES = 512
# Longest prompt a session starts from: MindIE's "long sequence" bound, which pardec refuses.
# At this bound a start takes seconds of Redis time, in pieces (trie.py: START_CHUNK_TOKENS).
MAX_PROMPT_TOKENS = 32 * 1024
# Memory names become Redis hash tags of at most 256 characters with a "conversation:" prefix.
MAX_MEMORY_NAME_CHARS = 256 - len("conversation:")
# MindIE's defaults, for fields a client leaves unset (proto3 reads them as 0).
DEFAULTS = {"decoding_length": 16, "level": 4, "window": 5, "guess_set_size": 5}
RANGES = {
    "decoding_length": DECODING_LENGTH_RANGE,
    "level": LEVEL_RANGE,
    "window": WINDOW_RANGE,
    "guess_set_size": GUESS_SET_RANGE,
}


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, config: DrafterConfig):
        self.store = SessionStore(
            connect(config.redis_url, config.redis_password, config.redis_tls),
            ttl_s=config.session_ttl_s,
            branch_length=config.branch_length,
            key_prefix=config.key_prefix,
            conversation_ttl_s=config.conversation_ttl_s,
            shared_memory_contexts=config.shared_memory_contexts,
        )

    def add_to(self, server: grpc.Server) -> None:
        add_servicer(server, self, drafter_pb2.DESCRIPTOR.services_by_name["Drafter"])

    @maps_errors
    def StartSession(self, request, context):
        start = time.perf_counter()
        _require_session_id(request.session_id)
        settings = draft_settings(request.config)
        if len(request.prompt_token_ids) > MAX_PROMPT_TOKENS:
            raise InvalidArgument(f"prompt_token_ids: {len(request.prompt_token_ids)} tokens exceed {MAX_PROMPT_TOKENS}")
        for name in ("client_session_id", "shared_memory"):
            value = getattr(request, name)
            if len(value) > MAX_MEMORY_NAME_CHARS or "{" in value or "}" in value:
                raise InvalidArgument(f"{name}: must be at most {MAX_MEMORY_NAME_CHARS} characters without braces")
        with _redis_errors():
            self.store.start_session(
                request.session_id,
                list(request.prompt_token_ids),
                settings,
                conversation=request.client_session_id,
                shared=request.shared_memory,
            )
        return drafter_pb2.StartSessionResponse(drafter_ms=(time.perf_counter() - start) * 1e3)

    @maps_errors
    def Propose(self, request, context):
        start = time.perf_counter()
        _require_session_id(request.session_id)
        if request.max_nodes > MAX_NODES:
            raise InvalidArgument(f"max_nodes: {request.max_nodes} exceeds {MAX_NODES}")
        if len(request.new_token_ids) > MAX_NODES + 1:  # one step commits a path and a bonus token
            raise InvalidArgument(f"new_token_ids: {len(request.new_token_ids)} tokens exceed {MAX_NODES + 1}")
        if len(request.last_node_argmax) > MAX_NODES + 1:
            raise InvalidArgument(f"last_node_argmax: {len(request.last_node_argmax)} entries exceed {MAX_NODES + 1}")
        verified_depth = request.verified_depth if request.HasField("verified_depth") else -1
        with _redis_errors():
            tokens, parents, probabilities = self.store.propose_scored(
                request.session_id,
                list(request.new_token_ids),
                list(request.last_node_argmax),
                request.max_nodes,
                request.max_depth,
                verified_depth,
            )
        return drafter_pb2.ProposeResponse(
            tree=common_pb2.TokenTree(token_ids=tokens, parents=parents),
            drafter_ms=(time.perf_counter() - start) * 1e3,
            accept_probabilities=probabilities,
        )

    @maps_errors
    def EndSession(self, request, context):
        _require_session_id(request.session_id)
        if len(request.new_token_ids) > MAX_PROMPT_TOKENS:
            raise InvalidArgument(f"new_token_ids: {len(request.new_token_ids)} tokens exceed {MAX_PROMPT_TOKENS}")
        with _redis_errors():
            self.store.end_session(request.session_id, list(request.new_token_ids))
        return drafter_pb2.EndSessionResponse()


def draft_settings(config: drafter_pb2.DraftConfig) -> DraftSettings:
    """Validates a DraftConfig: INVALID_ARGUMENT names the field; 0 (unset) takes the default."""
    plugin = config.plugin_type or "memory_decoding"
    if plugin not in PLUGIN_TYPES:
        raise InvalidArgument(f"config.plugin_type: {plugin!r} must be one of {', '.join(PLUGIN_TYPES)}")
    values = {}
    for name, (low, high) in RANGES.items():
        value = getattr(config, name) or DEFAULTS[name]
        if not low <= value <= high:
            raise InvalidArgument(f"config.{name}: {value} is outside [{low}, {high}]")
        values[name] = value
    return DraftSettings(
        plugin_type=plugin,
        decoding_length=values["decoding_length"],
        dynamic_algo=config.dynamic_algo,
        lookahead=LookaheadParams(values["level"], values["window"], values["guess_set_size"]),
    )


def _require_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidArgument("session_id: must not be empty")


class _redis_errors:
    """Translates store failures: unknown session → NOT_FOUND, Redis down → UNAVAILABLE."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if isinstance(error, SessionNotFound):
            session = error.args[0] if error.args else ""
            raise NotFound(f"session_id: {session} has no drafter state (never started or expired)") from error
        busy = isinstance(error, redis.exceptions.ResponseError) and str(error).startswith("BUSY")
        if isinstance(error, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)) or busy:
            raise Unavailable(f"redis: {error}") from error
        if isinstance(error, ValueError):
            raise InvalidArgument(str(error)) from error
        return False
