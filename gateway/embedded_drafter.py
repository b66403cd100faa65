"""Drafting inside the gateway's process: the drafter's core on the same Redis, no drafter hop.

A drafter replica's own work on a Propose (mostly the Redis script) is the smaller part of what
the gateway waits for it over gRPC: the rest is two Python gRPC stacks (docs/benchmarks.md,
"Figures behind design choices"). `EmbeddedDrafter` is a DrafterBackend (backends.py), as
`DrafterClient` is, and runs `drafter.core.Drafter` here instead. Sessions still live in Redis, so the gateway stays
stateless; drafter replicas remain the way to take drafting's CPU off the gateway's machine.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence

import redis

from pardec.drafter.config import DrafterConfig
from pardec.drafter.core import Drafter, draft_params
from pardec.gateway.deadlines import Deadline, TimedOut
from pardec.runtime.draft_params import DraftParams, split_new_tokens
from pardec.runtime.errors import PardecError, Unavailable

log = logging.getLogger(__name__)

# StartSessions (they overlap the prefill) and probes (beside a forward) run on these threads.
BACKGROUND_THREADS = 8


class EmbeddedDrafter:
    """``timeout_s`` bounds StartSession and EndSession, ``propose_timeout_s`` each Propose, as
    a socket timeout on every Redis reply: a Redis that misses it fails the call UNAVAILABLE,
    which the generation loop treats as a drafter absent for that step."""

    def __init__(self, config: DrafterConfig, timeout_s: float, propose_timeout_s: float | None = None):
        self._sessions = Drafter(config, timeout_s)
        self._steps = Drafter(config, propose_timeout_s or timeout_s)
        self._background = ThreadPoolExecutor(BACKGROUND_THREADS, thread_name_prefix="embedded-drafter")

    def start_session(
        self, session_id: str, prompt: Sequence[int], params: DraftParams,
        client_session_id: str = "", shared_memory: str = "",
    ) -> Future:
        """Starts building the session's state in the background; returns at once."""
        # Checked as a replica checks a StartSession's DraftConfig, so both refuse alike.
        settings = draft_params(**dataclasses.asdict(params))
        return self._background.submit(
            _as_pardec_errors, self._sessions.start_session, session_id, list(prompt), settings,
            client_session_id, shared_memory,
        )

    def wait_started(self, started: Future, timeout_s: float | None = None) -> bool:
        """True once the session is started, False if it is still starting after ``timeout_s``."""
        try:
            started.result(timeout=timeout_s)
        except FutureTimeout:
            return False
        return True

    def propose(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int,
        last_node_argmax: Sequence[int] = (), verified_depth: int | None = None, deadline: Deadline | None = None,
        committed_length: int = -1,
    ) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, accept probabilities) of the next tree, best first. Redis's socket
        timeout (the propose timeout) bounds it: a per-call timeout would need a thread hop on
        the step's critical path, which is what drafting here saves."""
        if deadline is not None:
            deadline.check()
        return _as_pardec_errors(
            self._propose, session_id, new_tokens, max_nodes, max_depth, last_node_argmax, verified_depth,
            committed_length,
        )

    def propose_future(
        self, session_id: str, new_tokens: Sequence[int], max_nodes: int, max_depth: int,
        last_node_argmax: Sequence[int] = (), verified_depth: int | None = None, deadline: Deadline | None = None,
        committed_length: int = -1,
    ) -> Future:
        """Propose in the background (`proposal` reads it)."""
        if deadline is not None:
            deadline.check()
        return self._background.submit(
            _as_pardec_errors, self._propose, session_id, list(new_tokens), max_nodes, max_depth,
            list(last_node_argmax), verified_depth, committed_length,
        )

    def proposal(self, future: Future) -> tuple[list[int], list[int], list[float]]:
        return future.result()

    def end_session(self, session_id: str, new_tokens: Sequence[int] = ()) -> None:
        """``new_tokens``: committed since the last Propose, for the session's memories."""
        _as_pardec_errors(self._sessions.end_session, session_id, new_tokens)

    def close(self) -> None:
        self._background.shutdown(wait=True)
        self._sessions.close()
        self._steps.close()

    def _propose(self, session_id, new_tokens, max_nodes, max_depth, last_node_argmax, verified_depth,
                 committed_length=-1):
        heads, new_tokens = split_new_tokens(new_tokens)
        held = committed_length - len(new_tokens) - sum(map(len, heads))  # before the first call
        for head in heads:
            held += len(head)
            self._steps.propose(session_id, head, [], 0, 0, 0, held if committed_length >= 0 else -1)
        depth = -1 if verified_depth is None else verified_depth
        return self._steps.propose(session_id, new_tokens, last_node_argmax, max_nodes, max_depth, depth,
                                   committed_length)


def _as_pardec_errors(call: Callable, *args):
    """call(*args); an unexpected failure becomes a PardecError, as a replica's INTERNAL status
    does through DrafterClient, so that it costs the request its drafting, not its output."""
    try:
        return call(*args)
    except Unavailable as error:
        if isinstance(error.__cause__, redis.exceptions.TimeoutError):  # Redis hangs: as a missed deadline
            raise TimedOut(str(error)) from error
        raise
    except PardecError:
        raise
    except Exception as error:
        log.exception("embedded drafter failed")
        raise PardecError(f"drafter: {error}") from error
