"""memory_decoding: draft token trees from n-grams of the session's own text, stored in Redis.

After alipay's PainlessInferenceAcceleration (lookahead) and Huawei MindIE's memory decoding.
Each session owns a trie of the n-grams of its tokens (the prompt, then every committed token).

Insertion. For every position i of the sequence t, the path t[i], t[i+1], ..., t[i+branch_length]
(shorter at the end of the sequence) goes into the trie, and every node on it gets +1. Counting
happens when a node's *last* token arrives: node (i, depth) is counted once, by the token at
i + depth - 1, which is why appending tokens later gives exactly the trie of the whole sequence.
That token also decides the kind of the count: `prompt` if it is a prompt token, `output` if it
was generated. So a path that starts in the prompt and runs into the output counts as output from
its first generated token on: its prompt-only prefix was already counted as prompt evidence.

Retrieval. The query is the last two committed tokens (a, b): start at the node for [a, b], or at
the node for [b] when [a, b] has never been continued. Candidates are that node's descendants;
each has score = product along its path of weight / (total weight of it and its siblings), with
weight = prompt_count * PROMPT_WEIGHT + output_count. The tree grows best-first: take the highest
scoring candidate (ties: siblings by higher weight then lower token, otherwise the candidate whose
parent was taken first) until max_nodes are taken, never deeper than max_depth (the query node's
children have depth 1). The result lists a parent before its children: `tokens`, and `parents`
as indexes into it (-1: a child of the query node).

Worked example, branch_length 3, one prompt [1, 2, 3, 1, 2, 4, 1, 2]: the paths are
[1,2,3,1] [2,3,1,2] [3,1,2,4] [1,2,4,1] [2,4,1,2] [4,1,2] [1,2] [2]. Query (1, 2): the node [1, 2]
has children 3 and 4 (weight 4 each, score 1/2 each; 3 first, lower token). [1,2,3] has the one
child 1 (score 1/2 * 4/4), and so does [1,2,4]; paths hold 4 tokens, so the tree stops there:

    >>> store.start_session("s", [1, 2, 3, 1, 2, 4, 1, 2])   # a store with branch_length=3
    >>> store.propose("s", [], max_nodes=16, max_depth=8)
    ([3, 4, 1, 1], [-1, -1, 0, 1])

Each call is one Redis round trip: a Lua script (memory_decoding.lua, which details the encoding)
appends the tokens, inserts the new paths and grows the tree server-side. A session has three keys,
with its id as a hash tag so that they share a Redis Cluster slot, all expiring `ttl_s` after the
session's last call:

    pardec:{<session>}:trie    hash, a field per node that can have children:
                               (parent id, token) -> node id, then (token, prompt, output) per child
    pardec:{<session>}:tokens  the committed tokens
    pardec:{<session>}:state   branch_length (fixed at start), next node id, the active nodes
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence
from importlib import resources

import redis

# A continuation seen in the prompt counts as much as one seen 4 times in the generated text.
# Prompt n-grams are what the answer is most likely to copy (code edits, summaries, RAG quotes),
# while the output's own n-grams are few early on and noisy; 4 still lets a pattern the model
# keeps repeating overtake a single prompt occurrence.
PROMPT_WEIGHT = 4

MAX_BRANCH_LENGTH = 64
MAX_TREE_NODES = 1024
# No tree grows past branch_length, so a larger max_depth (e.g. "the tokens still to generate") is
# harmless; the bound only keeps the value a sane integer.
MAX_TREE_DEPTH = 2**31 - 1
MAX_TTL_S = 30 * 24 * 3600
MAX_SESSION_ID_LENGTH = 256
# Tokens travel and are stored as big-endian uint32.
_TOKEN_LIMIT = 2**32

_SCRIPT = resources.files("drafter").joinpath("memory_decoding.lua").read_text()


class SessionNotFound(KeyError):
    """propose() on a session that was never started, has ended, or has expired."""


class MemoryDecodingStore:
    def __init__(
        self, client: redis.Redis, *, ttl_s: int = 600, branch_length: int = 12, key_prefix: str = "pardec"
    ):
        self._client = client
        self.ttl_s = _checked_int("ttl_s", ttl_s, 1, MAX_TTL_S)
        self.branch_length = _checked_int("branch_length", branch_length, 1, MAX_BRANCH_LENGTH)
        if not isinstance(key_prefix, str) or not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key_prefix must be a non-empty string without braces, got {key_prefix!r}")
        self.key_prefix = key_prefix
        self._script = client.register_script(_SCRIPT)

    def start_session(self, session_id: str, prompt_tokens: Sequence[int]) -> None:
        """Create the session from its prompt, replacing any state under the same id."""
        keys = self._keys(session_id)
        packed = _pack_tokens("prompt_tokens", prompt_tokens)
        self._script(keys=keys, args=["start", self.ttl_s, packed, self.branch_length])

    def propose(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int
    ) -> tuple[list[int], list[int]]:
        """Append `new_tokens` (committed since the last call), then return (tokens, parents) of
        the next draft tree; empty when max_nodes or max_depth is 0."""
        keys = self._keys(session_id)
        packed = _pack_tokens("new_tokens", new_tokens)
        max_nodes = _checked_int("max_nodes", max_nodes, 0, MAX_TREE_NODES)
        max_depth = _checked_int("max_depth", max_depth, 0, MAX_TREE_DEPTH)
        flat = self._script(keys=keys, args=["propose", self.ttl_s, packed, max_nodes, max_depth, PROMPT_WEIGHT])
        if flat is None:
            raise SessionNotFound(session_id)
        return list(flat[0::2]), list(flat[1::2])

    def end_session(self, session_id: str) -> None:
        """Delete the session's keys; ending an unknown session is not an error."""
        self._client.delete(*self._keys(session_id))

    def _keys(self, session_id: str) -> list[str]:
        if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_LENGTH:
            raise ValueError(f"session_id must be a string of 1 to {MAX_SESSION_ID_LENGTH} characters")
        if "{" in session_id or "}" in session_id:
            raise ValueError(f"session_id must not contain braces (it is a Redis hash tag): {session_id!r}")
        # Order matters: memory_decoding.lua reads them as KEYS[1..3].
        tag = f"{self.key_prefix}:{{{session_id}}}"
        return [f"{tag}:trie", f"{tag}:tokens", f"{tag}:state"]


def _checked_int(name: str, value: int, lowest: int, highest: int) -> int:
    try:
        value = operator.index(value)  # ints and int-likes such as numpy integers
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None
    if not lowest <= value <= highest:
        raise ValueError(f"{name} must be in [{lowest}, {highest}], got {value}")
    return value


def _pack_tokens(name: str, tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f">{len(tokens)}I", *tokens)
    except struct.error as error:
        bad = next((t for t in tokens if not _is_token(t)), None)
        raise ValueError(f"{name} must hold token ids in [0, {_TOKEN_LIMIT}), found {bad!r}") from error


def _is_token(value) -> bool:
    try:
        return 0 <= operator.index(value) < _TOKEN_LIMIT
    except TypeError:
        return False
