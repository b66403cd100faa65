"""lookahead: the pure reference (literal arrays) and the Redis store held to it (hypothesis)."""

from __future__ import annotations

import doctest
import struct
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

import tests.references.lookahead
from pardec.drafter.encoding import SessionNotFound
from pardec.drafter.redis_server import RedisServer
from pardec.runtime.draft_params import LookaheadParams
from tests.references.lookahead import (
    EXCLUDED,
    LookaheadSession,
    add_to_pool,
    advance_window,
    initial_level,
    layout_tree,
    outputs_of,
    sequence_ngrams,
)
from tests.references.stores import LookaheadStore


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("la-redis")) as server:
        connection = redis.Redis.from_url(server.url)
        yield connection
        connection.close()


@pytest.fixture
def session_id():
    return f"la-{uuid.uuid4().hex}"


def depths(parents):
    result = []
    for parent in parents:
        result.append(1 if parent == -1 else result[parent] + 1)
    return result


def assert_well_formed(tokens, parents, max_nodes, max_depth):
    assert len(tokens) == len(parents) <= max_nodes
    assert all(-1 <= parent < index for index, parent in enumerate(parents))
    assert all(depth <= max_depth for depth in depths(parents))
    siblings = list(zip(parents, tokens))
    assert len(set(siblings)) == len(siblings), "sibling tokens are merged"


def test_docstring_examples():
    failures, tried = doctest.testmod(tests.references.lookahead)
    assert tried > 10 and failures == 0


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"level": 2}, "level"),
        ({"level": 17}, "level"),
        ({"window": 0}, "window"),
        ({"guess_set_size": 17}, "guess_set_size"),
    ],
)
def test_params_are_validated(options, field):
    with pytest.raises(ValueError, match=field):
        LookaheadParams(**options)


def test_max_tree_nodes_is_mindie_speculation_gamma():
    assert LookaheadParams(4, 5, 5).max_tree_nodes == 30
    assert LookaheadParams(16, 16, 16).max_tree_nodes == 480


def test_initial_level_spreads_over_the_prompt():
    assert initial_level(list(range(100, 116)), 4) == [0, 104, 108, 112]
    assert initial_level([1, 2], 4) == [0, 1, 2, 2]
    assert initial_level([3], 1) == [0]


def test_sequence_ngrams():
    assert sequence_ngrams([1, 2, 3, 4, 5], 4) == [(1, (2, 3, 4)), (2, (3, 4, 5))]
    assert sequence_ngrams([1, 2], 3) == []


def test_pool_keeps_the_most_recently_seen():
    pool: dict = {}
    for ngram in [(1, 1), (2, 2), (3, 3), (1, 1), (4, 4)]:
        add_to_pool(pool, 7, ngram, guess_set_size=3)
    assert pool == {7: [(4, 4), (1, 1), (3, 3)]}
    add_to_pool(pool, 8, (9, 9), guess_set_size=3)
    assert pool[8] == [(9, 9)] and pool[7] == [(4, 4), (1, 1), (3, 3)]


def test_window_warms_up_then_slides():
    levels = [[50, 1, 2, 3]]
    levels, harvest = advance_window(levels, [11, 12, 13, 14], level=4)
    assert (levels, harvest) == ([[50, 1, 2, 3], [11, 12, 13, 14]], [])
    levels, harvest = advance_window(levels, [21, 22, 23, 24], level=4)
    assert (levels, harvest) == ([[50, 1, 2, 3], [11, 12, 13, 14], [21, 22, 23, 24]], [])
    levels, harvest = advance_window(levels, [31, 32, 33, 34], level=4)
    assert levels == [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]]
    assert harvest == [(50, (11, 21, 31)), (1, (12, 22, 32)), (2, (13, 23, 33)), (3, (14, 24, 34))]


def test_outputs_need_every_deepest_cell_in_the_verified_prefix():
    assert outputs_of([1, 2], [7, 8, 9]) == [8, 9]
    assert outputs_of([1, 2], [7, 8, 9, 10]) == [8, 9]  # nodes after the window's (shared memory)
    assert outputs_of([1, 3], [7, 8, 9]) is None  # the gateway verified a prefix without row 3
    assert outputs_of(None, [7]) is None
    assert outputs_of([1, EXCLUDED], [7, 8, 9]) is None


def test_layout_of_a_full_window_without_candidates():
    # level 3, window 3: (0,1) (0,2) | (1,0) (1,1) (1,2); (1,0) hangs under the root.
    # Sorted by depth (window cells score WINDOW_HIT * CONTINUE^(depth-1)), then discovery.
    tree = layout_tree([[9, 1, 2], [4, 5, 6]], [], max_nodes=16, max_depth=16)
    assert tree.tokens == [1, 4, 2, 5, 6]
    assert tree.parents == [-1, -1, 0, 0, 2]
    assert depths(tree.parents) == [1, 1, 2, 2, 3]
    assert tree.scores == pytest.approx([0.1, 0.1, 0.08, 0.08, 0.064])
    assert tree.deepest_rows == [2, 4, 5]


def test_layout_merges_candidates_with_shared_prefixes():
    tree = layout_tree([[9]], [(1, 2, 3), (1, 2, 4), (5, 6, 7)], max_nodes=16, max_depth=16)
    assert (tree.tokens, tree.parents) == ([1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 1, -1, 4, 5])
    assert tree.deepest_rows == [0]  # a window of width 1 is the root alone
    # Recency weights 1, 1/2, 1/4 (total 7/4): node 1 carries 3/7 of them, 5 the other 1/7.
    share = [6 / 7, 6 / 7, 4 / 7, 2 / 7, 1 / 7, 1 / 7, 1 / 7]
    prior = [0.6 * 0.8 ** (depth - 1) for depth in (1, 2, 3, 3, 1, 2, 3)]
    assert tree.scores == pytest.approx([s * p for s, p in zip(share, prior)])


@pytest.mark.parametrize(
    ("levels", "candidates"),
    [
        ([[9, 1, 2], [4, 5, 6]], [(7, 8)]),
        ([[9, 1, 2], [4, 5, 6], [1, 2, 3]], [(1, 2, 9), (4, 4, 4), (1, 5, 6)]),
        ([[9]], [(1, 2, 3), (1, 2, 4), (5, 6, 7)]),
    ],
)
def test_every_prefix_of_a_layout_is_a_tree_best_first(levels, candidates):
    tree = layout_tree(levels, candidates, max_nodes=64, max_depth=64)
    assert tree.scores == sorted(tree.scores, reverse=True)
    for n in range(len(tree.tokens) + 1):
        assert_well_formed(tree.tokens[:n], tree.parents[:n], n, 64)
        # The budget cut is that same prefix.
        cut = layout_tree(levels, candidates, max_nodes=n, max_depth=64)
        assert (cut.tokens, cut.parents) == (tree.tokens[:n], tree.parents[:n])


@pytest.mark.parametrize(
    ("max_nodes", "max_depth", "tokens", "parents", "rows"),
    [
        # The candidate (0.6, 0.48) outranks the window (0.1 at depth 1, then x 0.8 per level).
        (16, 16, [7, 8, 1, 4, 2, 5, 6], [-1, 0, -1, -1, 2, 2, 4], [4, 6, 7]),
        (4, 16, [7, 8, 1, 4], [-1, 0, -1, -1], [4, EXCLUDED, EXCLUDED]),
        (16, 1, [7, 1, 4], [-1, -1, -1], [3, EXCLUDED, EXCLUDED]),
        (16, 0, [], [], [EXCLUDED] * 3),
        (0, 16, [], [], [EXCLUDED] * 3),
    ],
)
def test_layout_budgets(max_nodes, max_depth, tokens, parents, rows):
    tree = layout_tree([[9, 1, 2], [4, 5, 6]], [(7, 8)], max_nodes=max_nodes, max_depth=max_depth)
    assert (tree.tokens, tree.parents, tree.deepest_rows) == (tokens, parents, rows)


# --- the Redis store ---------------------------------------------------------------------------


def test_store_reproduces_the_docstring_session(client, session_id):
    store = LookaheadStore(client)
    params = LookaheadParams(level=3, window=2, guess_set_size=2)
    store.start_session(session_id, [5, 6, 7, 5, 6, 8], params)
    assert store.propose(session_id, [5], [], max_nodes=8, max_depth=8) == ([6, 8, 7, 5], [-1, 0, 0, -1])
    tokens, parents = store.propose(session_id, [6, 8], [6, 8, 1, 2, 3], max_nodes=8, max_depth=8)
    state = client.hget(f"pardec:{{{session_id}}}:la_state", "levels")
    assert list(struct.unpack(">4I", state)) == [8, 5, 6, 3]


def test_store_keys_ttl_and_end(client, session_id):
    store = LookaheadStore(client, ttl_s=100)
    store.start_session(session_id, [1, 2, 3, 1, 2], LookaheadParams())
    store.propose(session_id, [4], [], max_nodes=30, max_depth=30)
    keys = client.keys(f"*{{{session_id}}}*")
    names = ("la_state", "la_pool", "tokens")
    assert sorted(keys) == sorted(f"pardec:{{{session_id}}}:{name}".encode() for name in names)
    assert len({key_slot(key) for key in keys}) == 1
    assert all(0 < client.ttl(key) <= 100 for key in keys)
    store.end_session(session_id)
    assert client.keys(f"*{{{session_id}}}*") == []
    with pytest.raises(SessionNotFound):
        store.propose(session_id, [1], [], max_nodes=4, max_depth=4)


def test_store_without_prompt_or_budget(client, session_id):
    store = LookaheadStore(client)
    store.start_session(session_id, [], LookaheadParams(level=3, window=2, guess_set_size=1))
    assert store.propose(session_id, [], [], max_nodes=8, max_depth=8) == ([], [])
    assert store.propose(session_id, [4], [], max_nodes=0, max_depth=8) == ([], [])
    # The root's own argmax is always there; with window 2 the cell (0, 1) was not, so no advance.
    assert store.propose(session_id, [4], [4], max_nodes=8, max_depth=8) == ([0], [-1])


def bigram_model(token: int) -> int:
    """A toy model whose greedy next token depends on the last token only (one cycle of 96)."""
    return (token * 5 + 1) % 97


def greedy_accept(root, tokens, parents, model):
    """The verifier's greedy walk: per-node argmax, accepted tokens and the bonus."""
    argmax = [model(root)] + [model(token) for token in tokens]
    accepted, row = [], 0
    while True:
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == row - 1 and t == argmax[row]), None)
        if child is None:
            return argmax, accepted, argmax[row]
        accepted.append(tokens[child])
        row = child + 1


def test_jacobi_drafts_get_accepted_against_a_toy_model(client, session_id):
    """Drafts get accepted before the committed text ever repeats itself, so the hits come from
    the window's harvest, not from the text's own n-grams. Lossless either way: the committed
    text is the model's, only the accepted rate moves."""
    store = LookaheadStore(client)
    params = LookaheadParams(level=4, window=5, guess_set_size=5)
    prompt = [1, 2, 3, 4]
    store.start_session(session_id, prompt, params)
    new_tokens, argmax, committed, accepted_per_step = [bigram_model(4)], [], list(prompt), []
    for _ in range(12):
        committed += new_tokens
        tokens, parents = store.propose(session_id, new_tokens, argmax, params.max_tree_nodes, 64)
        assert_well_formed(tokens, parents, params.max_tree_nodes, 64)
        argmax, accepted, bonus = greedy_accept(committed[-1], tokens, parents, bigram_model)
        accepted_per_step.append(len(accepted))
        new_tokens = [*accepted, bonus]
    expected = list(prompt)
    while len(expected) < len(committed):
        expected.append(bigram_model(expected[-1]))
    assert committed == expected
    assert len(committed) < 96 and sum(accepted_per_step) >= 6, accepted_per_step


def test_window_columns_are_model_chains():
    """Each column read downwards (below level 0's root cell) is the model continuing itself one
    token per step, which is what makes the harvested n-grams worth drafting."""
    params = LookaheadParams(level=5, window=4, guess_set_size=3)
    session = LookaheadSession(params)
    session.start([10, 20, 30, 40, 50])
    new_tokens, argmax, committed = [bigram_model(50)], [], [10, 20, 30, 40, 50]
    for step in range(10):
        committed += new_tokens
        tree = session.propose(new_tokens, argmax, params.max_tree_nodes, 64)
        if step >= params.level - 2:  # warmed up
            assert len(session.levels) == params.level - 1
            for level in range(len(session.levels) - 1):
                first_column = 1 if level == 0 else 0
                for column in range(first_column, params.window):
                    assert session.levels[level + 1][column] == bigram_model(session.levels[level][column])
        argmax, accepted, bonus = greedy_accept(committed[-1], tree.tokens, tree.parents, bigram_model)
        new_tokens = [*accepted, bonus]


# Small vocabularies make repeats (and so candidates and merges) likely.
tokens_strategy = st.lists(st.one_of(st.integers(0, 3), st.just(2**32 - 1)), max_size=12)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=tokens_strategy,
    memory=tokens_strategy,
    level=st.integers(3, 5),
    window=st.integers(1, 4),
    guess_set_size=st.integers(1, 3),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), max_size=4),  # new tokens
            st.integers(0, 40),  # max_nodes
            st.integers(0, 9),  # max_depth
            st.one_of(st.none(), st.integers(0, 3)),  # argmax: the right length, or garbage
            st.booleans(),  # argmax of the wrong length
        ),
        max_size=6,
    ),
)
def test_store_matches_the_reference(client, prompt, memory, level, window, guess_set_size, steps):
    params = LookaheadParams(level, window, guess_set_size)
    store, reference = LookaheadStore(client), LookaheadSession(params)
    session = f"prop-{uuid.uuid4().hex}"
    store.start_session(session, prompt, params, memory_tokens=memory)
    reference.start(prompt, memory)
    nodes = 0
    try:
        for new_tokens, max_nodes, max_depth, fill, wrong_length in steps:
            argmax = [fill if fill is not None else (i * 5 + nodes) % 4 for i in range(nodes + 1)]
            if wrong_length:  # too short for the previous tree, or longer (extra nodes after it)
                argmax = argmax[:-1] if fill is None else argmax + [fill]
            expected = reference.propose(new_tokens, argmax, max_nodes, max_depth)
            tokens, parents = store.propose(session, new_tokens, argmax, max_nodes, max_depth)
            assert (tokens, parents) == (expected.tokens, expected.parents)
            assert_well_formed(tokens, parents, max_nodes, max_depth)
            nodes = len(tokens)
        stored = client.hget(f"pardec:{{{session}}}:la_state", "levels")
        flat_levels = [token for row in reference.levels for token in row]
        assert list(struct.unpack(f">{len(stored) // 4}I", stored)) == flat_levels
        for key, continuations in reference.pool.items():
            value = client.hget(f"pardec:{{{session}}}:la_pool", struct.pack(">I", key))
            assert value == b"".join(struct.pack(f">{level - 1}I", *ngram) for ngram in continuations)
    finally:
        store.end_session(session)
