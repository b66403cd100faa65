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
from pardec.drafter.lookahead import GUESS_SET_RANGE, LEVEL_RANGE, WINDOW_RANGE, LookaheadParams
from pardec.drafter.redis_server import connect
from pardec.drafter.sessions import DECODING_LENGTH_RANGE, PLUGIN_TYPES, DraftSettings, SessionStore
from pardec.runtime.errors import InvalidArgument, NotFound, Unavailable

# The verifier's limit: lookahead's trees reach (level-1) * (window+guess_set_size) = 480 nodes.
MAX_NODES = 512
# The most new tokens one Propose records: one step's accepted path and its bonus token.
MAX_NEW_TOKENS = MAX_NODES + 1
# Longest prompt a session starts from: MindIE's "long sequence" bound, which pardec refuses.
# At this bound a start takes seconds of Redis time, in pieces (trie.py: START_CHUNK_TOKENS).
MAX_PROMPT_TOKENS = 32 * 1024
# Memory names become Redis hash tags of at most 256 characters with a "conversation:" prefix.
MAX_MEMORY_NAME_CHARS = 256 - len("conversation:")
# MindIE's defaults, for fields a client leaves unset (0).
DEFAULTS = {"decoding_length": 16, "level": 4, "window": 5, "guess_set_size": 5}
RANGES = {
    "decoding_length": DECODING_LENGTH_RANGE,
    "level": LEVEL_RANGE,
    "window": WINDOW_RANGE,
    "guess_set_size": GUESS_SET_RANGE,
}


def split_new_tokens(tokens: Sequence[int], limit: int = MAX_NEW_TOKENS) -> tuple[list[Sequence[int]], Sequence[int]]:
    """More new tokens than one Propose takes (a session that ran plain for long): the chunks to
    record first, in Proposes without a tree, and the rest, which goes with the tree's Propose.

    >>> split_new_tokens([1, 2, 3, 4, 5], limit=2)
    ([[1, 2], [3, 4]], [5])
    >>> split_new_tokens([1, 2], limit=2)
    ([], [1, 2])
    """
    heads = []
    while len(tokens) > limit:
        heads.append(tokens[:limit])
        tokens = tokens[limit:]
    return heads, tokens


def draft_settings(
    plugin_type: str = "", decoding_length: int = 0, dynamic_algo: bool = False, level: int = 0, window: int = 0,
    guess_set_size: int = 0,
) -> DraftSettings:
    """A session's settings from a DraftConfig's fields: INVALID_ARGUMENT names the field; an
    unset field ("" or 0) takes MindIE's default.

    >>> draft_settings(decoding_length=8).decoding_length, draft_settings().lookahead
    (8, LookaheadParams(level=4, window=5, guess_set_size=5))
    >>> draft_settings(window=99)
    Traceback (most recent call last):
    ...
    pardec.runtime.errors.InvalidArgument: config.window: 99 is outside [1, 16]
    """
    plugin = plugin_type or "memory_decoding"
    if plugin not in PLUGIN_TYPES:
        raise InvalidArgument(f"config.plugin_type: {plugin!r} must be one of {', '.join(PLUGIN_TYPES)}")
    given = {"decoding_length": decoding_length, "level": level, "window": window, "guess_set_size": guess_set_size}
    values = {}
    for name, (low, high) in RANGES.items():
        value = given[name] or DEFAULTS[name]
        if not low <= value <= high:
            raise InvalidArgument(f"config.{name}: {value} is outside [{low}, {high}]")
        values[name] = value
    return DraftSettings(
        plugin_type=plugin,
        decoding_length=values["decoding_length"],
        dynamic_algo=dynamic_algo,
        lookahead=LookaheadParams(values["level"], values["window"], values["guess_set_size"]),
    )


class Drafter:
    """StartSession, Propose and EndSession over a SessionStore; every failure is a PardecError
    (unknown session: NOT_FOUND, Redis down or busy: UNAVAILABLE, bad field: INVALID_ARGUMENT)."""

    def __init__(self, config: DrafterConfig, timeout_s: float | None = None):
        """On ``config``'s Redis; with ``timeout_s``, a Redis call that takes longer fails
        UNAVAILABLE (a replica has its callers' gRPC deadlines instead)."""
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
        self, session_id: str, prompt: Sequence[int], settings: DraftSettings, conversation: str = "",
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
        max_depth: int, verified_depth: int = -1,
    ) -> tuple[list[int], list[int], list[float]]:
        """Records ``new_tokens`` and returns the next tree (tokens, parents, accept estimates),
        best first. ``verified_depth`` -1: the caller did not say how deep its last tree went."""
        _require_session_id(session_id)
        if max_nodes > MAX_NODES:
            raise InvalidArgument(f"max_nodes: {max_nodes} exceeds {MAX_NODES}")
        if len(new_tokens) > MAX_NEW_TOKENS:
            raise InvalidArgument(f"new_token_ids: {len(new_tokens)} tokens exceed {MAX_NEW_TOKENS}")
        if len(last_node_argmax) > MAX_NEW_TOKENS:
            raise InvalidArgument(f"last_node_argmax: {len(last_node_argmax)} entries exceed {MAX_NEW_TOKENS}")
        with _store_errors():
            return self.store.propose_scored(
                session_id, list(new_tokens), list(last_node_argmax), max_nodes, max_depth, verified_depth
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
