"""Tree sizing: the cost curve, the prefix choice, calibration and pacing as pure logic with
literal numbers; then DraftSession against a real drafter (gRPC on loopback, real Redis)."""

from __future__ import annotations

import doctest
import struct
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pardec.gateway.drafting
import pardec.gateway.tree_sizing
from pardec.drafter.config import DrafterConfig
from pardec.drafter.redis_server import RedisServer
from pardec.drafter.service import DrafterServicer
from pardec.gateway.clients import DrafterClient, Verification
from pardec.gateway.config import DraftParams, GatewayConfig, LoadPolicy
from pardec.gateway.drafting import DraftSession
from pardec.gateway.tree_sizing import DEFAULT_POINTS, Calibration, CostCurve, DraftPacing, accepted_nodes, best_prefix
from pardec.runtime.serving import start_server

# This project's CPU, roughly (ms): a 16-token step 1.6x a 1-token one alone; at batch 4 the
# rows start to cost.
CPU_CURVE = [(1, 1, 36.0), (4, 1, 40.0), (16, 1, 58.0), (64, 1, 122.0),
             (1, 4, 45.0), (4, 4, 60.0), (16, 4, 120.0), (64, 4, 400.0)]  # fmt: skip


def test_docstring_examples():
    for module in (pardec.gateway.tree_sizing, pardec.gateway.drafting):
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


# --- DraftSession against a real drafter -------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_address(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("sizing-redis")) as server:
        servicer = DrafterServicer(DrafterConfig(redis_url=server.url))
        grpc_server, address = start_server([servicer.add_to], "127.0.0.1:0")
        yield address, servicer
        grpc_server.stop(None).wait()


def new_session(address, curve, policy=LoadPolicy(), params=DraftParams(decoding_length=8)):
    config = GatewayConfig(verifier_target="unused:1", drafter_target=address, load_policy=policy)
    session = DraftSession(DrafterClient(address, 10.0, 10.0), uuid.uuid4().hex, params, config,
                           cost=CostCurve.from_points(curve))  # fmt: skip
    return session


def committed_tokens(servicer, session_id):
    raw = servicer.drafter.store._client.get(f"pardec:{{{session_id}}}:tokens") or b""
    return list(struct.unpack(f">{len(raw) // 4}I", raw))


TEXT = list(range(100, 140))


def test_draft_session_verifies_a_prefix_where_rows_are_cheap(drafter_address):
    address, _ = drafter_address
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)])  # rows nearly free
    session.start(TEXT + TEXT[:2])
    tokens, parents = session.propose([TEXT[2]], in_flight=1, max_depth=64, last_node_argmax=[])
    assert tokens == TEXT[3:11] and parents == list(range(-1, 7))  # the whole chain of 8
    session.end()


def test_draft_session_goes_plain_and_stops_asking_where_rows_are_dear(drafter_address):
    address, servicer = drafter_address
    # Every token of a step costs as much as the step itself, the drafter's estimates are
    # fine: no tree can pay, so the drafter is not even asked, and gets the tokens later.
    dear = [(1, 1, 30.0), (2, 1, 70.0), (64, 1, 64 * 35.0)]
    session = new_session(address, dear)
    session.start(TEXT + TEXT[:2])
    for token in TEXT[2:6]:
        assert session.propose([token], in_flight=1, max_depth=64, last_node_argmax=[]) == ([], [])
    assert committed_tokens(servicer, session._session_id) == TEXT + TEXT[:2]  # not asked
    session.end()


def test_draft_session_backs_off_when_trees_do_not_pay_and_hands_over_every_token(drafter_address):
    address, servicer = drafter_address
    # Rows are cheap but the session's drafts never hit: after the prior wears off, trees are
    # cut to nothing and the drafter is asked ever more rarely, yet it receives every token.
    curve = [(1, 1, 30.0), (2, 1, 33.0), (64, 1, 200.0)]
    session = new_session(address, curve, LoadPolicy(always_ask_below=0))  # every call counts
    prompt = TEXT + TEXT[:2]
    session.start(prompt)
    misses = list(range(500, 560))  # never in the prompt
    sizes, asked = [], 0
    new_tokens = [misses[0]]
    for token in misses[1:]:
        before = len(committed_tokens(servicer, session._session_id))
        tokens, parents = session.propose(new_tokens, in_flight=1, max_depth=64, last_node_argmax=[])
        asked += len(committed_tokens(servicer, session._session_id)) > before
        sizes.append(len(tokens))
        session.observe(Verification([], token, [0] * (len(tokens) + 1), 30.0), len(tokens), 31.0, 1)
        new_tokens = [token]
    assert asked < len(misses) // 3, (asked, sizes)
    assert sizes[-10:] == [0] * 10
    # The drafter has every committed token in order once asked again. This loop runs no model,
    # so a probe it sent may still be in flight: it lands and is scored first, as it would within
    # a real step (while a probe is out the session only rests, so nothing overtakes it).
    if session._probe is not None:
        session._probe[0].exception()
        session._score_probe([], in_flight=1)
    session._pacing.record(True)
    session.propose(new_tokens, in_flight=1, max_depth=64, last_node_argmax=[])
    assert committed_tokens(servicer, session._session_id) == prompt + misses
    session.end()


def test_a_resting_session_probes_beside_plain_steps_and_drafts_again_once_the_text_copies(drafter_address):
    """While drafts miss, steps run plain and the drafter is only probed (asked beside a plain
    step, its tree scored against the token the model commits); once the text copies the
    prompt, a probe hits and trees are verified again. The drafter gets every token once, in order."""
    address, servicer = drafter_address
    session = new_session(address, [(1, 1, 30.0), (2, 1, 33.0), (64, 1, 200.0)], LoadPolicy(always_ask_below=0))
    prompt = TEXT + TEXT[:2]
    session.start(prompt)
    text = list(range(500, 520)) + TEXT  # new text, then a copy of the prompt
    committed, new_tokens, steps = 1, [text[0]], []  # steps: (position, nodes, accepted)
    while committed < len(text):
        if session._probe is not None:  # as when the verifier's forward outlasts the probe
            session._probe[0].exception()
        tokens, parents = session.propose(new_tokens, in_flight=1, max_depth=64, last_node_argmax=[])
        on_path = accepted_nodes(tokens, parents, text[committed:])
        accepted = [token for token, hit in zip(tokens, on_path) if hit]
        new_tokens = (accepted + text[committed + len(accepted):])[: len(accepted) + 1]
        session.observe(Verification(accepted, new_tokens[-1], [0] * (len(tokens) + 1), 30.0), len(tokens), 31.0, 1)
        steps.append((committed, len(tokens), len(accepted)))
        committed += len(new_tokens)
    new_text = [(nodes, hits) for position, nodes, hits in steps if 5 <= position < 20]
    copy = [(nodes, hits) for position, nodes, hits in steps if position >= 20]
    assert all(nodes == 0 for nodes, _ in new_text), steps
    # Tries come 1, 2, 4, 8, then 16 plain steps apart here: the probe 16 tokens into the copy hits.
    assert sum(hits for _, hits in copy) >= 15 and len(copy) <= 25, steps
    recorded = committed_tokens(servicer, session._session_id)
    assert recorded == (prompt + text)[: len(recorded)] and len(recorded) > len(prompt) + 20
    session.end()


def test_a_cheap_drafter_call_is_made_every_step_even_when_trees_do_not_pay(drafter_address):
    address, servicer = drafter_address
    # A call takes ~1 ms of a 200 ms step, under 5% (LoadPolicy.always_ask_below) with room for
    # calls of up to ~10 ms: on a busy 2-core CI machine some took over 3 ms, 5% of 60 ms.
    session = new_session(address, [(1, 1, 200.0), (2, 1, 220.0), (64, 1, 1333.0)])
    assert drafter_calls_over_new_text(session, servicer, in_flight=1, forward_ms=200.0) == 20
    session.end()


def test_drafter_calls_are_paid_for_by_every_request_in_flight(drafter_address):
    """A call that is cheap for one request is not for sixteen: their calls share the machine
    with the verifier, so under load a session that gains nothing stops asking."""
    address, servicer = drafter_address
    session = new_session(address, [(1, 1, 30.0), (2, 1, 33.0), (64, 1, 200.0)], LoadPolicy(plain_from=0))
    assert drafter_calls_over_new_text(session, servicer, in_flight=16) <= 8  # 1 ask, then skips of 1, 2, 4, 8 steps
    session.end()


def drafter_calls_over_new_text(session, servicer, in_flight: int, forward_ms: float | None = None) -> int:
    """Starts the session on TEXT, commits 20 tokens it never saw (no tree can pay) and counts
    the steps that asked the drafter; with forward_ms, each step is observed as that long."""
    session.start(TEXT + TEXT[:2])
    asked, new_tokens = 0, [500]
    for token in range(501, 521):
        before = len(committed_tokens(servicer, session._session_id))
        tokens, _ = session.propose(new_tokens, in_flight=in_flight, max_depth=64, last_node_argmax=[])
        asked += len(committed_tokens(servicer, session._session_id)) > before
        if forward_ms is not None:
            verification = Verification([], token, [0] * (len(tokens) + 1), forward_ms)
            session.observe(verification, len(tokens), forward_ms + 1.0, in_flight)
        new_tokens = [token]
    return asked


def test_plain_from_is_a_hard_switch(drafter_address):
    address, _ = drafter_address
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)], LoadPolicy(plain_from=4))
    session.start(TEXT + TEXT[:2])
    assert session.propose([TEXT[2]], in_flight=4, max_depth=64, last_node_argmax=[]) == ([], [])
    assert session.propose([TEXT[3]], in_flight=3, max_depth=64, last_node_argmax=[])[0] == TEXT[4:12]
    session.end()


def test_a_request_admitted_above_plain_from_starts_its_drafter_session_only_once_it_may_draft(drafter_address):
    """Above plain_from no step drafts, so StartSession waits: a request that never drafts costs
    the drafter and Redis nothing. Once load drops, the session starts from the prompt and the
    first Propose brings every token committed meanwhile."""
    address, servicer = drafter_address
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)], LoadPolicy(plain_from=4))
    session.start(TEXT + TEXT[:2], defer=True)
    for token in TEXT[2:5]:
        assert session.propose([token], in_flight=4, max_depth=64, last_node_argmax=[]) == ([], [])
    assert not session.opened and committed_tokens(servicer, session._session_id) == []
    assert session.propose([TEXT[5]], in_flight=3, max_depth=64, last_node_argmax=[])[0] == TEXT[6:14]
    assert session.opened and committed_tokens(servicer, session._session_id) == TEXT + TEXT[:6]
    session.end()


def test_a_step_the_load_governor_runs_plain_asks_nothing_and_loses_no_token(drafter_address):
    address, servicer = drafter_address
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)], LoadPolicy(plain_from=0))
    session.start(TEXT + TEXT[:2])
    for token in TEXT[2:5]:
        assert session.propose([token], in_flight=16, max_depth=64, last_node_argmax=[], drafting=False) == ([], [])
    session._client.wait_started(session._started, 10.0)
    assert committed_tokens(servicer, session._session_id) == TEXT + TEXT[:2]  # not asked
    assert session.propose([TEXT[5]], in_flight=16, max_depth=64, last_node_argmax=[])[0] == TEXT[6:14]
    assert committed_tokens(servicer, session._session_id) == TEXT + TEXT[:6]
    session.end()


def test_drafter_client_gets_best_first_estimates(drafter_address):
    address, _ = drafter_address
    client, session_id = DrafterClient(address, 10.0, 10.0), uuid.uuid4().hex
    client.wait_started(client.start_session(session_id, [1, 2, 3, 1, 2, 4, 1, 2], DraftParams()), 10.0)
    tokens, parents, probabilities = client.propose(session_id, [], 16, 8, verified_depth=0)
    # drafter/trie.py's example (branch length 3 there, 12 here: the paths go on): the copy
    # chain [4, 1] at 2/3 and 4/9, then the trie's [3] and [3, 1].
    assert (tokens[:4], parents[:4]) == ([4, 1, 3, 1], [-1, 0, -1, 2])
    assert probabilities[:4] == pytest.approx([2 / 3, 4 / 9, 0.4, 0.32], abs=1e-6)
    assert len(probabilities) == len(tokens) and probabilities == sorted(probabilities, reverse=True)
    client.end_session(session_id)


def test_a_session_that_ran_plain_for_longer_than_one_propose_carries_drafts_again(drafter_address):
    """The drafter takes at most 513 new tokens a call (one step's path and bonus token); after
    600 steps the load governor ran plain, the session hands them over in pieces and drafts."""
    address, servicer = drafter_address
    session = new_session(address, [(1, 1, 30.0), (64, 1, 31.0)], LoadPolicy(plain_from=0))
    prompt = TEXT + TEXT[:2]
    session.start(prompt)
    plain_run = [500 + i % 300 for i in range(600)] + TEXT[:2]
    for token in plain_run:
        assert session.propose([token], in_flight=16, max_depth=64, last_node_argmax=[], drafting=False) == ([], [])
    assert session.propose([TEXT[2]], in_flight=16, max_depth=64, last_node_argmax=[])[0] == TEXT[3:11]
    assert committed_tokens(servicer, session._session_id) == prompt + plain_run + TEXT[2:3]
    session.end()
