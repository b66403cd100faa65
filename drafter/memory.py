"""Drafting memory across requests: a conversation's earlier answers, and a memory per model.

MindIE's memory_decoding "caches historical inputs and outputs of a model". Two memories, both
optional and both in Redis (memory.lua does the writes), so every replica sees them:

Conversation (multi-turn). A client that sends the same session id again gets its earlier
answers learned into the new session at start (as output evidence, before the prompt):

    pardec:{conversation:<id>}:outputs   the answers' tokens, the last MAX_CONVERSATION_TOKENS,
                                         expiring conversation_ttl_s after the last answer

Shared (cross-request). At its end a session feeds its output to a memory named by the client
(e.g. the model: sessions of different models must not share); each step of a session reading
it looks up the last two committed tokens there and merges what followed them before into the
session's own tree (one more round trip: the memory lives in its own cluster slot).

    pardec:{shared:<name>}:contexts   hash: two tokens -> up to MAX_ENTRIES continuations of up
                                      to branch_length tokens with counts, best first
    pardec:{shared:<name>}:recency    sorted set: context -> clock of its last update
    pardec:{shared:<name>}:clock      counter

Bounded: a context keeps MAX_ENTRIES continuations (the weakest, then least recent, drops out),
counts halve past COUNT_CAP (decay: new habits overtake old ones), and past max_contexts the
least recently updated contexts are evicted.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from importlib import resources

import redis

from pardec.drafter.encoding import MAX_CONTEXTS, checked_int, hash_tag, pack_tokens, unpack_tokens
from pardec.runtime.trees import ScoredTree, tree_of_paths

SCRIPT = resources.files("pardec.drafter").joinpath("memory.lua").read_text()
MAX_CONVERSATION_TOKENS = 8192
MAX_ENTRIES = 4
LEARN_PIECE_TOKENS = 4096  # contexts one script call counts (SharedMemory.learn)
COUNT_CAP = 16
SHARED_TTL_S = 7 * 24 * 3600


def update_entries(entries: list[list], continuation: tuple[int, ...], max_entries: int, count_cap: int) -> None:
    """Counts `continuation` in a context's entries ([count, tokens], best first). One that
    extends or is extended by it is the same evidence (the longer tokens are kept); entries
    stay ordered by count, the most recently counted first among equals; counts halve when
    one passes count_cap; the last entries beyond max_entries drop out.

    >>> entries = [[2, (5, 6, 7)], [1, (8,)]]
    >>> update_entries(entries, (8, 9), 3, 16); entries    # extends (8,): now tied, and newer
    [[2, (8, 9)], [2, (5, 6, 7)]]
    >>> update_entries(entries, (4,), 2, 16); entries      # new, and there is room for 2 only
    [[2, (8, 9)], [2, (5, 6, 7)]]
    >>> update_entries(entries, (5, 6), 2, 2); entries     # a count of 3 > cap 2: all halve
    [[1, (5, 6, 7)], [1, (8, 9)]]
    """
    found = None
    for index, (_, stored) in enumerate(entries):
        if stored[: len(continuation)] == continuation or continuation[: len(stored)] == stored:
            found = entries.pop(index)
            found[0] += 1
            if len(continuation) > len(stored):
                found[1] = continuation
            break
    found = found or [1, continuation]
    at = next((k for k, entry in enumerate(entries) if entry[0] <= found[0]), len(entries))
    entries.insert(at, found)
    if found[0] > count_cap:
        for entry in entries:
            entry[0] = max(1, entry[0] // 2)
    del entries[max_entries:]


def parse_entries(value: bytes | None) -> list[list]:
    entries, at = [], 0
    while value and at < len(value):
        count, length = struct.unpack_from(">II", value, at)
        entries.append([count, tuple(unpack_tokens(value[at + 8 : at + 8 + 4 * length]))])
        at += 8 + 4 * length
    return entries


def entries_tree(entries: list[list], max_nodes: int, max_depth: int) -> ScoredTree:
    """The continuations as one tree: a node's weight is the count through it, its score its
    parent's times weight / (the weight of it and its siblings + their number): Witten-Bell's
    escape, as the session's trie scores (drafter/trie.py), so that a context seen once does not
    claim certainty; best max_nodes nodes, by score, then depth (a parent before its child),
    then discovery.

    >>> entries_tree([[3, (8,)], [2, (5, 6)], [1, (5, 7)]], max_nodes=3, max_depth=8)
    ([8, 5, 6], [-1, -1, 1], [0.375, 0.375, 0.15])
    """
    nodes: dict[tuple[int, ...], list] = {}  # path -> [weight, discovery]
    for count, tokens in entries:
        for depth in range(1, min(len(tokens), max_depth) + 1):
            node = nodes.setdefault(tokens[:depth], [0, len(nodes)])
            node[0] += count
    sibling_total: dict[tuple[int, ...], int] = {}  # parent path -> its children's weight + their number
    for path, (weight, _) in nodes.items():
        sibling_total[path[:-1]] = sibling_total.get(path[:-1], 0) + weight + 1
    scores: dict[tuple[int, ...], float] = {}
    for path, (weight, _) in nodes.items():  # discovery order puts parents first
        scores[path] = scores.get(path[:-1], 1.0) * weight / sibling_total[path[:-1]]
    ranked = sorted(nodes, key=lambda path: (-scores[path], len(path), nodes[path][1]))[:max_nodes]
    return tree_of_paths(ranked, scores)


class ConversationMemory:
    def __init__(self, client: redis.Redis, *, ttl_s: int, key_prefix: str):
        self._client, self.ttl_s, self.key_prefix = client, ttl_s, key_prefix
        self._script = client.register_script(SCRIPT)

    def read(self, conversation: str) -> list[int]:
        return unpack_tokens(self._client.get(self._key(conversation)) or b"")

    def append(self, conversation: str, packed_tokens: bytes) -> None:
        args = ["append", packed_tokens, MAX_CONVERSATION_TOKENS, self.ttl_s]
        self._script(keys=[self._key(conversation)], args=args)

    def _key(self, conversation: str) -> str:
        return f"{hash_tag(self.key_prefix, f'conversation:{conversation}', what='conversation')}:outputs"


class SharedMemory:
    def __init__(self, client: redis.Redis, *, branch_length: int, max_contexts: int, key_prefix: str):
        self._client, self.branch_length, self.key_prefix = client, branch_length, key_prefix
        self.max_contexts = checked_int("max_contexts", max_contexts, 1, MAX_CONTEXTS)
        self._script = client.register_script(SCRIPT)

    def learn(self, name: str, packed_tokens: bytes) -> int:
        """Counts every continuation of every two-token context of the tokens; returns how
        many contexts were evicted to stay within max_contexts. A call of the script counts at
        most LEARN_PIECE_TOKENS contexts, so that a long answer does not hold Redis (and every
        other session's step) for the whole of it: each piece carries the two tokens before its
        first context and the continuations past its last one."""
        count, evicted = len(packed_tokens) // 4, 0
        for first in range(2, count, LEARN_PIECE_TOKENS):  # contexts end before tokens first .. last - 1
            last = min(first + LEARN_PIECE_TOKENS, count)
            piece = packed_tokens[4 * (first - 2):4 * min(last - 1 + self.branch_length, count)]
            args = ["learn", piece, self.branch_length, MAX_ENTRIES, self.max_contexts, COUNT_CAP, SHARED_TTL_S,
                    last - first]
            evicted += self._script(keys=self.keys(name), args=args)
        return evicted

    def propose(self, name: str, context: Sequence[int], max_nodes: int, max_depth: int) -> ScoredTree:
        """What followed the two `context` tokens before, as a scored tree."""
        if len(context) < 2 or max_nodes == 0 or max_depth == 0:
            return [], [], []
        value = self._client.hget(self.keys(name)[0], pack_tokens("context", context[-2:]))
        return entries_tree(parse_entries(value), max_nodes, max_depth)

    def keys(self, name: str) -> list[str]:
        tag = hash_tag(self.key_prefix, f"shared:{name}", what="shared")
        return [f"{tag}:contexts", f"{tag}:recency", f"{tag}:clock"]
