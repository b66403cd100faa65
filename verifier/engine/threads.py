"""How many threads each forward of the engine uses: all it has, unless its CPUs are shared.

A CPU forward splits every op's rows or columns across an OpenMP team and joins the team at a
barrier after each op, hundreds of times a step. Alone on its cores that is what makes a step
fast. Beside another busy process (a second verifier, drafters under load, whatever else the
node runs) one thread of the team is often off its core, and every barrier waits for it to come
back: beside one busy-loop process on 2 cores, plain decoding fell to a sixth, beside a second
verifier to a fifteenth (docs/benchmarks.md, "The verifier as a neighbour"). A smaller team waits
for fewer threads, and one thread waits for none.

`ThreadChooser` picks the team size by measurement, per size of forward (rows, in powers of
two): every size it may use is timed, the fastest is used, and every EXPLORE_EVERY forwards of a
size one forward runs with another team, so a choice follows the machine as neighbours come and
go. Alone, that costs one forward in EXPLORE_EVERY run slower. The logits do not depend on the
team size (each kernel splits its work by output, every reduction in one thread:
tests/test_engine_threads.py), so greedy decoding stays exactly plain decoding's.

Worked example, 2 CPUs and a neighbour that spins on one of them:

    >>> chooser = ThreadChooser(2)
    >>> chooser.teams
    (2, 1)
    >>> for _ in range(2 * MIN_SAMPLES):  # each team is timed first
    ...     team = chooser.team(rows=1)
    ...     chooser.record(team, rows=1, ms={2: 60.0, 1: 20.0}[team])
    >>> chooser.team(rows=1)
    1
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

# Forwards of one size between two that try another team than the fastest.
EXPLORE_EVERY = 32
# Forwards a team is timed on before it can be chosen or passed over.
MIN_SAMPLES = 3
# Weight of the newest forward in a team's average time.
ALPHA = 0.25


def teams_for(threads: int) -> tuple[int, ...]:
    """The team sizes worth trying with `threads` CPUs: all of them, then halves, down to one.

    >>> teams_for(16), teams_for(2), teams_for(1)
    ((16, 8, 4, 2, 1), (2, 1), (1,))
    """
    sizes, size = [], max(1, threads)
    while True:
        sizes.append(size)
        if size == 1:
            return tuple(sizes)
        size = max(1, size // 2)


class ThreadChooser:
    def __init__(self, threads: int, adapt: bool = True):
        """`threads`: the most a forward may use; `adapt` False (a GPU's engine, whose host
        threads do little): `run` leaves torch's setting alone."""
        self.teams = teams_for(threads)
        self.adapt = adapt
        self.current = 0  # the team torch was last set to (0: not yet)
        # Per forward size (rows' bit length): per team, (average ms, forwards timed).
        self._times: dict[int, dict[int, tuple[float, int]]] = {}
        self._since_explore: dict[int, int] = {}
        self._explored: dict[int, int] = {}  # the last team tried besides the fastest, per size
        self._last: dict[int, int] = {}  # the team of the last forward, per size

    def team(self, rows: int) -> int:
        """The team size for a forward of `rows` rows."""
        size = max(1, rows).bit_length()
        times = self._times.setdefault(size, {})
        for team in self.teams:  # each team is timed before any is preferred
            if times.get(team, (0.0, 0))[1] < MIN_SAMPLES:
                return team
        best = min(self.teams, key=lambda team: times[team][0])
        count = self._since_explore.get(size, 0) + 1
        if count < EXPLORE_EVERY or len(self.teams) == 1:
            self._since_explore[size] = count
            return best
        self._since_explore[size] = 0
        others = [team for team in self.teams if team != best]
        last = self._explored.get(size)
        pick = others[(others.index(last) + 1) % len(others)] if last in others else others[0]
        self._explored[size] = pick
        return pick

    def record(self, team: int, rows: int, ms: float) -> None:
        """A forward of `rows` rows took `ms` with `team` threads. A team tried only now and
        then (not the one in use) starts its average afresh: what it measured a while ago may
        be from before a neighbour came or went."""
        size = max(1, rows).bit_length()
        times = self._times.setdefault(size, {})
        average, count = times.get(team, (ms, 0))
        fresh = count < MIN_SAMPLES or team == self._last.get(size)
        times[team] = (average + ALPHA * (ms - average) if count and fresh else ms, count + 1)
        self._last[size] = team

    def run(self, rows: int, forward: Callable[[], T]) -> T:
        """forward() on the team chosen for `rows` rows, timed for the next choices. Call it
        from the thread that runs the model: torch and the C kernels read the team size there."""
        if not self.adapt:
            return forward()
        team = self.team(rows)
        if team != self.current:
            torch.set_num_threads(team)
            self.current = team
        start = time.perf_counter()
        result = forward()
        self.record(team, rows, (time.perf_counter() - start) * 1e3)
        return result
