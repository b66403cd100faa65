"""Node scores: each tree comes best first with an acceptance estimate per node, so that any
prefix of it is a valid tree (the gateway verifies the prefix that pays)."""

from __future__ import annotations

import math
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardec.drafter.redis_server import RedisServer
from pardec.drafter.sessions import SCORE_SCALE, SessionStore
from pardec.runtime.draft_params import DraftParams
from tests.references.lookahead import LookaheadSession
from tests.references.trie import ReferenceCopy, reference_step


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("scores-redis")) as server:
        connection = redis.Redis.from_url(server.url)
        yield connection
        connection.close()


def new_id():
    return f"scores-{uuid.uuid4().hex}"


def millionths(scores):
    return [math.floor(score * SCORE_SCALE) / SCORE_SCALE for score in scores]


def assert_best_first(tokens, parents, scores):
    """Well-formed, scores in [0, 1] and non-increasing, and every prefix a tree."""
    assert len(tokens) == len(parents) == len(scores)
    assert all(0.0 <= score <= 1.0 for score in scores)
    assert all(a >= b for a, b in zip(scores, scores[1:]))
    for n in range(len(tokens) + 1):
        assert all(-1 <= parent < index for index, parent in enumerate(parents[:n]))
    siblings = list(zip(parents, tokens))
    assert len(set(siblings)) == len(siblings)


def test_memory_decoding_scores_of_the_worked_example(client):
    # drafter/trie.py: [1, 2] continues with 3 and 4 (prompt weight 4 each, escape 8/10), each
    # of those once more with 1 (escape 4/5); the copy chain [4, 1, 2], then 4 again from its
    # start, scores (2/3)^depth.
    store, session = SessionStore(client, branch_length=3), new_id()
    store.start_session(session, [1, 2, 3, 1, 2, 4, 1, 2], DraftParams())
    tokens, parents, scores = store.propose_scored(session, [], [], 16, 4)
    assert (tokens, parents) == ([4, 1, 3, 1, 2, 4], [-1, 0, -1, 2, 1, 4])
    assert scores == pytest.approx([2 / 3, 4 / 9, 0.4, 0.32, 8 / 27, 16 / 81], abs=1e-6)
    # The text went on with the copy: 3 hits in 3 trials, r = 5/6, and the pointer follows on.
    tokens, parents, scores = store.propose_scored(session, [4, 1, 2], [], 3, 8)
    assert (tokens, parents) == ([4, 1, 2], [-1, 0, 1])
    assert scores == pytest.approx([5 / 6, 25 / 36, 125 / 216], abs=1e-6)


def test_output_evidence_weighs_less_and_a_context_seen_often_keeps_its_mass(client):
    store, session = SessionStore(client, branch_length=2), new_id()
    store.start_session(session, [7, 8, 5, 6, 5, 6], DraftParams())
    # [6, 5] went on with 6 once in the prompt (weight 4) and once in the output (1), one way.
    _, _, scores = store.propose_scored(session, [5, 6, 5], [], 1, 1)
    assert scores == pytest.approx([5 / (5 + 1)], abs=1e-6)
    # [5, 7] never went on; [7] did once, with 8, in the prompt.
    _, _, scores = store.propose_scored(session, [7], [], 1, 1)
    assert scores == pytest.approx([4 / (4 + 1)], abs=1e-6)


def test_lookahead_scores_match_the_reference(client):
    params = DraftParams("la", level=3, window=3, guess_set_size=3)
    prompt = [1, 2, 3, 1, 2, 4, 1, 5, 6, 1, 2, 3]
    store, reference, session = SessionStore(client), LookaheadSession(params), new_id()
    store.start_session(session, prompt, params)
    reference.start(prompt)
    argmax = []
    for new_tokens in ([1], [2], [3, 1], [2], [4, 1]):
        expected = reference.propose(new_tokens, argmax, 20, 20)
        tokens, parents, scores = store.propose_scored(session, new_tokens, argmax, 20, 20)
        assert (tokens, parents) == (expected.tokens, expected.parents)
        assert scores == millionths(expected.scores)
        assert_best_first(tokens, parents, scores)
        argmax = [(7 * i + len(new_tokens)) % 6 for i in range(len(tokens) + 1)]


def test_lookahead_window_waits_for_a_verified_deepest_level(client):
    """A prefix that leaves out a deepest-level cell does not advance the window; the whole
    tree does."""
    params = DraftParams("la", level=3, window=2, guess_set_size=1)
    store, session = SessionStore(client), new_id()
    store.start_session(session, [5, 6, 7], params)
    levels_key = f"pardec:{{{session}}}:la_state"
    tokens, _, _ = store.propose_scored(session, [9], [], 8, 8)
    before = client.hget(levels_key, "levels")
    store.propose_scored(session, [], [11], 8, 8)  # only the root's row: cell (0, 1) missing
    assert client.hget(levels_key, "levels") == before
    tokens, _, _ = store.propose_scored(session, [], [], 8, 8)
    store.propose_scored(session, [], [11] + [12] * len(tokens), 8, 8)
    assert client.hget(levels_key, "levels") != before


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 3), max_size=20),
    pieces=st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=4),
    branch_length=st.integers(1, 6),
    max_nodes=st.integers(0, 24),
    max_depth=st.integers(0, 8),
)
def test_memory_decoding_scores_match_the_reference(client, prompt, pieces, branch_length, max_nodes, max_depth):
    store, session = SessionStore(client, branch_length=branch_length), new_id()
    store.start_session(session, prompt, DraftParams())
    committed, copy = list(prompt), ReferenceCopy(branch_length)
    try:
        for piece in [*pieces, []]:
            committed += piece
            tokens, parents, scores = store.propose_scored(session, piece, [], max_nodes, max_depth)
            expected = reference_step(copy, committed, piece, len(prompt), max_nodes, max_depth, with_scores=True)
            assert (tokens, parents) == expected[:2]
            assert scores == expected[2]
            assert_best_first(tokens, parents, scores)
    finally:
        store.end_session(session)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    plugin=st.sampled_from(["memory_decoding", "la"]),
    prompt=st.lists(st.integers(0, 4), max_size=24),
    level=st.integers(3, 5),
    window=st.integers(1, 4),
    guess=st.integers(1, 4),
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 4), max_size=4), st.integers(0, 40), st.integers(0, 9), st.integers(0, 40)),
        max_size=6,
    ),
)
def test_every_tree_is_best_first_and_every_prefix_a_tree(client, plugin, prompt, level, window, guess, steps):
    """Whatever prefix of the previous tree the gateway verified (`verified`), the next tree is
    well formed and best first."""
    settings_ = DraftParams(plugin, level=level, window=window, guess_set_size=guess, dynamic_algo=True)
    store, session = SessionStore(client, branch_length=4), new_id()
    store.start_session(session, prompt, settings_)
    argmax = []
    try:
        for new_tokens, max_nodes, max_depth, verified in steps:
            tokens, parents, scores = store.propose_scored(session, new_tokens, argmax, max_nodes, max_depth)
            assert len(tokens) <= max_nodes
            assert_best_first(tokens, parents, scores)
            verified = min(verified, len(tokens))
            argmax = [(3 * i + verified) % 5 for i in range(verified + 1)]
    finally:
        store.end_session(session)


def test_dynamic_algo_measures_hits_against_the_verified_depth(client):
    """A tree of depth 3 whose first node alone was verified and accepted is a full hit for
    dynamic_algo (the length grows), not one of three."""
    text = list(range(100, 140))
    store, session = SessionStore(client, branch_length=12), new_id()
    store.start_session(session, text + text[:2], DraftParams(decoding_length=8, dynamic_algo=True))
    tokens, _, _ = store.propose_scored(session, [], [], 8, 64)
    assert len(tokens) == 3  # the starting length
    tokens, _, _ = store.propose_scored(session, [text[2], text[3]], [], 8, 64, verified_depth=1)
    assert len(tokens) == 4  # hit ratio 1/1: 750 per mille, grows
    tokens, _, _ = store.propose_scored(session, [text[20]], [], 8, 64, verified_depth=0)
    assert len(tokens) == 4  # nothing verified: no news
