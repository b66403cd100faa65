"""lookahead ("la") sessions in Redis: the Python face of lookahead.lua.

tests/references/lookahead.py describes the algorithm and is the reference the tests hold the
script to; lookahead.lua documents the encoding. A session has three keys, hash-tagged by its id so
that they share a Redis Cluster slot, all expiring `ttl_s` after the session's last call:

    pardec:{<session>}:la_state  hash: level, window, guess, levels (the Jacobi window), tail
                                 (last level-1 tokens), rows (where the previous tree's
                                 deepest window level sits in the verifier's argmax)
    pardec:{<session>}:la_pool   hash: key token -> up to `guess` continuations of level-1 tokens
    pardec:{<session>}:tokens    the committed tokens

Each step is one round trip (EVALSHA). A start learns its prompt START_CHUNK_TOKENS at a time,
one call each, so that other sessions' steps are served in between; until its last piece is in,
the session is not there for propose.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pardec.drafter.encoding import checked_int, hash_tag, pack_tokens
from pardec.runtime.draft_params import MAX_TREE_NODES, LookaheadParams

MAX_TREE_DEPTH = 2**31 - 1
# Redis runs one script at a time. Learning a token is cheap Lua, far cheaper than the trie's
# insert (16/16/16 the dearest), yet a long prompt in one call still stalled every other
# session's propose; 4096 tokens a call keep each stall short in few round trips. Figures:
# docs/benchmarks.md, "Figures behind design choices".
START_CHUNK_TOKENS = 4096


def lookahead_keys(key_prefix: str, session_id: str) -> list[str]:
    # Order matters: lookahead.lua reads them as KEYS[1..3].
    tag = hash_tag(key_prefix, session_id)
    return [f"{tag}:la_state", f"{tag}:la_pool", f"{tag}:tokens"]


def start_calls(prompt_tokens: Sequence[int], params: LookaheadParams, memory_tokens: Sequence[int] = ()) -> list[list]:
    """ARGV[2:] of each call of a start: "start" with the first piece, then "continue"s."""
    pieces = start_pieces(
        pack_tokens("prompt_tokens", prompt_tokens), pack_tokens("memory_tokens", memory_tokens), START_CHUNK_TOKENS
    )
    first, *rest = pieces
    start = ["start", *first, params.level, params.window, params.guess_set_size]
    return [start, *(["continue", *piece] for piece in rest)]


def start_pieces(packed_prompt: bytes, packed_memory: bytes, chunk_tokens: int) -> list[list]:
    """A session's start cut into script calls of at most `chunk_tokens` tokens, the memory
    (earlier output) first, then the prompt: Redis runs one script at a time, so a long prompt
    learned in one call would stall every other session. Each piece is the script's ARGV[3..7]:
    prompt part, memory part, memory_ends (1: the memory's last token is in this piece), the
    build id (the same for all pieces of this start) and more (1: pieces follow). There is
    always at least one piece; only the first is a "start", the others "continue"."""
    memory_tokens = len(packed_memory) // 4
    total = memory_tokens + len(packed_prompt) // 4
    build_id = uuid.uuid4().hex
    pieces = []
    for begin in range(0, max(total, 1), chunk_tokens):
        end = min(begin + chunk_tokens, total)
        memory_part = packed_memory[4 * begin : 4 * end]
        prompt_part = packed_prompt[4 * max(0, begin - memory_tokens) : 4 * max(0, end - memory_tokens)]
        pieces.append([prompt_part, memory_part, int(begin < memory_tokens <= end), build_id, int(end < total)])
    return pieces


def propose_args(new_tokens: Sequence[int], last_node_argmax: Sequence[int], max_nodes: int, max_depth: int) -> list:
    """ARGV[3:] of the script's "propose"."""
    return [
        pack_tokens("new_tokens", new_tokens),
        checked_int("max_nodes", max_nodes, 0, MAX_TREE_NODES),
        checked_int("max_depth", max_depth, 0, MAX_TREE_DEPTH),
        pack_tokens("last_node_argmax", last_node_argmax),
    ]
