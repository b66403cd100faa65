"""The drafter without protobuf: checks each call's fields and runs it on the session store.

Two callers share it, so both refuse the same input with the same messages and statuses: the
gRPC servicer of a drafter replica (drafter/service.py), and a gateway that drafts in its own
process (gateway/embedded_drafter.py), one network hop fewer on every step. Either way every
session lives in Redis, so a gateway that drafts itself and drafter replicas can share sessions.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from pardec.drafter.config import DrafterConfig
from pardec.drafter.encoding import SessionNotFound
from pardec.drafter.redis_cluster import TRANSIENT_ERRORS
from pardec.drafter.redis_server import connect
from pardec.drafter.sessions import SessionStore
from pardec.runtime.draft_params import (
    BY_NAME, DEFAULTS, MAX_NEW_TOKENS, MAX_TREE_NODES, MEMORY_DECODING, PARAMS, PLUGIN_TYPES, DraftParams,
)
from pardec.runtime.errors import InvalidArgument, NotFound, Unavailable

# Longest prompt a session starts from: MindIE's "long sequence" bound, which pardec refuses.
# At this bound a memory_decoding start is about half a second of the drafter's CPU and a few
# hundred milliseconds of Redis time, in pieces (trie.py: START_CHUNK_FIELDS).
MAX_PROMPT_TOKENS = 32 * 1024
# Memory names become Redis hash tags of at most 256 characters with a "conversation:" prefix.
MAX_MEMORY_NAME_CHARS = 256 - len("conversation:")
# The DraftConfig fields a client sets as numbers, 0 meaning MindIE's default.
_NUMBERS = tuple(param.name for param in PARAMS if param.type is int)


def draft_params(plugin_type: str = "", dynamic_algo: bool = False, **numbers: int) -> DraftParams:
    """A session's DraftParams from a DraftConfig's fields (``numbers``: decoding_length, level,
    window, guess_set_size): INVALID_ARGUMENT names the field; an unset field ("" or 0) takes
    MindIE's default. Every number is checked, whichever plugin the session runs.

    >>> draft_params(decoding_length=8).decoding_length, draft_params().lookahead
    (8, LookaheadParams(level=4, window=5, guess_set_size=5))
    >>> draft_params(window=99)
    Traceback (most recent call last):
    ...
    pardec.runtime.errors.InvalidArgument: config.window: 99 is outside [1, 16]
    """
    plugin = plugin_type or MEMORY_DECODING
    if plugin not in PLUGIN_TYPES:
        raise InvalidArgument(f"config.plugin_type: {plugin!r} must be one of {', '.join(PLUGIN_TYPES)}")
    values = {}
    for name in _NUMBERS:
        low, high = BY_NAME[name].low, BY_NAME[name].high
        value = numbers.pop(name, 0) or DEFAULTS[name]
        if not low <= value <= high:
            raise InvalidArgument(f"config.{name}: {value} is outside [{low}, {high}]")
        values[name] = value
    if numbers:
        raise TypeError(f"draft_params: unknown fields {sorted(numbers)}")
    return DraftParams(plugin_type=plugin, dynamic_algo=dynamic_algo, **values)


class Drafter:
    """StartSession, Propose and EndSession over a SessionStore; every failure is a PardecError
    (unknown session: NOT_FOUND, Redis down or busy: UNAVAILABLE, bad field: INVALID_ARGUMENT)."""

    def __init__(self, config: DrafterConfig, timeout_s: float | None = None):
        """On ``config``'s Redis; a Redis connect or reply slower than ``timeout_s`` (None:
        ``config.redis_timeout_s``) fails the call UNAVAILABLE. A caller's gRPC deadline would
        not free the replica's thread from a Redis that stopped answering."""
        timeout_s = config.redis_timeout_s if timeout_s is None else timeout_s
        self._client = connect(config.redis_url, config.redis_password, config.redis_tls, timeout_s=timeout_s)
        self.store = SessionStore(
            self._client,
            ttl_s=config.session_ttl_s,
            branch_length=config.branch_length,
            key_prefix=config.key_prefix,
            conversation_ttl_s=config.conversation_ttl_s,
            shared_memory_contexts=config.shared_memory_contexts,
        )

    def start_session(
        self, session_id: str, prompt: Sequence[int], settings: DraftParams, conversation: str = "",
        shared: str = "",
    ) -> None:
        """``conversation`` keeps a client's multi-turn memory; ``shared`` names a memory shared
        across requests (empty: none)."""
        _require_session_id(session_id)
        if len(prompt) > MAX_PROMPT_TOKENS:
            raise InvalidArgument(f"prompt_token_ids: {len(prompt)} tokens exceed {MAX_PROMPT_TOKENS}")
        for name, value in (("client_session_id", conversation), ("shared_memory", shared)):
            if len(value) > MAX_MEMORY_NAME_CHARS or "{" in value or "}" in value:
                raise InvalidArgument(f"{name}: must be at most {MAX_MEMORY_NAME_CHARS} characters without braces")
        with _store_errors():
            self.store.start_session(session_id, list(prompt), settings, conversation=conversation, shared=shared)

    def propose(
        self, session_id: str, new_tokens: Sequence[int], last_node_argmax: Sequence[int], max_nodes: int,
        max_depth: int, verified_depth: int = -1, committed_length: int = -1,
    ) -> tuple[list[int], list[int], list[float]]:
        """Records ``new_tokens`` and returns the next tree (tokens, parents, accept estimates),
        best first. ``verified_depth`` -1: the caller did not say how deep its last tree went.
        ``committed_length`` (-1: not said) makes a repeated call a no-op (SessionStore)."""
        _require_session_id(session_id)
        if max_nodes > MAX_TREE_NODES:
            raise InvalidArgument(f"max_nodes: {max_nodes} exceeds {MAX_TREE_NODES}")
        if len(new_tokens) > MAX_NEW_TOKENS:
            raise InvalidArgument(f"new_token_ids: {len(new_tokens)} tokens exceed {MAX_NEW_TOKENS}")
        if len(last_node_argmax) > MAX_NEW_TOKENS:
            raise InvalidArgument(f"last_node_argmax: {len(last_node_argmax)} entries exceed {MAX_NEW_TOKENS}")
        with _store_errors():
            return self.store.propose_scored(
                session_id, list(new_tokens), list(last_node_argmax), max_nodes, max_depth, verified_depth,
                committed_length,
            )

    def end_session(self, session_id: str, new_tokens: Sequence[int] = ()) -> None:
        """Hands the session's output to its memories and deletes it; an unknown one is fine."""
        _require_session_id(session_id)
        if len(new_tokens) > MAX_PROMPT_TOKENS:
            raise InvalidArgument(f"new_token_ids: {len(new_tokens)} tokens exceed {MAX_PROMPT_TOKENS}")
        with _store_errors():
            self.store.end_session(session_id, list(new_tokens))

    def close(self) -> None:
        self._client.close()


def _require_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidArgument("session_id: must not be empty")


class _store_errors:
    """Translates store failures: unknown session → NOT_FOUND, Redis down or a cluster failing
    over → UNAVAILABLE."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if isinstance(error, SessionNotFound):
            session = error.args[0] if error.args else ""
            raise NotFound(f"session_id: {session} has no drafter state (never started or expired)") from error
        busy = isinstance(error, redis.exceptions.ResponseError) and str(error).startswith("BUSY")
        # Out of memory (maxmemory reached and nothing evictable): drafting state is a cache, so
        # this costs only drafting; the gateway decodes those steps plain.
        # (A script's write reports it inside "Error running script ...: -OOM command not allowed".)
        full = isinstance(error, redis.exceptions.ResponseError) and "OOM command not allowed" in str(error)
        # A cluster failing over or moving slots answers these until its map settles (the client
        # learns the new map as it fails): drafting waits, as for a Redis that is down.
        retryable = (
            redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.OutOfMemoryError,
            *TRANSIENT_ERRORS,
        )
        if isinstance(error, retryable) or busy or full:
            raise Unavailable(f"redis: {error}") from error
        if isinstance(error, ValueError):
            raise InvalidArgument(str(error)) from error
        return False
