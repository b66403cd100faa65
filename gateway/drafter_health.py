"""What keeps a drafter that hangs, or answers nonsense, off every request's critical path.

A drafter (or its Redis) that is alive but does not answer costs each call its whole timeout.
Three things bound what that costs the requests:

- each request stops asking after one call that cost a timeout (DraftSession, gateway/drafting.py);
- `DrafterBreaker`, shared by the gateway's requests: after `threshold` such calls in a row (no
  answer in between) new requests do not ask that drafter at all for `open_s`; then they ask
  again, and the first one that is answered closes it;
- `Background`: EndSession (with the waits it needs first: the start, a probe still out) runs off
  the request, on a few threads of its own with their own timeouts, so that no reply waits for it.

`check_tree` refuses a drafted tree the verifier would refuse (a token outside the vocabulary, a
parent that is not an earlier node, lengths that differ): such a step runs plain, so a faulty
drafter costs drafting, never the client's request. (A tree larger than asked is only cut: every
prefix of a well-formed tree is a tree.)
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Sequence

from pardec.runtime.errors import PardecError, Unavailable

if TYPE_CHECKING:
    from pardec.gateway.backends import DrafterBackend

log = logging.getLogger(__name__)

# Calls in a row that cost a timeout before new requests stop asking the drafter.
BREAKER_THRESHOLD = 2
# How long new requests then leave it alone before one asks again.
BREAKER_OPEN_S = 5.0
# Threads that end drafting sessions; and how many ends may wait for one before newer ones are
# dropped (a dropped session's state expires in Redis after the drafter's session TTL).
END_THREADS = 4
END_RETRY_S = 1.0  # before an EndSession the drafter did not answer is asked once more
MAX_PENDING_ENDS = 256


class DrafterBreaker:
    def __init__(self, threshold: int = BREAKER_THRESHOLD, open_s: float = BREAKER_OPEN_S,
                 clock: Callable[[], float] = time.monotonic):
        self._threshold, self._open_s, self._clock = threshold, open_s, clock
        self._lock = threading.Lock()
        self._timeouts = 0  # calls in a row that cost a timeout
        self._open_until = 0.0

    def allows(self) -> bool:
        """Whether a request may ask the drafter now."""
        return self._clock() >= self._open_until

    def answered(self) -> None:
        with self._lock:
            self._timeouts = 0
            self._open_until = 0.0

    def timed_out(self) -> None:
        with self._lock:
            self._timeouts += 1
            if self._timeouts >= self._threshold:
                if self._clock() >= self._open_until:
                    log.warning("drafter: %d calls in a row without an answer; new requests run plain for %.1fs",
                                self._timeouts, self._open_s)
                self._open_until = self._clock() + self._open_s


class Background:
    """A small pool for the drafter's housekeeping calls, which no reply waits for."""

    def __init__(self, threads: int = END_THREADS, max_pending: int = MAX_PENDING_ENDS):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="drafter-end")
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, task: Callable[[], None]) -> threading.Event | None:
        """Runs ``task`` on the pool; the event is set when it is done. None: dropped (too many
        waiting)."""
        with self._lock:
            if self._pending >= self._max_pending:
                return None
            self._pending += 1
        done = threading.Event()

        def run():
            try:
                task()
            except Exception as error:  # best effort: state left behind expires on its own
                log.warning("drafter: ending a session failed: %s", error)
            finally:
                with self._lock:
                    self._pending -= 1
                done.set()

        self._pool.submit(run)
        return done


def end_session(
    client: DrafterBackend, session_id: str, started: Future | None, in_flight: Sequence[Future],
    tokens: Sequence[int],
) -> None:
    """Ends a drafter session once its calls are done (a start still running would recreate
    what the end deletes; a propose in flight could outlive it), handing it `tokens`. A drafter
    that did not answer (paused, restarting) is asked once more a moment later: an end is safe to
    repeat (the session is gone: nothing is recorded twice), and a session left behind would
    hold its keys until they expire."""
    if started is not None:
        try:
            client.wait_started(started, None)
        except PardecError:
            pass
    for future in in_flight:
        future.exception()
    try:
        client.end_session(session_id, tokens)
    except Unavailable:
        time.sleep(END_RETRY_S)
        client.end_session(session_id, tokens)


def check_tree(tokens: Sequence[int], parents: Sequence[int], probabilities: Sequence[float], vocab_size: int) -> str:
    """Why a drafted tree cannot be verified ("" if it can). ``vocab_size`` 0: unknown.
    ``probabilities`` may be empty (a drafter without estimates), else one per token.

    >>> check_tree([5, 6], [-1, 0], [0.5, 0.2], 10)
    ''
    >>> check_tree([5, 12], [-1, 0], [], 10)
    'tree.token_ids[1]: 12 is outside the vocabulary [0, 10)'
    >>> check_tree([5, 6], [-1, 1], [], 10)
    'tree.parents[1]: 1 is not -1 or an earlier node'
    >>> check_tree([5, 6], [-1], [], 10)
    'tree: 2 tokens but 1 parents'
    >>> check_tree([5, 6], [-1, 0], [0.5], 10)
    'accept_probabilities: 1 for 2 tokens'
    """
    if len(tokens) != len(parents):
        return f"tree: {len(tokens)} tokens but {len(parents)} parents"
    if probabilities and len(probabilities) != len(tokens):
        return f"accept_probabilities: {len(probabilities)} for {len(tokens)} tokens"
    for node, (token, parent) in enumerate(zip(tokens, parents)):
        if vocab_size and not 0 <= token < vocab_size:
            return f"tree.token_ids[{node}]: {token} is outside the vocabulary [0, {vocab_size})"
        if not -1 <= parent < node:
            return f"tree.parents[{node}]: {parent} is not -1 or an earlier node"
    return ""
