"""Tree sizing: the cost curve, the prefix choice, calibration and pacing as pure logic with
literal numbers (DraftSession against a real drafter: test_gateway_draft_session.py)."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pardec.gateway.tree_sizing
from pardec.gateway.tree_sizing import DEFAULT_POINTS, Calibration, CostCurve, DraftPacing, accepted_nodes, best_prefix

# This project's CPU, roughly (ms): a 16-token step 1.6x a 1-token one alone; at batch 4 the
# rows start to cost.
CPU_CURVE = [(1, 1, 36.0), (4, 1, 40.0), (16, 1, 58.0), (64, 1, 122.0),
             (1, 4, 45.0), (4, 4, 60.0), (16, 4, 120.0), (64, 4, 400.0)]  # fmt: skip


def test_docstring_examples():
    for module in (pardec.gateway.tree_sizing,):
        failures, tried = doctest.testmod(module)
        assert tried > 0 and failures == 0, module.__name__


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve.from_points(CPU_CURVE)
    assert curve.step_ms(1, 1) == 36.0
    assert curve.step_ms(10, 1) == pytest.approx(49.0)  # halfway between 4 and 16 tokens
    assert curve.step_ms(128, 1) == pytest.approx(122.0 + 64 * (122.0 - 58.0) / 48)  # the last segment's slope
    assert curve.step_ms(1, 2) == pytest.approx(39.0)  # a third of the way to batch 4
    assert curve.step_ms(1, 16) == pytest.approx(45.0 + 12 * 3.0)  # slope 3 ms per session
    assert curve.step_ms(16, 16) == pytest.approx(120.0 + 12 * (120.0 - 58.0) / 3)
    assert curve.step_ms(0, 1) == 36.0  # never below the smallest step


def test_a_step_never_costs_more_than_a_bigger_one():
    # Measured on this 2-core machine under load: the 2-token point is contention, not cost.
    noisy = [(1, 1, 37.4), (2, 1, 51.6), (4, 1, 49.0), (8, 1, 52.7), (16, 1, 68.5), (1, 4, 57.3), (2, 4, 66.9)]
    curve = CostCurve.from_points(noisy)
    assert curve.step_ms(2, 1) == 49.0 and curve.step_ms(3, 1) == 49.0
    assert curve.step_ms(1, 1) == 37.4 and curve.step_ms(8, 1) == 52.7 and curve.step_ms(2, 4) == 66.9


def test_default_curve_reads_a_batch_as_rows():
    curve = CostCurve.from_points([])
    assert curve.step_ms(16, 1) == dict(((t, ms) for t, _, ms in DEFAULT_POINTS))[16]
    assert curve.step_ms(4, 4) == curve.step_ms(16, 1)


@pytest.mark.parametrize(
    ("probabilities", "ratio", "batch", "expected"),
    [
        # Alone on the CPU a row costs ~1.5 ms of a ~40 ms step: at a rate of 0.08 tokens/ms a
        # node pays from p ~0.12 (0.7 does, 0.05 not).
        ([0.9, 0.8, 0.7, 0.05, 0.05], 1.0, 1, 3),
        # Drafts found twice too optimistic: p' = 0.45 ... 0.025; the rate drops to 0.054, so
        # a node pays from p' ~0.08 (0.1 does, 0.05 not).
        ([0.9, 0.8, 0.7, 0.3, 0.2, 0.1, 0.05], 0.5, 1, 5),
        # Drafts that never hit: plain.
        ([0.1, 0.05, 0.05], 0.1, 1, 0),
        # Batch 16 (extrapolated: 81 ms plain, ~20 ms per row per session): only sure nodes.
        ([0.9, 0.8, 0.7, 0.3, 0.2], 1.0, 16, 3),
        ([0.4, 0.3, 0.2], 0.5, 16, 0),
        ([], 1.0, 1, 0),
    ],
)
def test_best_prefix_from_a_cost_curve(probabilities, ratio, batch, expected):
    curve = CostCurve.from_points(CPU_CURVE)
    estimates = [min(1.0, ratio * p) for p in probabilities]
    n, rate = best_prefix(estimates, lambda tokens: 2.0 + curve.step_ms(tokens, batch))
    assert n == expected
    assert rate >= 1 / (2.0 + curve.step_ms(1, batch))


def test_min_gain_demands_a_margin_over_plain():
    step_ms = {1: 10.0, 2: 10.5}.get
    assert best_prefix([0.06], step_ms)[0] == 1  # 1.06 / 10.5 > 1 / 10
    assert best_prefix([0.06], step_ms, min_gain=1.03)[0] == 0


@given(
    estimates=st.lists(st.floats(0, 1), max_size=24),
    per_token_ms=st.floats(0, 20),
)
def test_best_prefix_is_the_best_of_all_prefixes(estimates, per_token_ms):
    step_ms = lambda tokens: 30.0 + per_token_ms * (tokens - 1)  # noqa: E731
    n, rate = best_prefix(estimates, step_ms)
    assert 0 <= n <= len(estimates)
    assert rate == pytest.approx((1 + sum(estimates[:n])) / step_ms(n + 1))
    assert all(rate >= (1 + sum(estimates[:m])) / step_ms(m + 1) - 1e-12 for m in range(len(estimates) + 1))


def test_accepted_nodes_follow_the_committed_tokens_down_the_tree():
    tokens, parents = [7, 8, 9, 7, 5, 6], [-1, -1, 0, 1, 2, 2]  # 7 -> 9 -> (5 | 6); 8 -> 7
    assert accepted_nodes(tokens, parents, [7, 9, 6]) == [True, False, True, False, False, True]
    assert accepted_nodes(tokens, parents, [8, 7]) == [False, True, False, True, False, False]
    assert accepted_nodes(tokens, parents, [7, 5]) == [True, False, False, False, False, False]  # 5 is no child of 7
    assert accepted_nodes(tokens, parents, []) == [False] * 6


# A copy as memory_decoding scores it: a context seen once in the prompt, each level 0.8 of its
# parent (Witten-Bell escape 4/5), so a 12-node chain ends at 0.8^12 = 0.07.
COPY_CHAIN = ([-1, *range(11)], [0.8 ** (depth + 1) for depth in range(12)])


def test_calibration_trusts_a_copy_in_progress():
    """Once chains are accepted whole, every level after the first follows its parent: the
    chain is worth ~11 tokens, not the drafter's 3.7. A single ratio on the path products
    could not say so without also trusting the first node beyond what it earned."""
    parents, probabilities = COPY_CHAIN
    calibration = Calibration(prior_ratio=1.0, prior_mass=2.0, decay=0.9)
    assert sum(calibration.estimates(parents, probabilities)) == pytest.approx(sum(probabilities))
    for _ in range(10):
        calibration.update(parents, probabilities, [True] * 12)
    estimates = calibration.estimates(parents, probabilities)
    assert estimates[0] > 0.9 and estimates[-1] > 0.85  # each level ~0.99 of its parent
    assert sum(estimates) > 10


def test_calibration_separates_the_first_level_from_the_copy_behind_it():
    """Text that leaves the copy at most steps' first node (and copies again at others): the
    first level loses trust, the levels behind it keep theirs, so a tree drafted after the
    first node was accepted is still worth its length."""
    parents, probabilities = COPY_CHAIN
    calibration = Calibration(prior_ratio=1.0, prior_mass=2.0, decay=0.9)
    for step in range(30):
        whole = step % 3 == 0  # one chain in three is accepted whole, the others not at all
        calibration.update(parents, probabilities, [whole] * 12)
    estimates = calibration.estimates(parents, probabilities)
    assert estimates[0] == pytest.approx(0.8 * calibration.ratio)
    assert calibration.ratio < 0.6  # a third of 0.8's worth, and the prior
    assert estimates[-1] > 0.8 * estimates[0]  # deeper levels: accepted whenever reached (drafted: 0.8^11)


def test_calibration_learns_each_band_of_conditionals_apart():
    """Deeper nodes in a branching context (two siblings, r = 0.4 each) and a continuation
    seen in the prompt (r = 0.8): the text takes either sibling half the time, and the
    prompt's continuation always. The bands are learned apart; one ratio would blur them."""
    parents = [-1, 0, 0, 1]  # a root, two siblings under it, then one child of the first sibling
    probabilities = [1.0, 0.4, 0.4, 0.32]
    calibration = Calibration(prior_ratio=1.0, prior_mass=2.0, decay=0.9)
    for step in range(40):
        first_sibling = step % 2 == 0
        calibration.update(parents, probabilities, [True, first_sibling, not first_sibling, first_sibling])
    estimates = calibration.estimates(parents, probabilities)
    assert estimates[1] == pytest.approx(0.5, abs=0.05) and estimates[2] == pytest.approx(0.5, abs=0.05)
    assert estimates[3] > 0.9 * estimates[1]  # r = 0.8, always accepted: nearly its parent's estimate


def test_calibration_learns_deeper_levels_only_where_the_parent_was_accepted():
    """A node whose parent was rejected was never put to the test: a chain cut at its first
    node says nothing about the levels behind it."""
    parents, probabilities = COPY_CHAIN
    calibration = Calibration(prior_ratio=1.0, prior_mass=2.0, decay=0.9)
    for _ in range(20):
        calibration.update(parents, probabilities, [False] * 12)
    estimates = calibration.estimates(parents, probabilities)
    assert estimates[1] / estimates[0] == pytest.approx(0.8)  # the drafter's conditional, as drafted
    assert calibration.ratio < 0.35


def test_calibration_follows_a_change_of_regime():
    parents, probabilities = [-1, 0], [0.5, 0.25]
    calibration = Calibration(prior_ratio=1.0, prior_mass=2.0, decay=0.9)
    for _ in range(30):
        calibration.update(parents, probabilities, [False, False])
    assert calibration.ratio == pytest.approx(2 / (5 + 2), abs=0.02)  # the decayed sums settle near 0 of 5
    for _ in range(60):
        calibration.update(parents, probabilities, [True, True])
    assert calibration.ratio == pytest.approx((10 + 2) / (5 + 2), abs=0.02)
    first = 0.5 * 12 / 7  # and the second level's band learned the same ratio
    assert calibration.estimates(parents, probabilities) == pytest.approx([first, first * first], abs=0.02)


def test_pacing_tries_ever_more_rarely_first_asking_then_probing_and_asks_again_once_a_try_pays():
    pacing = DraftPacing(probe_every=8)
    assert pacing.next_step() == DraftPacing.ASK
    pacing.record(False)
    steps = []
    for _ in range(44):
        steps.append(pacing.next_step())
        if steps[-1] != DraftPacing.REST:
            pacing.record(False)
    tries = [(i, step) for i, step in enumerate(steps) if step != DraftPacing.REST]
    # 1, 2, 4, 8, then 8 plain steps before each try; from 4 apart they are probes.
    assert tries[:6] == [(1, "ask"), (4, "ask"), (9, "probe"), (18, "probe"), (27, "probe"), (36, "probe")]
    pacing.record(True)
    assert pacing.next_step() == pacing.next_step() == DraftPacing.ASK
