"""What every drafter store shares: argument checks, the token encoding, the key layout.

Tokens travel to Redis and are stored as big-endian uint32 (struct ">I"), so Lua reads them
with struct.unpack('>I4'). Every key of a session carries the session id as a Redis Cluster hash
tag, `<prefix>:{<session>}:<name>`, so that one script can touch all of them.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence

MAX_TTL_S = 30 * 24 * 3600
MAX_CONTEXTS = 2**31 - 1  # a shared memory's contexts (a Lua number counts them exactly)
MAX_SESSION_ID_LENGTH = 256
TOKEN_LIMIT = 2**32


class SessionNotFound(KeyError):
    """propose() on a session that was never started, has ended, or has expired."""


def checked_int(name: str, value: int, lowest: int, highest: int) -> int:
    try:
        value = operator.index(value)  # ints and int-likes such as numpy integers
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None
    if not lowest <= value <= highest:
        raise ValueError(f"{name} must be in [{lowest}, {highest}], got {value}")
    return value


def pack_tokens(name: str, tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f">{len(tokens)}I", *tokens)
    except struct.error as error:
        bad = next((t for t in tokens if not _is_token(t)), None)
        raise ValueError(f"{name} must hold token ids in [0, {TOKEN_LIMIT}), found {bad!r}") from error


def unpack_tokens(packed: bytes) -> list[int]:
    return list(struct.unpack(f">{len(packed) // 4}I", packed))


def checked_prefix(key_prefix: str) -> str:
    if not isinstance(key_prefix, str) or not key_prefix or "{" in key_prefix or "}" in key_prefix:
        raise ValueError(f"key_prefix must be a non-empty string without braces, got {key_prefix!r}")
    return key_prefix


def hash_tag(key_prefix: str, name: str, what: str = "session_id") -> str:
    """`<prefix>:{<name>}`: the common start of the keys that must share a cluster slot."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_SESSION_ID_LENGTH:
        raise ValueError(f"{what} must be a string of 1 to {MAX_SESSION_ID_LENGTH} characters")
    if "{" in name or "}" in name:
        raise ValueError(f"{what} must not contain braces (it is a Redis hash tag): {name!r}")
    return f"{key_prefix}:{{{name}}}"


def _is_token(value) -> bool:
    try:
        return 0 <= operator.index(value) < TOKEN_LIMIT
    except TypeError:
        return False
