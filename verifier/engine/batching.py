"""Continuous batching: the work the engine thread drains, and how one forward's tokens are shared.

Callers (gRPC worker threads) put work on a `WorkQueue` and block on its future; the engine
thread takes whatever is queued, waits a little for stragglers (`batch_wait_ms`), and runs one
forward for all of it. A step's cost on a CPU is dominated by streaming the weights once, so
16 sessions' steps in one forward cost far less than 16 forwards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from pardec.runtime.errors import PardecError
from pardec.verifier.api import Sampling, TokenLogprob
from pardec.verifier.engine.acceptance import StepLayout, token_logprobs
from pardec.verifier.model.kvcache import PagedCache

log = logging.getLogger(__name__)


@dataclass
class Work:
    future: Future = field(default_factory=Future, init=False)
    arrived: float = field(default_factory=time.monotonic, init=False)


@dataclass
class CallWork(Work):
    """Anything else that must run on the engine thread (release, stats)."""

    fn: Callable[[], object]


@dataclass
class VerifyWork(Work):
    session_id: str
    tokens: Sequence[int]
    layout: StepLayout  # validated by the caller; the root token is filled in on the engine thread
    masked: object | None = None  # under a language or rules that narrow it: the grammar.MaskedTree computed instead

    @property
    def steps(self) -> int:
        return len(self.tokens) + 1


@dataclass
class PrefillWork(Work):
    session_id: str
    tokens: Sequence[int]
    sampling: Sampling
    generator: torch.Generator | None
    cache: PagedCache | None = None  # set on admission
    done: int = 0  # prompt tokens already in the cache
    cached: int = 0  # of those, found in the prefix cache at admission
    started: float = 0.0
    max_new_tokens: int = 0  # what the caller may generate (0: not said); admission promises it room
    deadline: float = 0.0  # time.monotonic() until which it may wait for the pool's promise
    cache_scope: str = ""  # who may share its cached blocks (prefix_cache.py)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # where sampling asks for them
    generated: int = 0  # of tokens, the last ones generated before (a resumed session)
    matcher: object | None = None  # the structured output's grammar.LanguageMatcher, past those
    priority: int = 0  # lower goes first where the engine must choose (vLLM's)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done

    @property
    def scores_prompt(self) -> bool:
        """Whether every prompt row's logits are wanted (each scores the prompt's next token)."""
        return self.sampling.prompt_logprobs is not None

    def score_prompt(self, logits: torch.Tensor) -> torch.Tensor:
        """Keeps the log-probabilities of the prompt tokens that the rows of the chunk just
        computed predict (row i: the token after it); the last row's logits, which give the
        first generated token at the prompt's end. Called before ``done`` moves past the chunk."""
        following = self.tokens[self.done + 1 : self.done + 1 + logits.shape[0]]
        self.prompt_logprobs += token_logprobs(logits, range(len(following)), following, self.sampling.prompt_logprobs)
        return logits[-1:]


class WorkQueue:
    """Thread-safe FIFO of Work with a condition the engine thread sleeps on."""

    def __init__(self):
        self._cond = threading.Condition()
        self._items: deque[Work] = deque()
        self.closed = False

    @property
    def depth(self) -> int:
        return len(self._items)

    def put(self, work: Work) -> Future:
        with self._cond:
            if self.closed:
                raise RuntimeError("the verifier engine is shut down")
            self._items.append(work)
            self._cond.notify()
        return work.future

    def take(
        self, idle_timeout: float, busy: bool, wait_s: float, budget: int, ready: Callable[[list[Work]], bool],
        not_before: float = 0.0,
    ):
        """Everything queued, once there is something to do.

        Sleeps up to `idle_timeout` while there is nothing (and the engine is not `busy` with a
        prompt), then holds the queue up to `wait_s` after the oldest item's arrival, or after
        `not_before` (time.monotonic()) if later, for more to come, unless the queued steps
        already fill `budget` tokens or `ready(items)` says nobody else is coming.

        `not_before` is when the previous forward's results went out: the steps that missed
        that forward arrived while it ran, and counting their wait from their own arrival
        would send them off alone the moment it ends, before the sessions it just served can
        come back. The two groups would then alternate in half-size forwards for good (seen
        at 16 requests in flight: 7.5 of 16 sessions per forward with drafting, whose round
        trip to the drafter widens the gap)."""
        with self._cond:
            if not self._items and not busy and not self.closed:
                self._cond.wait(idle_timeout)
            if self._items and wait_s > 0:
                deadline = max(self._items[0].arrived, not_before) + wait_s
                while not self.closed:
                    left = deadline - time.monotonic()
                    if left <= 0 or _queued_tokens(self._items) >= budget or ready(list(self._items)):
                        break
                    self._cond.wait(left)
            items = list(self._items)
            self._items.clear()
            return items

    def close(self) -> list[Work]:
        with self._cond:
            self.closed = True
            items = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return items


def _queued_tokens(items) -> int:
    return sum(w.steps if isinstance(w, VerifyWork) else len(w.tokens) for w in items if not isinstance(w, CallWork))


def plan(
    verify_steps: Sequence[int], prefill_remaining: Sequence[int], budget: int, max_sessions: int
) -> tuple[int, list[int]]:
    """Shares one forward's token budget: (how many queued verifies to take, in order, and the
    chunk of each in-progress prompt, in order; 0 = not this time).

    Verify steps go first: each is a waiting client's next token. A quarter of the budget is
    kept for prompts while one is pending, so a stream of verify steps cannot starve a prefill,
    and a prefill chunk cannot hold up decoding by more than the rest of the budget. A verify
    larger than the budget runs alone (it cannot be split); a prompt always gets some tokens.
    At most max_sessions sessions share a forward, one of them kept for a pending prompt
    (max_sessions 1 turns batching off: a pending prompt then goes before the verify steps).

    >>> plan([17, 17, 17], [], 40, 8)
    (2, [])
    >>> plan([17, 17, 17], [1000], 40, 8)
    (1, [23])
    >>> plan([600], [100, 100], 512, 8)
    (1, [100, 28])
    >>> plan([], [100, 1000], 512, 8)
    (0, [100, 412])
    >>> plan([1, 1], [1000], 512, 1)
    (0, [512])
    >>> plan([1, 1], [], 512, 1)
    (1, [])
    """
    share = max(1, budget // 4) if prefill_remaining else 0
    verify_slots = max_sessions - (1 if prefill_remaining else 0)
    used = taken = 0
    for steps in verify_steps:
        if taken == verify_slots or (taken and used + steps > budget - share):
            break
        used += steps
        taken += 1
    room, sessions = max(budget - used, share), taken
    chunks = []
    for remaining in prefill_remaining:
        chunk = min(remaining, room) if sessions < max_sessions else 0
        chunks.append(chunk)
        room -= chunk
        sessions += chunk > 0
    return taken, chunks


def settle(work: Work, fn, keep_open: bool = False) -> None:
    """Runs fn for one work item: its result or its error goes to the item's future. With
    keep_open, a success leaves the future pending (the item goes on to a forward)."""
    try:
        result = fn()
    except PardecError as error:
        work.future.set_exception(error)
    except Exception as error:  # not the caller's fault, but the caller must hear of it
        log.exception("engine work failed")
        work.future.set_exception(error)
    else:
        if not keep_open:
            work.future.set_result(result)
