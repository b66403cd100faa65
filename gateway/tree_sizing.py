"""How many draft nodes a step verifies: the prefix of the drafter's tree that maximizes the
session's expected tokens per second, from the verifier's measured step cost.

The drafter lists a tree best first, each node with p_i, its estimate that the node ends up on
the accepted path, and every prefix of the list is a tree. `Calibration` turns p_i into q_i,
corrected by what this session actually accepted. By linearity of expectation, the first n
nodes accept sum(q_i, i < n) tokens on average (a node is accepted exactly when it lies on the
accepted path), and a step also commits the model's own next token. So a step of n nodes makes

    (1 + sum(q_i, i < n)) / (overhead + scale * step_ms(n + 1 tokens, batch))

tokens per millisecond, where step_ms is the verifier's cost curve (`CostCurve`) at the
current number of requests in flight, and overhead is what a step costs besides the forward
(transport, the gateway's own work). n = 0 is a plain step. With every session sized this way,
throughput is what every session gets: batch members share the forward, and a tree that costs
the batch more than it brings is cut. The drafter's own round trip is paid before the tree is
known, so it decides whether to ask at all (`DraftPacing`): while asking does not pay, steps
run plain and the drafter is tried only now and then, the rarer tries beside a plain step, their
trees scored against what the model then commits (probes).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from pardec.gateway.config import LoadPolicy
    from pardec.verifier.api import Verification

# The curve used when the verifier publishes none (--no-cost-curve): this project's CPU and
# model, one session, 256 cached positions, as the verifier measured it at startup (fused C
# layers: a 16-token step ~1.7x a 1-token one, 64 ~5.9x). A batch of b sessions of t tokens is
# read as one session of b*t tokens (rows of the GEMMs).
DEFAULT_POINTS = ((1, 1, 7.5), (16, 1, 12.7), (64, 1, 44.2))


@dataclass(frozen=True)
class CostCurve:
    """The verifier's step time in ms by (tokens per session, sessions in the batch): piecewise
    linear in tokens within each measured batch, then linear in the batch between measured
    batches and beyond the largest (by the slope of the last two), never cheaper with more.
    A point measured above a bigger step of its batch is lowered to it: more tokens never cost
    less, and on a busy machine contention only adds time (a 2-token step once came out at 1.38x
    a 1-token one and above the 4-token step, so no 1-node tree paid).

    >>> curve = CostCurve.from_points([(1, 1, 10.0), (9, 1, 18.0), (1, 4, 16.0), (9, 4, 48.0)])
    >>> curve.step_ms(5, 1), curve.step_ms(17, 1), curve.step_ms(1, 2), curve.step_ms(9, 10)
    (14.0, 26.0, 12.0, 108.0)
    >>> CostCurve.from_points([(1, 1, 37.0), (2, 1, 52.0), (4, 1, 49.0)]).step_ms(2, 1)
    49.0
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
        return cls(tuple((batch, _monotone(sorted(row.items()))) for batch, row in sorted(batches.items())))

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


def _monotone(row: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Each point's cost at most that of every bigger step (row sorted by tokens)."""
    lowest, lowered = float("inf"), []
    for tokens, ms in reversed(row):
        lowest = min(lowest, ms)
        lowered.append((tokens, lowest))
    return tuple(reversed(lowered))


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


def best_prefix(
    estimates: Sequence[float], step_ms: Callable[[int], float], min_gain: float = 1.0
) -> tuple[int, float]:
    """(n, tokens per ms) of the best prefix: n maximizes (1 + sum(estimates[:n])) /
    step_ms(n + 1 tokens); a tree must beat the plain step by the factor min_gain.

    A cost curve where a 4-token step costs 1.2x a 1-token one: two likely nodes pay, the
    unlikely third does not; at a batch where each token costs as much as a step, none pays.

    >>> flat = {1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}.get
    >>> best_prefix([0.8, 0.6, 0.05], step_ms=flat)
    (2, 0.19999999999999998)
    >>> best_prefix([0.8, 0.6, 0.05], step_ms=lambda tokens: 10.0 * tokens)
    (0, 0.1)
    """
    plain = 1.0 / step_ms(1)
    best, best_rate, accepted = 0, plain, 0.0
    for n, estimate in enumerate(estimates, start=1):
        accepted += estimate
        rate = (1.0 + accepted) / step_ms(n + 1)
        if rate > best_rate and rate > plain * min_gain:
            best, best_rate = n, rate
    return best, best_rate


def accepted_nodes(tokens: Sequence[int], parents: Sequence[int], accepted_tokens: Sequence[int]) -> list[bool]:
    """Which nodes of a verified tree lie on its accepted path, from the tokens committed: the
    path follows, level by level, the child holding the next accepted token.

    >>> accepted_nodes([5, 6, 7, 8], [-1, -1, 1, 2], [6, 7])
    [False, True, True, False]
    """
    on_path, node = [False] * len(tokens), -1
    for token in accepted_tokens:
        node = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == token), -1)
        if node < 0:
            break
        on_path[node] = True
    return on_path


class Calibration:
    """Each node's probability of being accepted, from the drafter's estimates corrected by what
    this session actually accepted.

    The drafter's score is a path product, p = p(parent) * r, with r its estimate that the text
    goes on with the node once it has reached the parent. Scaling p by one ratio fails copies:
    a context seen once in the output gives r = 0.5 at every level, yet once the text copies,
    a child follows an accepted parent ~95% of the time; while the first level after a commit
    (where the text may just have left the copy) is accepted less often than drafted. So r is
    calibrated where it means one thing: one ratio for the first level, one per band of r for
    deeper nodes, each learned only from nodes whose parent was accepted (that is exactly when
    the node's own r was put to the test), and a node's estimate is its parent's times its
    calibrated r, capped at 1. Each ratio is actual / predicted in exponentially decayed sums
    that start from a prior (`prior_ratio` over `prior_mass` predicted tokens), so that a few
    steps move it and a change of regime (prose after code) is followed.

    A copy: a chain whose conditionals are 0.8, 0.5, 0.5 was accepted whole, twice. The deeper
    levels' band now reads 0.5 as 0.71 (ratio (2 * 1.5 + 2) / (1 * 1.5 + 2) = 1.43), the first
    level 0.8 as 0.88, so the chain's estimates go from 0.8, 0.4, 0.2 to 0.88, 0.62, 0.45:

    >>> calibration = Calibration(prior_ratio=1.0, prior_mass=2.0, decay=0.5)
    >>> calibration.estimates([-1, 0, 1], [0.8, 0.4, 0.2])
    [0.8, 0.4, 0.2]
    >>> for _ in range(2):
    ...     calibration.update([-1, 0, 1], [0.8, 0.4, 0.2], [True, True, True])
    >>> [round(q, 2) for q in calibration.estimates([-1, 0, 1], [0.8, 0.4, 0.2])]
    [0.88, 0.62, 0.45]
    """

    # Deeper nodes' bands of r: branching contexts; a context seen once in the output (0.5);
    # contexts seen in the prompt (0.8) or repeatedly.
    BANDS = (0.35, 0.7)

    def __init__(self, prior_ratio: float, prior_mass: float, decay: float):
        self._prior_accepted, self._prior_mass = prior_ratio * prior_mass, prior_mass
        self._decay = decay
        count = 1 + len(self.BANDS) + 1  # the first level, then each band of deeper nodes
        self._predicted, self._accepted = [0.0] * count, [0.0] * count

    @property
    def ratio(self) -> float:
        """The first level's ratio: no node's estimate exceeds min(1, ratio)."""
        return self._ratio(0)

    def _ratio(self, band: int) -> float:
        return (self._accepted[band] + self._prior_accepted) / (self._predicted[band] + self._prior_mass)

    def _band(self, parent: int, conditional: float) -> int:
        return 0 if parent < 0 else 1 + bisect.bisect_right(self.BANDS, conditional)

    def estimates(self, parents: Sequence[int], probabilities: Sequence[float]) -> list[float]:
        """P(accepted) of each node of a tree (parents before children)."""
        ratios = [self._ratio(band) for band in range(len(self._predicted))]
        estimates: list[float] = []
        for parent, conditional in _conditionals(parents, probabilities):
            base = 1.0 if parent < 0 else estimates[parent]
            estimates.append(base * min(1.0, ratios[self._band(parent, conditional)] * conditional))
        return estimates

    def update(self, parents: Sequence[int], probabilities: Sequence[float], accepted: Sequence[bool]) -> None:
        """Learns from one verified tree and which of its nodes were accepted."""
        self._predicted = [self._decay * value for value in self._predicted]
        self._accepted = [self._decay * value for value in self._accepted]
        for node, (parent, conditional) in enumerate(_conditionals(parents, probabilities)):
            if parent < 0 or accepted[parent]:
                band = self._band(parent, conditional)
                self._predicted[band] += conditional
                self._accepted[band] += accepted[node]


def _conditionals(parents: Sequence[int], probabilities: Sequence[float]) -> list[tuple[int, float]]:
    """(parent, p / p(parent)) of each node: the drafter's estimate that the text goes on with
    the node once it has reached its parent."""
    return [
        (parent, probability if parent < 0 else probability / max(probabilities[parent], 1e-9))
        for parent, probability in zip(parents, probabilities)
    ]


class DraftPacing:
    """How a step uses the drafter. ASK: the tree it proposes is verified, while that pays.
    After a step where even the best tree did not pay for the drafter's round trip, steps run
    plain (REST), 1, then 2, 4, ... up to `probe_every` of them before each new try. The first
    tries ask as before; from 4 steps apart a try is a PROBE: the drafter is asked beside a
    plain step, off the step's critical path, and `record` takes the verdict of its tree
    against the token the model commits. Rested steps cost the drafter nothing: it gets their
    tokens with the next call.

    >>> pacing = DraftPacing(probe_every=8)
    >>> pacing.next_step(), pacing.record(False)
    ('ask', None)
    >>> [pacing.next_step() for _ in range(2)]
    ['rest', 'ask']
    >>> pacing.record(False); [pacing.next_step() for _ in range(3)]
    ['rest', 'rest', 'ask']
    >>> pacing.record(False); [pacing.next_step() for _ in range(6)]  # none before its verdict
    ['rest', 'rest', 'rest', 'rest', 'probe', 'rest']
    >>> pacing.record(True); pacing.next_step()
    'ask'
    """

    ASK, REST, PROBE = "ask", "rest", "probe"
    # Below this many plain steps between two tries, a try is a serial ask: a text that drafts
    # well now and then (code) pays that back at once, where a probe would hold the tree a step.
    PROBE_FROM_SKIP = 4

    def __init__(self, probe_every: int):
        self.probe_every = probe_every
        self.skip = 0  # plain steps from one try to the next while trees do not pay
        self._left = 0
        self._probing = False  # a probe's verdict is due

    def next_step(self) -> str:
        if self.skip == 0:
            return self.ASK
        if self._probing:
            return self.REST
        if self._left > 0:
            self._left -= 1
            return self.REST
        if self.skip < self.PROBE_FROM_SKIP:
            return self.ASK
        self._probing = True
        return self.PROBE

    def record(self, paid: bool) -> None:
        self.skip = 0 if paid else min(self.probe_every, max(1, 2 * self.skip))
        self._left, self._probing = self.skip, False


def score_shadow(tokens: Sequence[int], parents: Sequence[int], continuation: Sequence[int]) -> list[bool] | None:
    """Which nodes of a tree that was not verified the model would have accepted, from the
    tokens it committed after the tree's root (greedy: exactly what verifying the tree would
    have accepted); None while that is not decided yet (the path still matches and goes on).

    >>> score_shadow([5, 6, 7], [-1, 0, 1], [5])  # 6 may come next
    >>> score_shadow([5, 6, 7], [-1, 0, 1], [5, 9])
    [True, False, False]
    >>> score_shadow([5, 6, 7], [-1, 0, 1], [5, 6, 7])
    [True, True, True]
    """
    on_path = accepted_nodes(tokens, parents, continuation)
    matched = sum(on_path)
    if matched < len(continuation):
        return on_path
    end = max((node for node, accepted in enumerate(on_path) if accepted), default=-1)
    return None if any(parent == end for parent in parents) else on_path


class Average:
    """An exponential moving average that starts at a guess."""

    def __init__(self, initial: float, weight: float = 0.2):
        self.value, self._weight = initial, weight

    def add(self, sample: float) -> None:
        self.value += self._weight * (sample - self.value)


class SessionCosts:
    """What one session has measured of its steps' cost -- the forward against the verifier's
    curve, the rest of a step, the drafter's round trip -- and, from it, which trees pay."""

    def __init__(self, cost: CostCurve, policy: LoadPolicy, tokens_per_step: int):
        self._cost, self._policy, self._tokens_per_step = cost, policy, tokens_per_step
        self._overhead_ms = Average(policy.step_overhead_ms)  # a step's time beyond the forward
        self._forward_scale = Average(1.0)  # measured forward time / the curve's
        self.drafter_ms = Average(1.0)  # the drafter's time on a step's critical path

    def asking_pays(self, estimates: Sequence[float], step_ms: Callable[[int], float], in_flight: int) -> bool:
        """Whether verifying these nodes also pays for the drafter's round trip."""
        # What asking costs a round of steps: every request in flight makes its own call, and
        # those calls (drafter, Redis, the gateway's share) run on CPUs that may also run the
        # verifier, so they are counted as if one after another. Under load on a CPU with few
        # cores they cost as much as the trees gain (docs/benchmarks.md, "Figures behind design
        # choices"): the policy must see that to keep throughput at plain's. A cheap round
        # (LoadPolicy.always_ask_below) is asked for every step; otherwise only while trees pay.
        round_ms = self.drafter_ms.value * max(1, in_flight)
        n = len(estimates)
        paying = n > 0 and (1 + sum(estimates)) / (step_ms(n + 1) + round_ms) > 1 / step_ms(1)
        return paying or round_ms <= self._policy.always_ask_below * step_ms(1)

    def observe(self, verification: Verification, nodes: int, wall_ms: float, in_flight: int) -> None:
        """Learns what a step really costs here, only while the session runs alone: the
        forward against the curve (the machine may be faster or busier than at startup), and
        the rest. With others in flight a verify call also waits for their forwards, and a
        forward may hold only some of them: that is their rows' cost, which the curve's batch
        term already counts, and learning it as overhead would make every tree look cheap."""
        if in_flight > 1:
            return
        self._overhead_ms.add(max(0.0, wall_ms - verification.compute_ms))
        curve_ms = self._cost.step_ms(nodes + 1, 1)
        self._forward_scale.add(min(5.0, max(0.2, verification.compute_ms / curve_ms)))

    def step_ms(self, in_flight: int) -> Callable[[int], float]:
        overhead, scale = self._overhead_ms.value, self._forward_scale.value
        return lambda tokens: overhead + scale * self._cost.step_ms(tokens, in_flight)

    def useful_nodes(self, step_ms: Callable[[int], float], odds: float) -> int:
        """The most nodes worth asking for: beyond the last n where even n nodes each accepted
        with these odds would beat a plain step, none can pay."""
        floor = self._policy.min_gain / step_ms(1)
        useful = 0
        for n in range(1, self._tokens_per_step + 1):
            if (1 + n * odds) / step_ms(n + 1) > floor:
                useful = n
        return useful


def tree_depth(parents: Sequence[int]) -> int:
    """Depth of the deepest node of a tree (parents before children), 0 for none.

    >>> tree_depth([-1, 0, -1, 1]), tree_depth([])
    (3, 0)
    """
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return max(depths, default=0)
