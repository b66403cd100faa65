"""One algorithm's sessions in Redis without SessionStore's dispatch: each runs its own script
(memory_decoding.lua, lookahead.lua) on drafter/trie.py's and drafter/lookahead_store.py's
arguments, so that the tests can hold one script at a time to its reference. The service runs
both inside sessions.lua (drafter/sessions.py)."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources

import redis

from pardec.drafter.encoding import MAX_TTL_S, SessionNotFound, checked_int, checked_prefix
from pardec.drafter.lookahead_store import lookahead_keys, start_calls as lookahead_start_calls
from pardec.drafter.lookahead_store import propose_args as lookahead_propose_args
from pardec.drafter.trie import MAX_BRANCH_LENGTH, memory_decoding_keys, propose_args, start_calls
from pardec.runtime.draft_params import LookaheadParams


def _lua(name: str) -> str:
    return resources.files("pardec.drafter").joinpath(name).read_text()


class MemoryDecodingStore:
    def __init__(
        self, client: redis.Redis, *, ttl_s: int = 600, branch_length: int = 12, key_prefix: str = "pardec"
    ):
        self._client = client
        self.ttl_s = checked_int("ttl_s", ttl_s, 1, MAX_TTL_S)
        self.branch_length = checked_int("branch_length", branch_length, 1, MAX_BRANCH_LENGTH)
        self.key_prefix = checked_prefix(key_prefix)
        self._script = client.register_script(_lua("memory_decoding.lua"))

    def start_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        *,
        dynamic_max_length: int = 0,
        memory_tokens: Sequence[int] = (),
    ) -> None:
        """Create the session from its prompt, replacing any state under the same id.
        dynamic_max_length > 0 turns dynamic_algo on (tests/references/adaptive.py) with that bound;
        `memory_tokens` (earlier output) are learned as output evidence before the prompt."""
        keys = self._keys(session_id)
        for command, *args in start_calls(prompt_tokens, self.branch_length, dynamic_max_length, memory_tokens):
            if not self._script(keys=keys, args=[command, self.ttl_s, *args]):
                return  # ended, or started again, by another call meanwhile: that call's state stands

    def propose(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int
    ) -> tuple[list[int], list[int]]:
        """Append `new_tokens` (committed since the last call), then return (tokens, parents) of
        the next draft tree; empty when max_nodes or max_depth is 0."""
        keys = self._keys(session_id)
        flat = self._script(keys=keys, args=["propose", self.ttl_s, *propose_args(new_tokens, max_nodes, max_depth)])
        if flat is None:
            raise SessionNotFound(session_id)
        return list(flat[0::2]), list(flat[1::2])

    def end_session(self, session_id: str) -> None:
        """Delete the session's keys; ending an unknown session is not an error."""
        self._client.unlink(*self._keys(session_id))

    def _keys(self, session_id: str) -> list[str]:
        return memory_decoding_keys(self.key_prefix, session_id)


class LookaheadStore:
    def __init__(self, client: redis.Redis, *, ttl_s: int = 600, key_prefix: str = "pardec"):
        self._client = client
        self.ttl_s = checked_int("ttl_s", ttl_s, 1, MAX_TTL_S)
        self.key_prefix = checked_prefix(key_prefix)
        self._script = client.register_script(_lua("lookahead.lua"))

    def start_session(
        self, session_id: str, prompt_tokens: Sequence[int], params: LookaheadParams, memory_tokens: Sequence[int] = ()
    ) -> None:
        """Create the session from its prompt, replacing any state under the same id;
        `memory_tokens` (earlier output) are learned first."""
        keys = lookahead_keys(self.key_prefix, session_id)
        for command, *args in lookahead_start_calls(prompt_tokens, params, memory_tokens):
            if not self._script(keys=keys, args=[command, self.ttl_s, *args]):
                return  # ended, or started again, by another call meanwhile: that call's state stands

    def propose(
        self,
        session_id: str,
        new_tokens: Sequence[int],
        last_node_argmax: Sequence[int],
        max_nodes: int,
        max_depth: int,
    ) -> tuple[list[int], list[int]]:
        """Learn from the previous tree's argmax and the newly committed tokens, then return
        (tokens, parents) of the next tree."""
        keys = lookahead_keys(self.key_prefix, session_id)
        args = lookahead_propose_args(new_tokens, last_node_argmax, max_nodes, max_depth)
        reply = self._script(keys=keys, args=["propose", self.ttl_s, *args])
        if reply is None:
            raise SessionNotFound(session_id)
        flat = reply[0]  # then the scores, which SessionStore reads
        return list(flat[0::2]), list(flat[1::2])

    def end_session(self, session_id: str) -> None:
        """Delete the session's keys; ending an unknown session is not an error."""
        self._client.unlink(*lookahead_keys(self.key_prefix, session_id))
