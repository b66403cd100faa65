"""One request's drafting, which can slow a request down but never fail it or change its output.

Drafts only propose: the verifier keeps exactly what the model itself would produce, with or
without a tree. So a drafter that is down, slow (misses ``propose_timeout_s``) or lost its Redis
just means that step runs with an empty tree, a plain step. A call that fails at once (a drafter
that is down refuses it, its Redis fails over) leaves the drafter alone for ``drafter_retry_s``,
twice as long after each refusal in a row (a dead one then costs a request a few calls in all,
one that comes back drafts again), and the tokens it missed are sent with the next call, so its
n-gram memory has no gap when it is back. A call that cost its whole timeout (a drafter or a Redis that hangs)
ends drafting for the request, so that a hang costs a request one propose timeout at most, and
tells the gateway's breaker (gateway/drafter_health.py). So does a session the drafter no longer
knows (Redis restarted, state expired), and a tree the verifier would refuse (`check_tree`).
EndSession runs in the background: no reply waits for a drafter that does not answer. With
`overlap` a session drafts the next step's tree while this one verifies (gateway/draft_ahead.py).

Each step verifies the prefix of the drafter's best-first tree that maximizes the session's
expected tokens per second (gateway/tree_sizing.py), possibly none of it; while no tree pays
for the drafter's round trip, steps run plain and the drafter is tried only now and then, after
a few tries beside a plain step, its tree scored against what the model then commits (a probe).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from concurrent.futures import Future
from typing import Callable, Sequence

from pardec.gateway.backends import DrafterBackend
from pardec.gateway.deadlines import Cancelled, Deadline, DeadlineExceeded, TimedOut, timeout_for
from pardec.gateway.draft_ahead import descend, within_depth
from pardec.gateway.drafter_health import Background, DrafterBreaker, check_tree, end_session
from pardec.runtime.draft_params import MAX_TREE_NODES, DraftParams
from pardec.gateway.config import GatewayConfig
from pardec.gateway.tree_sizing import (
    Calibration, CostCurve, DraftPacing, SessionCosts, accepted_nodes, best_prefix, score_shadow, tree_depth,
)
from pardec.runtime.errors import NotFound, PardecError

log = logging.getLogger(__name__)

# A probe's tree is at most this deep: its verdict is in once the path breaks or reaches a leaf.
PROBE_DEPTH = 4
# The longest a request leaves a drafter that keeps refusing its calls before asking again.
MAX_RETRY_S = 30.0
# A failed call that took at least this share of its timeout waited for an answer that never came.
SLOW_SHARE = 0.5


class DraftSession:
    def __init__(
        self, client: DrafterBackend, session_id: str, params: DraftParams, config: GatewayConfig,
        on_fallback: Callable[[str], None] = lambda reason: None, cost: CostCurve | None = None,
        clock: Callable[[], float] = time.perf_counter, *, breaker: DrafterBreaker | None = None,
        background: Background | None = None, vocab_size: int = 0, overlap: bool = False,
    ):
        self._client = client
        self._breaker = breaker  # the gateway's, shared by its requests
        self._background = background  # None: EndSession is sent in the caller's thread
        self._vocab_size = vocab_size  # what a drafted token must be under (0: unknown)
        self._healthy = True  # no call of this request went unanswered
        self._quick_failures, self._retry_at = 0, 0.0
        self._session_id, self.params = session_id, params
        self._retry_s, self._propose_timeout = config.drafter_retry_s, config.propose_timeout_s
        self._deadline: Deadline | None = None  # the request's, as its last propose said it
        self._waited = False
        self._on_fallback = on_fallback
        self._clock = clock  # seconds; times the drafter's round trip (bench.sizing_replay models it)
        self._started: Future | None = None
        self._pending: list[int] = []  # committed tokens the drafter has not recorded yet
        # Tokens the drafter's session holds (prompt and recorded), and those a call in flight (a
        # probe or an ahead call) carries: with the pending ones, every Propose's
        # committed_length, its idempotency key.
        self._held = self._carried = 0
        self.active = True  # False: no more drafting for this request
        self.opened = False  # StartSession was sent, so EndSession is owed
        self._deferred_start: tuple[Sequence[int], str, str] | None = None  # StartSession's, not sent yet
        # Tree sizing: the cost model and what this session has measured so far.
        self._policy = policy = config.load_policy
        # What this session's steps cost, for sizing its trees (the gateway tells it each step's).
        self.costs = SessionCosts(cost or CostCurve.from_points(()), policy, params.tokens_per_step)
        self._calibration = Calibration(policy.prior_ratio, policy.prior_mass, policy.calibration_decay)
        self._pacing = DraftPacing(policy.probe_every)
        # (tokens, parents, drafter's estimates) of the prefix the coming verify carries, or None.
        self._sent: tuple[list[int], list[int], list[float]] | None = None
        self.estimates: list[float] = []  # the calibrated estimate of each node of the tree `propose` gave
        # A probe in flight or awaiting its verdict: (future, tokens carried, tokens committed since).
        self._probe: tuple[Future, list[int], list[int]] | None = None
        # A probe's tree the model's tokens have not decided yet: (tokens, parents, estimates, since).
        self._unscored: tuple[list[int], list[int], list[float], list[int]] | None = None
        # Drafting ahead (gateway/draft_ahead.py): the whole tree this step's came from, rooted at its
        # root, and the ahead call drafting from there while it verifies (future, tokens carried).
        self._overlap = overlap
        self._base: tuple[list[int], list[int], list[float]] | None = None
        self._ahead_call: tuple[Future, list[int]] | None = None

    def start(
        self, prompt: Sequence[int], client_session_id: str = "", shared_memory: str = "", defer: bool = False
    ) -> None:
        """Sends StartSession without waiting, so that it overlaps the verifier's prefill; with
        `defer` (LoadPolicy.starts_at_admission said no) only once a step may draft, so that a
        request that never drafts costs the drafter and Redis nothing. That step waits for the
        start (at most the propose deadline), and the tokens committed meanwhile go with its
        Propose, as after any step run plain."""
        if self._breaker is not None and not self._breaker.allows():
            self.active = False  # the drafter hangs for others: this request does not ask it
            self._on_fallback("breaker")
            return
        self._deferred_start = (prompt, client_session_id, shared_memory)
        if not defer:
            self._send_start()

    def _send_start(self) -> None:
        prompt, client_session_id, shared_memory = self._deferred_start
        self._deferred_start = None
        self.opened = True
        self._held = len(prompt)
        self._started = self._client.start_session(
            self._session_id, prompt, self.params, client_session_id, shared_memory
        )

    def propose(
        self, new_tokens: Sequence[int], in_flight: int, max_depth: int, last_node_argmax: Sequence[int],
        drafting: bool = True, max_nodes: int | None = None, deadline: Deadline | None = None,
    ) -> tuple[list[int], list[int]]:
        """The tree to verify this step, sized for `in_flight` requests; empty (a plain step)
        when drafting is off, resting, failing or not paying right now. `new_tokens` and
        `last_node_argmax` are what the previous step committed and returned; `drafting` False
        is the gateway's load governor running this step plain (gateway/governor.py);
        `max_nodes` the most nodes the verifier's session has room for (None: no limit); the
        drafter's calls end by `deadline` (the request's)."""
        self._pending.extend(new_tokens)
        self._deadline = deadline  # a call it cut short says nothing of the drafter
        self._score_probe(new_tokens, in_flight)
        ahead = self._descend_ahead(new_tokens) if self._overlap else None
        self._base = ahead
        previous, self._sent, self.estimates = self._sent, None, []
        if previous is not None and last_node_argmax:  # what of it the step verified (a prediction's tree may cut it)
            previous = tuple(part[: len(last_node_argmax) - 1] for part in previous)
        if previous is not None and previous[0]:
            sent_tokens, sent_parents, sent_probabilities = previous
            on_path = accepted_nodes(sent_tokens, sent_parents, new_tokens[:-1])
            self._calibration.update(sent_parents, sent_probabilities, on_path)
        # The drafter reads the argmax and the verified depth only about its own latest tree.
        verified_depth, argmax = (tree_depth(previous[1]), last_node_argmax) if previous is not None else (0, [])
        room = self.params.tokens_per_step if max_nodes is None else max_nodes
        if not self.active or max_depth <= 0 or room <= 0 or time.monotonic() < self._retry_at:
            return [], []
        if not drafting or not self._policy.drafts_at(in_flight):
            return [], []
        if self._breaker is not None and not self._breaker.allows():
            return [], []
        if self._deferred_start is not None:
            self._send_start()
        if not self._session_ready(deadline):
            return [], []
        action = self._pacing.next_step()
        if action == DraftPacing.REST:
            return [], []
        step_ms = self.costs.step_ms(in_flight)
        if action == DraftPacing.PROBE:
            self._send_probe(step_ms, max_depth, argmax, verified_depth, room, deadline)
            return [], []
        max_nodes = min(room, self.costs.useful_nodes(step_ms, min(1.0, self._calibration.ratio)))
        if max_nodes == 0:
            self._pacing.record(False)
            return [], []
        asked = min(MAX_TREE_NODES, self._policy.ahead_factor * self.params.tokens_per_step) if self._overlap else max_nodes
        if ahead and self._probe is None:  # drafted while the last step verified: nothing to wait for
            self._ahead_call = self._send_later(asked, max_depth, (), None, deadline)
            return self._size(*within_depth(*ahead, max_depth), max_nodes, step_ms, in_flight)
        clock, sent = self._clock(), time.monotonic()
        timeout = timeout_for(deadline, self._propose_timeout)
        try:
            tokens, parents, probabilities = self._client.propose(
                self._session_id, self._pending, asked, max_depth, argmax, verified_depth, deadline,
                committed_length=self._committed_length(),
            )
        except (DeadlineExceeded, Cancelled):
            raise
        except NotFound as error:
            self._stop("lost_session", error)
            return [], []
        except PardecError as error:
            slow = isinstance(error, TimedOut) or time.monotonic() - sent >= SLOW_SHARE * timeout
            self._drafter_failed(error, slow)
            return [], []
        self.costs.drafter_ms.add((self._clock() - clock) * 1e3)
        self._quick_failures = 0
        self._held += len(self._pending)
        self._pending = []
        probabilities = self._estimates(tokens, parents, probabilities)
        if probabilities is None:
            return [], []
        if self._overlap:
            self._base = (tokens, parents, probabilities)
        return self._size(tokens, parents, probabilities, max_nodes, step_ms, in_flight)

    def _size(
        self, tokens: list[int], parents: list[int], probabilities: list[float], max_nodes: int,
        step_ms: Callable[[int], float], in_flight: int,
    ) -> tuple[list[int], list[int]]:
        """The prefix of a drafted tree this step verifies (possibly none), remembered for calibration."""
        tokens, parents, probabilities = tokens[:max_nodes], parents[:max_nodes], probabilities[:max_nodes]
        estimates = self._calibration.estimates(parents, probabilities)
        n, _ = best_prefix(estimates, step_ms, self._policy.min_gain)
        self._pacing.record(self.costs.asking_pays(estimates[:n], step_ms, in_flight))
        self._sent, self.estimates = (tokens[:n], parents[:n], probabilities[:n]), estimates[:n]
        return tokens[:n], parents[:n]

    def _send_probe(
        self, step_ms: Callable[[int], float], max_depth: int, argmax, verified_depth: int, room: int,
        deadline: Deadline | None,
    ) -> None:
        """Asks the drafter beside this plain step for a shallow tree, scored against the tokens the
        model commits next (`_score_probe`): its verdict takes a few steps at most."""
        max_nodes = min(room, self.costs.useful_nodes(step_ms, odds=1.0))
        call = max_nodes and self._send_later(max_nodes, min(max_depth, PROBE_DEPTH), argmax, verified_depth, deadline)
        if call:
            self._probe = (*call, [])
        else:  # nothing to test (not even a drafter always right would pay), or it failed at once
            self._pacing.record(False)

    def _descend_ahead(self, committed: Sequence[int]) -> tuple[list[int], list[int], list[float]] | None:
        """The tree below what the last step committed: from the ahead call's answer (the
        wait for it counts as the drafter's time), else from the tree that step came from."""
        base, call, self._ahead_call = self._base, self._ahead_call, None
        if call is not None:
            clock = self._clock()
            answer = self._answer(*call)
            if answer is not None:
                self.costs.drafter_ms.add((self._clock() - clock) * 1e3)
                fresh = descend(*answer, committed)
                if fresh:
                    return fresh
        return descend(*base, committed) if base else None

    def _send_later(
        self, max_nodes: int, max_depth: int, argmax: Sequence[int], verified_depth: int | None,
        deadline: Deadline | None,
    ) -> tuple[Future, list[int]] | None:
        """A Propose not waited for (a probe, an ahead call), carrying the pending tokens."""
        sent = time.monotonic()
        timeout = timeout_for(deadline, self._propose_timeout)
        try:  # the tokens of a long plain run go first, in calls that wait
            future = self._client.propose_future(
                self._session_id, self._pending, max_nodes, max_depth, argmax, verified_depth, deadline,
                committed_length=self._committed_length(),
            )
        except (DeadlineExceeded, Cancelled):
            raise
        except PardecError as error:
            self._drafter_failed(error, isinstance(error, TimedOut) or time.monotonic() - sent >= SLOW_SHARE * timeout)
            return None
        carried, self._pending = self._pending, []
        self._carried += len(carried)
        return future, carried

    def _answer(self, future: Future, carried: list[int]) -> tuple[list[int], list[int], list[float]] | None:
        """A call not waited for: its tree, checked, an estimate per node; None if it failed
        (its tokens are pending again) or the session ended."""
        self._carried -= len(carried)
        try:
            tokens, parents, probabilities = self._client.proposal(future)
        except NotFound as error:
            self._stop("lost_session", error)
            return None
        except PardecError as error:
            self._pending[:0] = carried
            self._drafter_failed(error, isinstance(error, TimedOut) and not (self._deadline and self._deadline.expired))
            return None
        self._held += len(carried)
        self._quick_failures = 0
        probabilities = self._estimates(tokens, parents, probabilities)
        return None if probabilities is None else (tokens, parents, probabilities)

    def _committed_length(self) -> int:
        """What the drafter's session holds once the call with the pending tokens is in."""
        return self._held + self._carried + len(self._pending)

    def _score_probe(self, new_tokens: Sequence[int], in_flight: int) -> None:
        """The probe's verdict, once its answer is in. Its tree calibrates like a verified one
        once the model's tokens decide it (a miss at once); asking resumes if the path it did
        accept, or its tree sized by the corrected estimates, would have paid for a round trip."""
        if self._unscored is not None:
            self._unscored[3].extend(new_tokens)
            self._learn_from_probe()
        if self._probe is None:
            return
        future, sent, continuation = self._probe
        continuation.extend(new_tokens)
        if not future.done():
            return
        self._probe = None
        answer = self._answer(future, sent)
        if answer is None:
            self._pacing.record(False)
            return
        tokens, parents, probabilities = answer
        self._unscored = (tokens, parents, probabilities, continuation)
        self._learn_from_probe()
        # Pays if what it did accept would have, or if its tree sized by the (now corrected)
        # estimates would, as a serial ask's verdict reads them.
        accepted = sum(accepted_nodes(tokens, parents, continuation))
        step_ms = self.costs.step_ms(in_flight)
        estimates = self._calibration.estimates(parents, probabilities)
        n, _ = best_prefix(estimates, step_ms, self._policy.min_gain)
        self._pacing.record(
            (accepted > 0 and self.costs.asking_pays([1.0] * accepted, step_ms, in_flight))
            or self.costs.asking_pays(estimates[:n], step_ms, in_flight)
        )

    def _learn_from_probe(self) -> None:
        tokens, parents, probabilities, continuation = self._unscored
        on_path = score_shadow(tokens, parents, continuation)
        if on_path is not None:
            self._calibration.update(parents, probabilities, on_path)
            self._unscored = None

    def _drafter_failed(self, error: PardecError, slow: bool) -> None:
        # Possibly recorded anyway (an answer lost after the deadline): a duplicated n-gram
        # only skews drafts, never the output, so the tokens are sent again.
        if slow:
            self._went_unanswered()
            self._stop("propose", error)
            return
        self._quick_failures += 1
        wait = min(self._retry_s * 2 ** (self._quick_failures - 1), MAX_RETRY_S)
        self._retry_at = time.monotonic() + wait
        self._on_fallback("propose")
        log.warning("drafter: %s; plain steps for %.1fs", error, wait)

    def _went_unanswered(self) -> None:
        """A call of this request waited its whole timeout: the drafter or its Redis hangs."""
        if self._healthy and self._breaker is not None:
            self._breaker.timed_out()
        self._healthy = False

    def _estimates(self, tokens: list[int], parents: list[int], probabilities: list[float]) -> list[float] | None:
        """A drafted tree's estimates (a drafter without any is trusted fully); None for a tree
        the verifier would refuse, which ends drafting for the request."""
        problem = check_tree(tokens, parents, probabilities, self._vocab_size)
        if problem:
            self._stop("malformed", PardecError(f"drafter sent a tree the verifier would refuse: {problem}"))
            return None
        if self._breaker is not None:
            self._breaker.answered()
        return probabilities if len(probabilities) == len(tokens) else [1.0] * len(tokens)

    def _session_ready(self, deadline: Deadline | None = None) -> bool:
        """StartSession overlaps prefill; the first step waits for it at most one propose
        deadline, later steps not at all (they run plain until it is done)."""
        if self._started is None:
            return True
        wait_s = 0 if self._waited else timeout_for(deadline, self._propose_timeout)
        cut = wait_s < self._propose_timeout  # by the request's deadline: no word on the drafter
        try:
            ready = self._client.wait_started(self._started, wait_s)
        except PardecError as error:
            if isinstance(error, TimedOut):  # it waited the start's whole timeout
                self._went_unanswered()
            self._stop("start", error)
            return False
        if not ready and not self._waited and not cut:
            # Unanswered for a whole propose timeout (a start takes a few ms): the drafter may
            # hang. Later steps only look, at no cost; an answer later clears it.
            self._went_unanswered()
        self._waited = True
        if ready:
            self._started = None
            if self._breaker is not None:
                self._breaker.answered()
        return ready

    def end(self, last_tokens: Sequence[int] = (), wait: bool = True) -> None:
        """Ends the drafter's session, handing it what it has not recorded yet: the tokens of
        steps that did not ask, and `last_tokens`, those of the request's last step. With a
        background pool, the caller waits for it at most one propose timeout, and only if
        ``wait`` and the drafter answered every call so far: a conversation's next turn then
        finds this one's answer in its memory, and a drafter that hangs delays no reply."""
        if not self.opened:
            return
        calls = [call[0] for call in (self._probe, self._ahead_call) if call is not None]
        finish = partial(end_session, self._client, self._session_id, self._started, calls,
                         [*self._pending, *last_tokens])
        if self._background is None:
            finish()
            return
        done = self._background.submit(finish)
        if done is not None and wait and self._healthy:
            done.wait(self._propose_timeout)

    def _stop(self, reason: str, error: PardecError) -> None:
        self.active = False
        self._on_fallback(reason)
        log.warning("drafter: %s; plain decoding for the rest of session %s", error, self._session_id)

