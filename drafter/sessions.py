"""Every drafting session in Redis, whatever its algorithm: what the gRPC servicer talks to.

A session runs memory_decoding (drafter/trie.py) or lookahead (drafter/lookahead_store.py). Propose
does not say which, so one server-side script (sessions.lua, with both algorithms' scripts
inside) reads the session's meta key and dispatches: a step stays one round trip. Besides the
algorithm's own keys, a session has

    pardec:{<session>}:meta    hash: algorithm, prompt_length, conversation, shared

naming the memories (drafter/memory.py) the session reads at start and feeds at its end: a
conversation's earlier answers (multi-turn) and a memory shared by all sessions of one model.
A session that reads a shared memory costs a second round trip per step (the shared memory
lives in its own cluster slot).

Propose is idempotent when its caller says `committed_length` (prompt + every committed token,
this call's new ones included): a retried call whose first try did its work gets the same tree
and records nothing twice (sessions.lua says exactly what counts as a repeat).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from importlib import resources

import redis

from pardec.drafter import lookahead_store, trie
from pardec.drafter.encoding import (
    MAX_TTL_S,
    SessionNotFound,
    checked_int,
    checked_prefix,
    hash_tag,
    pack_tokens,
    unpack_tokens,
)
from pardec.drafter.memory import ConversationMemory, SharedMemory
from pardec.runtime.trees import merge_trees
from pardec.runtime.draft_params import LOOKAHEAD, DraftParams
from pardec.runtime.errors import FailedPrecondition

SCORE_SCALE = 1_000_000  # the scripts' scores arrive in millionths
# memory_decoding starts built and written at once by one process (trie.TrieImage): the build is
# Python under the GIL, so more at once would not finish sooner, only hold more memory (tens of
# MiB for a long prompt, a few hundred at MAX_PROMPT_TOKENS of text that never repeats).
BUILDS_AT_ONCE = 2
MAX_COMMITTED_LENGTH = 2**31 - 1


def _compose_script() -> str:
    """sessions.lua with the two algorithms' scripts inside as local functions."""
    folder = resources.files("pardec.drafter")
    parts = []
    for name, file in (("memory_decoding", "memory_decoding.lua"), ("lookahead", "lookahead.lua")):
        parts.append(f"local function {name}(KEYS, ARGV)\n{folder.joinpath(file).read_text()}\nend\n")
    parts.append(folder.joinpath("sessions.lua").read_text())
    return "\n".join(parts)


SCRIPT = _compose_script()


class SessionStore:
    def __init__(
        self,
        client: redis.Redis,
        *,
        ttl_s: int = 600,
        branch_length: int = 12,
        key_prefix: str = "pardec",
        conversation_ttl_s: int = 3600,
        shared_memory_contexts: int = 100_000,
    ):
        self._client = client
        self.ttl_s = checked_int("ttl_s", ttl_s, 1, MAX_TTL_S)
        self.branch_length = checked_int("branch_length", branch_length, 1, trie.MAX_BRANCH_LENGTH)
        self.key_prefix = checked_prefix(key_prefix)
        self._script = client.register_script(SCRIPT)
        self.conversations = ConversationMemory(client, ttl_s=conversation_ttl_s, key_prefix=key_prefix)
        self.shared = SharedMemory(
            client, branch_length=branch_length, max_contexts=shared_memory_contexts, key_prefix=key_prefix
        )
        self._builds = threading.BoundedSemaphore(BUILDS_AT_ONCE)

    def start_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        settings: DraftParams,
        *,
        conversation: str = "",
        shared: str = "",
    ) -> None:
        """Create the session, replacing any state under the same id. `conversation` (the
        client's session id) hands the conversation's earlier answers to the drafter; `shared`
        names a memory shared across requests (e.g. the model); empty: none."""
        keys = self._keys(session_id)
        if shared:
            self.shared.keys(shared)  # checks the name
        memory = self.conversations.read(conversation) if conversation else []
        meta = [settings.plugin_type, len(prompt_tokens), conversation, shared]
        if settings.plugin_type == LOOKAHEAD:
            self._start(keys, meta, lookahead_store.start_calls(prompt_tokens, settings.lookahead, memory))
            return
        dynamic_max = settings.decoding_length if settings.dynamic_algo else 0
        with self._builds:  # the trie's image lives until its last piece is written
            self._start(keys, meta, trie.start_calls(prompt_tokens, self.branch_length, dynamic_max, memory))

    def _start(self, keys: list[str], meta: list, calls: Iterable[list]) -> None:
        # The algorithm's start comes in pieces (one call each, so that other sessions' calls
        # run in between); the first also writes the meta key.
        calls = iter(calls)
        _, *first = next(calls)
        self._script(keys=keys, args=["start", self.ttl_s, *meta, *first])
        for command, *args in calls:
            if not self._script(keys=keys, args=[command, self.ttl_s, *args]):
                return  # ended, or started again, by another call meanwhile: that call's state stands

    def propose(
        self, session_id: str, new_tokens: Sequence[int], last_node_argmax: Sequence[int], max_nodes: int,
        max_depth: int,
    ) -> tuple[list[int], list[int]]:
        """(tokens, parents) of `propose_scored`."""
        tokens, parents, _ = self.propose_scored(session_id, new_tokens, last_node_argmax, max_nodes, max_depth)
        return tokens, parents

    def propose_scored(
        self,
        session_id: str,
        new_tokens: Sequence[int],
        last_node_argmax: Sequence[int],
        max_nodes: int,
        max_depth: int,
        verified_depth: int = -1,
        committed_length: int = -1,
    ) -> tuple[list[int], list[int], list[float]]:
        """Record the newly committed tokens (and, for lookahead, the previous tree's argmax),
        then return (tokens, parents, scores) of the next tree: each node's estimated probability
        of ending up on the accepted path, non-increasing, parents first, so every prefix is a
        tree. `verified_depth`: how deep the gateway verified the previous tree (dynamic_algo
        measures its hit ratio against it); -1: all of it. `committed_length`: the session's
        tokens once `new_tokens` are in, the key that makes a repeated call return the same tree
        without recording anything again; -1: not said (every call records its tokens)."""
        keys = self._keys(session_id)
        args = trie.propose_args(new_tokens, max_nodes, max_depth, verified_depth)
        packed_new, max_nodes, max_depth, prompt_weight, verified_depth = args
        argmax = pack_tokens("last_node_argmax", last_node_argmax)
        committed_length = checked_int("committed_length", committed_length, -1, MAX_COMMITTED_LENGTH)
        try:
            reply = self._script(
                keys=keys,
                args=["propose", self.ttl_s, packed_new, max_nodes, max_depth, argmax, prompt_weight, verified_depth,
                      committed_length],
            )
        except redis.exceptions.ResponseError as error:
            if str(error).startswith("committed_length:"):
                raise FailedPrecondition(str(error)) from error
            raise
        if reply is None:
            raise SessionNotFound(session_id)
        flat, scores, budget, shared, last_tokens, algorithm = reply
        tokens, parents = list(flat[0::2]), list(flat[1::2])
        own_scores = [score / SCORE_SCALE for score in scores]
        if not shared:
            return tokens, parents, own_scores
        found = self.shared.propose(shared.decode(), unpack_tokens(last_tokens), budget, max_depth)
        # Both trees' scores are path probabilities, so the union is cut by score; a lookahead
        # tree keeps its layout (its window rows index the verifier's argmax) and takes what is
        # left, its scores then capped so that they stay non-increasing.
        is_lookahead = algorithm == LOOKAHEAD.encode()
        return merge_trees((tokens, parents, own_scores), found, budget, keep_order=is_lookahead)
    def end_session(self, session_id: str, new_tokens: Sequence[int] = ()) -> None:
        """Delete the session, handing its output to its memories, `new_tokens` (committed since
        the last propose) included; ending an unknown session is not an error."""
        packed_new = pack_tokens("new_tokens", new_tokens)
        reply = self._script(keys=self._keys(session_id), args=["end", self.ttl_s, packed_new])
        outputs, conversation, shared, lead_in = reply
        if not outputs:
            return
        if conversation:
            self.conversations.append(conversation.decode(), outputs)
        if shared:
            # With the prompt's last two tokens, the answer's first tokens have a context too.
            self.shared.learn(shared.decode(), lead_in + outputs)

    def _keys(self, session_id: str) -> list[str]:
        md = trie.memory_decoding_keys(self.key_prefix, session_id)
        la = lookahead_store.lookahead_keys(self.key_prefix, session_id)
        # Order matters: sessions.lua reads them as KEYS[1..6]; both algorithms share `tokens`.
        return [f"{hash_tag(self.key_prefix, session_id)}:meta", *md, la[0], la[1]]
