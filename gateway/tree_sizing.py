"""How many draft nodes a step verifies: the prefix of the drafter's tree that maximizes the
session's expected tokens per second, from the verifier's measured step cost.

The drafter lists a tree best first, each node with p_i, its estimate that the node ends up on
the accepted path, and every prefix of the list is a tree. By linearity of expectation, the
first n nodes accept sum(p_i, i < n) tokens on average (a node is accepted exactly when it lies
on the accepted path), and a step also commits the model's own next token. So a step of n nodes
makes

    (1 + c * sum(p_i, i < n)) / (overhead + scale * step_ms(n + 1 tokens, batch))

tokens per millisecond, where c calibrates the drafter's estimates against what this session
actually accepted (`Calibration`), step_ms is the verifier's cost curve (`CostCurve`) at the
current number of requests in flight, and overhead is what a step costs besides the forward
(transport, the gateway's own work). n = 0 is a plain step. With every session sized this way,
throughput is what every session gets: batch members share the forward, and a tree that costs
the batch more than it brings is cut. The drafter's own round trip is paid before the tree is
known, so it decides whether to ask at all (`DraftPacing`): while asking does not pay, the
drafter is asked only now and then.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Sequence

# The curve used when the verifier publishes none (--no-cost-curve): this project's CPU and
# model, one session, context 100 (README: a 16-node step ~1.6x a 1-token one, 64 ~3.4x). A
# batch of b sessions of t tokens is read as one session of b*t tokens (rows of the GEMMs).
DEFAULT_POINTS = ((1, 1, 36.0), (16, 1, 58.0), (64, 1, 122.0))


@dataclass(frozen=True)
class CostCurve:
    """The verifier's step time in ms by (tokens per session, sessions in the batch): piecewise
    linear in tokens within each measured batch, then linear in the batch between measured
    batches and beyond the largest (by the slope of the last two), never cheaper with more.

    >>> curve = CostCurve.from_points([(1, 1, 10.0), (9, 1, 18.0), (1, 4, 16.0), (9, 4, 48.0)])
    >>> curve.step_ms(5, 1), curve.step_ms(17, 1), curve.step_ms(1, 2), curve.step_ms(9, 10)
    (14.0, 26.0, 12.0, 108.0)
    """

    by_batch: tuple[tuple[int, tuple[tuple[int, float], ...]], ...]

    @classmethod
    def from_points(cls, points: Sequence[tuple[int, int, float]]) -> CostCurve:
        batches: dict[int, dict[int, float]] = {}
        for tokens, batch, ms in points or DEFAULT_POINTS:
            if tokens >= 1 and batch >= 1 and ms > 0:
                batches.setdefault(batch, {})[tokens] = ms
        if not batches:
            return cls.from_points(DEFAULT_POINTS)
        return cls(tuple((batch, tuple(sorted(row.items()))) for batch, row in sorted(batches.items())))

    def step_ms(self, tokens: int, batch: int) -> float:
        batch = max(1, batch)
        if len(self.by_batch) == 1:
            measured, row = self.by_batch[0]
            return _along(row, tokens * batch / measured)
        sizes = [size for size, _ in self.by_batch]
        at = min(max(bisect.bisect_left(sizes, batch), 1), len(sizes) - 1)
        (low, low_row), (high, high_row) = self.by_batch[at - 1], self.by_batch[at]
        low_ms, high_ms = _along(low_row, tokens), _along(high_row, tokens)
        slope = max(0.0, (high_ms - low_ms) / (high - low))
        return max(low_ms, high_ms + slope * (batch - high)) if batch > high else low_ms + slope * (batch - low)


def _along(row: tuple[tuple[int, float], ...], tokens: float) -> float:
    """Piecewise linear in tokens; below the first point its cost, past the last the last
    segment's slope (or the cost per token of the last point, for a single point)."""
    if tokens <= row[0][0]:
        return row[0][1]
    for (t0, ms0), (t1, ms1) in zip(row, row[1:]):
        if tokens <= t1:
            return ms0 + (ms1 - ms0) * (tokens - t0) / (t1 - t0)
    if len(row) == 1:
        return row[0][1] * tokens / row[0][0]
    (t0, ms0), (t1, ms1) = row[-2], row[-1]
    return ms1 + max(0.0, (ms1 - ms0) / (t1 - t0)) * (tokens - t1)


def expected_accepted(probabilities: Sequence[float], ratio: float) -> list[float]:
    """Expected accepted draft tokens of each prefix (index n: the first n nodes), each node's
    estimate scaled by the session's calibration ratio and capped at 1.

    >>> expected_accepted([0.9, 0.5, 0.2], ratio=0.5)
    [0, 0.45, 0.7, 0.8]
    >>> expected_accepted([0.9, 0.5], ratio=2.0)
    [0, 1.0, 2.0]
    """
    sums, total = [0], 0.0
    for probability in probabilities:
        total += min(1.0, ratio * probability)
        sums.append(round(total, 12))
    return sums


def best_prefix(
    probabilities: Sequence[float], ratio: float, step_ms: Callable[[int], float], min_gain: float = 1.0
) -> tuple[int, float]:
    """(n, tokens per ms) of the best prefix: n maximizes (1 + expected accepted(n)) /
    step_ms(n + 1 tokens); a tree must beat the plain step by the factor min_gain.

    A cost curve where a 4-token step costs 1.2x a 1-token one: two likely nodes pay, the
    unlikely third does not; at a batch where each token costs as much as a step, none pays.

    >>> flat = {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}.get
    >>> best_prefix([0.8, 0.6, 0.05], ratio=1.0, step_ms=flat)
    (2, 0.19999999999999998)
    >>> best_prefix([0.8, 0.6, 0.05], ratio=1.0, step_ms=lambda tokens: 10.0 * tokens)
    (0, 0.1)
    """
    sums = expected_accepted(probabilities, ratio)
    plain = 1.0 / step_ms(1)
    best, best_rate = 0, plain
    for n in range(1, len(sums)):
        rate = (1.0 + sums[n]) / step_ms(n + 1)
        if rate > best_rate and rate > plain * min_gain:
            best, best_rate = n, rate
    return best, best_rate


class Calibration:
    """The ratio actual / predicted accepted tokens of one session: exponentially decayed sums
    starting from a prior (`prior_ratio` over `prior_mass` predicted tokens), so that a few
    steps move it and a change of regime (prose after code) is followed.

    >>> calibration = Calibration(prior_ratio=1.0, prior_mass=2.0, decay=0.5)
    >>> calibration.update(predicted=3.0, accepted=0); round(calibration.ratio, 3)
    0.4
    >>> calibration.update(predicted=1.0, accepted=2); round(calibration.ratio, 3)
    0.889
    """

    def __init__(self, prior_ratio: float, prior_mass: float, decay: float):
        self._prior_accepted, self._prior_mass = prior_ratio * prior_mass, prior_mass
        self._decay = decay
        self._predicted = self._accepted = 0.0

    @property
    def ratio(self) -> float:
        return (self._accepted + self._prior_accepted) / (self._predicted + self._prior_mass)

    def update(self, predicted: float, accepted: int) -> None:
        self._predicted = self._decay * self._predicted + predicted
        self._accepted = self._decay * self._accepted + accepted


class DraftPacing:
    """Whether this step asks the drafter: always while drafting pays; after a step where even
    the best tree did not pay for the drafter's round trip, skip 1 step, then 2, 4, ... up to
    `probe_every`, and ask again (a probe). Skipped steps cost the drafter nothing: it gets their
    tokens with the next call.

    >>> pacing = DraftPacing(probe_every=4)
    >>> for paid in (False, False, False, False):
    ...     asked = [pacing.should_ask() for _ in range(5)]
    ...     pacing.record(paid)
    >>> pacing.should_ask(), pacing.skip
    (False, 4)
    >>> pacing.record(True); pacing.should_ask()
    True
    """

    def __init__(self, probe_every: int):
        self.probe_every = probe_every
        self.skip = 0  # steps to skip after each probe that did not pay
        self._left = 0

    def should_ask(self) -> bool:
        if self._left > 0:
            self._left -= 1
            return False
        return True

    def record(self, paid: bool) -> None:
        self.skip = 0 if paid else min(self.probe_every, max(1, 2 * self.skip))
        self._left = self.skip


class Average:
    """An exponential moving average that starts at a guess."""

    def __init__(self, initial: float, weight: float = 0.2):
        self.value, self._weight = initial, weight

    def add(self, sample: float) -> None:
        self.value += self._weight * (sample - self.value)
