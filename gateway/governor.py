"""Whether sessions draft at all at the current load: measured gateway-wide, not modeled.

A session sizes its own tree from the verifier's cost curve (gateway/tree_sizing.py). Alone on
the verifier it measures what its steps really cost, so that model holds. With others in flight
it cannot see all it costs them: its rows ride in forwards they share, its drafter call can
make it miss a batch, and its acceptance estimates are learned on fewer steps. On a CPU with
few cores those costs were enough to put 16-32 requests in flight below plain throughput while
every session's model said its trees paid (docs/benchmarks.md, "Figures behind design choices").

So from ``govern_from`` requests in flight the gateway measures the thing itself. Time is cut
into epochs of a few rounds of steps (a round: each request in flight takes one step), and of at
least ``min_epoch_s`` of the gateway's time: on a shared machine two adjacent short epochs of
the same arm can differ by more than any gain. In an epoch either every session may draft or
none does, and the epoch's throughput is the tokens committed per second of wall time. A shared
machine's speed drifts within a minute by far more than drafting gains or costs, so arms are
never compared across minutes: each time the arm changes, the two adjacent epochs give one gain
sample, draft's rate over plain's. Drafting stays on while the median of the recent samples
beats ``margin``, and the other arm still runs one epoch in ``explore_every`` (two samples each
time) so that a change of workload or machine is followed. The margin leans towards plain: a
gain too small to tell from noise is not worth risking a loss.

A sample is taken where the workload was: at one load, drafting code edits gains and drafting
chat loses. Since a drafted step costs at least a plain one, drafting's gain is its tokens per
step times a cost factor that hardly depends on the text, so each sample is kept with the
tokens per step of its drafting epoch, and read at the tokens per step of the latest one:
log gain now = log gain then + log(tokens per step now / then). When the prompts turn from
copying to chat, the first drafting epoch at the lower acceptance already switches to plain,
instead of waiting for exploring epochs to outvote the samples taken on copies (a bench's
MT-Bench cell at 4 requests in flight, run on the gateway that had just served code editing and
HumanEval, ran well below plain while they did). The other way round, the exploring epochs find
the gain as before.

Each load band (2-3, 4-7, 8-15, 16-31 ... requests) learns on its own, since what pays at 4
need not at 32. The first round of an epoch is not counted: its steps still
share forwards with the previous arm's; nor are steps that overlap a prompt's prefill (the
gateway leaves them out): a batch of new prompts halves an epoch's rate, whichever arm it hits.

Throughput from steps: with k requests in flight a step that commits t tokens after s seconds
since the session's previous commit adds t tokens and s / k seconds of the gateway's time
(k sessions' steps tile the same wall clock), so the epoch's rate is sum(t) / sum(s / k).

Drafting at 90 tokens/s against plain's 100: after two epochs of each arm, plain, with a
drafting epoch every third one:

>>> governor = Governor(govern_from=2, epoch_rounds=2, explore_every=3, margin=1.0, min_epoch_steps=1)
>>> def epoch(draft_rate, plain_rate):
...     drafting = governor.drafting(4)
...     for _ in range(3 * 4):  # a warm-up round and two counted ones, 4 requests
...         governor.record(4, drafting, 1, 4 / (draft_rate if drafting else plain_rate))
...     return "draft" if drafting else "plain"
>>> [epoch(draft_rate=90.0, plain_rate=100.0) for _ in range(10)]
['draft', 'plain', 'draft', 'plain', 'plain', 'plain', 'draft', 'plain', 'plain', 'draft']
>>> governor.drafting(1)  # below govern_from: each session's own model decides
True
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from typing import Callable

log = logging.getLogger(__name__)

DRAFT, PLAIN = True, False


def band_of(in_flight: int) -> str:
    """The load band of a number of requests in flight: powers of two.

    >>> band_of(1), band_of(3), band_of(16), band_of(31)
    ('1', '2-3', '16-31', '16-31')
    """
    low = 1 << (max(1, in_flight).bit_length() - 1)
    return str(low) if low == 1 else f"{low}-{2 * low - 1}"


class _Band:
    """One load band: the arm running now, the epoch being measured, and the gain samples."""

    def __init__(self, history: int):
        self.arm = DRAFT
        # (log(draft rate / plain rate), log(tokens per step) of that drafting epoch)
        self.log_gains: deque[tuple[float, float]] = deque(maxlen=history)
        self.draft_log_tokens = 0.0  # log(tokens per step) of the latest drafting epoch
        # The last epoch's arm, rate and log(tokens per step).
        self.previous: tuple[bool, float, float] | None = None
        self.since_explore = 0
        self.warmup_steps = self.epoch_steps = self.steps = self.counted = 0
        self.tokens, self.seconds = 0, 0.0

    def start_epoch(self, in_flight: int, rounds: int, min_steps: int) -> None:
        self.warmup_steps = in_flight
        self.epoch_steps = self.warmup_steps + max(min_steps, rounds * in_flight)
        self.steps, self.counted, self.tokens, self.seconds = 0, 0, 0, 0.0

    def log_gain_now(self) -> float:
        """The median sample, each read at the latest drafting epoch's tokens per step."""
        return statistics.median(gain + self.draft_log_tokens - tokens for gain, tokens in self.log_gains)


class Governor:
    """The gateway-wide switch; thread-safe (every request's steps report here)."""

    def __init__(
        self, govern_from: int, epoch_rounds: int, explore_every: int, margin: float, history: int = 8,
        min_epoch_steps: int = 16, min_samples: int = 3, min_epoch_s: float = 0.0,
        on_epoch: Callable[[str, bool, float, float, bool], None] = lambda *_: None,
    ):
        self._govern_from, self._rounds, self._explore_every = govern_from, epoch_rounds, explore_every
        self._log_margin, self._history = math.log(margin), history
        self._min_steps, self._min_samples, self._min_epoch_s = min_epoch_steps, min_samples, min_epoch_s
        # (band, arm that ran, its tokens/s, median draft/plain gain (0: none yet), drafting next)
        self._on_epoch = on_epoch
        self._bands: dict[str, _Band] = {}
        self._lock = threading.Lock()

    def drafting(self, in_flight: int) -> bool:
        """Whether a step that starts now with `in_flight` requests may draft."""
        if not self._govern_from or in_flight < self._govern_from:
            return True
        with self._lock:
            return self._band(in_flight).arm

    def record(self, in_flight: int, drafting: bool, tokens: int, seconds: float) -> None:
        """A step's outcome: `drafting` as `drafting()` answered when it started, the tokens it
        committed, and the seconds since the session's previous commit."""
        if not self._govern_from or in_flight < self._govern_from:
            return
        with self._lock:
            band = self._band(in_flight)
            if drafting != band.arm:  # began under the previous epoch's arm
                return
            band.steps += 1
            if band.steps > band.warmup_steps:
                band.counted += 1
                band.tokens += tokens
                band.seconds += seconds / in_flight
            if band.steps >= band.epoch_steps and band.seconds >= self._min_epoch_s:
                self._end_epoch(band_of(in_flight), band, in_flight)

    def _band(self, in_flight: int) -> _Band:
        name = band_of(in_flight)
        if name not in self._bands:
            self._bands[name] = _Band(self._history)
            self._bands[name].start_epoch(in_flight, self._rounds, self._min_steps)
        return self._bands[name]

    def _end_epoch(self, name: str, band: _Band, in_flight: int) -> None:
        ran, rate = band.arm, band.tokens / band.seconds if band.seconds > 0 else 0.0
        log_tokens = math.log(band.tokens / band.counted) if band.tokens and band.counted else 0.0
        if ran == DRAFT:
            band.draft_log_tokens = log_tokens
        if band.previous is not None and band.previous[0] != ran and rate > 0 and band.previous[1] > 0:
            _, previous_rate, previous_log_tokens = band.previous
            if ran == DRAFT:
                band.log_gains.append((math.log(rate / previous_rate), log_tokens))
            else:
                band.log_gains.append((math.log(previous_rate / rate), previous_log_tokens))
        band.previous = (ran, rate, log_tokens)
        band.arm = self._next_arm(band)
        gain = math.exp(band.log_gain_now()) if band.log_gains else 0.0
        log.debug("load band %s: %s epoch, %d tokens in %.2f s: %.1f tokens/s; draft/plain %.3f; next %s", name,
                  "draft" if ran else "plain", band.tokens, band.seconds, rate, gain, "draft" if band.arm else "plain")
        band.start_epoch(in_flight, self._rounds, self._min_steps)
        self._on_epoch(name, ran, rate, gain, band.arm)

    def _next_arm(self, band: _Band) -> bool:
        if len(band.log_gains) < self._min_samples:  # alternate until there are a few samples
            return not band.arm
        best = band.log_gain_now() > self._log_margin
        band.since_explore += 1
        if band.since_explore >= self._explore_every:
            band.since_explore = 0
            return not best
        return best
