"""memory_decoding store against a real redis-server, cross-checked with a pure-Python trie."""

from __future__ import annotations

import struct
import time
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from pardec.drafter.encoding import SessionNotFound
from pardec.drafter.redis_server import RedisServer, find_redis_server
from pardec.drafter.trie import PROMPT_WEIGHT
from tests.references.stores import MemoryDecodingStore
from tests.references.trie import ReferenceCopy, reference_propose, reference_step

EXAMPLE = [1, 2, 3, 1, 2, 4, 1, 2]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("trie-redis")) as server:
        connection = redis.Redis.from_url(server.url)
        yield connection
        connection.close()


@pytest.fixture
def session_id():
    return f"test-{uuid.uuid4().hex}"


def stored_counts(client, session_id, path, key_prefix="pardec"):
    """(prompt, output) counts of the node for `path` (2 tokens or more), read from the raw Redis
    layout: a node's counts are an entry in its parent's field."""
    trie_key = f"{key_prefix}:{{{session_id}}}:trie"
    node_id = 0
    for token in path[:-1]:
        value = client.hget(trie_key, struct.pack(">II", node_id, token))
        assert value is not None, f"no node for a prefix of {path}"
        (node_id,) = struct.unpack_from(">I", value)
    for offset in range(4, len(value), 16):
        token, prompt, output, _ = struct.unpack_from(">IIII", value, offset)
        if token == path[-1]:
            return prompt, output
    raise AssertionError(f"no node for {path}")


def depths(parents):
    result = []
    for parent in parents:
        result.append(1 if parent == -1 else result[parent] + 1)
    return result


def test_docstring_example(client, session_id):
    store = MemoryDecodingStore(client, branch_length=3)
    store.start_session(session_id, EXAMPLE)
    # The trie's tree is [3, 4, 1, 1]; the copy chain [4, 1, 2, 4] (from the latest [1, 2], then
    # from its own start again) joins it.
    assert store.propose(session_id, [], max_nodes=16, max_depth=4) == ([4, 1, 3, 1, 2, 4], [-1, 0, -1, 2, 1, 4])


def test_longer_branches_continue_each_occurrence(client, session_id):
    store = MemoryDecodingStore(client, branch_length=4)
    store.start_session(session_id, EXAMPLE)
    assert store.propose(session_id, [], max_nodes=16, max_depth=3) == (
        [4, 1, 3, 1, 2, 2],
        [-1, 0, -1, 2, 1, 3],
    )


def test_falls_back_to_last_token_when_pair_was_never_continued(client, session_id):
    store = MemoryDecodingStore(client, branch_length=3)
    # (9, 6) occurs only at the end; the node [6] has children 7 and 8. The copy chain goes on
    # after the latest 6: [8, 9, 6] (then again from 8, below depth 3).
    store.start_session(session_id, [5, 6, 7, 5, 6, 8, 9, 6])
    assert store.propose(session_id, [], max_nodes=16, max_depth=3) == (
        [8, 9, 7, 5, 6, 6],
        [-1, 0, -1, 2, 1, 3],
    )


@pytest.mark.parametrize(
    ("max_nodes", "max_depth", "expected"),
    [
        (3, 8, ([4, 1, 3], [-1, 0, -1])),
        (5, 8, ([4, 1, 3, 1, 2], [-1, 0, -1, 2, 1])),
        (16, 1, ([4, 3], [-1, -1])),
        (16, 2, ([4, 1, 3, 1], [-1, 0, -1, 2])),
        (1, 1, ([4], [-1])),
        (0, 8, ([], [])),
        (16, 0, ([], [])),
    ],
)
def test_budgets(client, session_id, max_nodes, max_depth, expected):
    store = MemoryDecodingStore(client, branch_length=4)
    store.start_session(session_id, EXAMPLE)
    assert store.propose(session_id, [], max_nodes=max_nodes, max_depth=max_depth) == expected


def test_empty_budget_still_records_tokens(client, session_id):
    store = MemoryDecodingStore(client, branch_length=4)
    store.start_session(session_id, [1, 2, 3, 1])
    assert store.propose(session_id, [2, 4, 1, 2], max_nodes=0, max_depth=8) == ([], [])
    copy = ReferenceCopy(branch_length=4)
    reference_step(copy, EXAMPLE, [2, 4, 1, 2], 4, max_nodes=0, max_depth=8)
    assert store.propose(session_id, [], max_nodes=16, max_depth=8) == reference_step(
        copy, EXAMPLE, [], 4, max_nodes=16, max_depth=8
    )
    stored = client.get(f"pardec:{{{session_id}}}:tokens")
    assert list(struct.unpack(f">{len(EXAMPLE)}I", stored)) == EXAMPLE


def test_incremental_insertion_equals_inserting_at_once(client):
    store = MemoryDecodingStore(client, branch_length=5)
    prompt = [7, 1, 2, 7, 1, 3, 2]
    output = [7, 1, 2, 7, 1, 2, 2, 3, 7, 1, 2, 7, 4, 4, 1]
    by_pieces, at_once = f"pieces-{uuid.uuid4().hex}", f"at-once-{uuid.uuid4().hex}"
    store.start_session(by_pieces, prompt)
    store.start_session(at_once, prompt)
    copy, committed = ReferenceCopy(branch_length=5), list(prompt)
    for piece in ([7], [], [1, 2, 7], [1], [2, 2, 3, 7, 1, 2], [7, 4, 4, 1]):
        committed += piece
        tree = store.propose(by_pieces, piece, max_nodes=4, max_depth=3)
        assert tree == reference_step(copy, committed, piece, len(prompt), max_nodes=4, max_depth=3)
    store.propose(at_once, output, max_nodes=0, max_depth=0)
    for suffix in ("trie", "tokens", "state"):
        piece_key, at_once_key = f"pardec:{{{by_pieces}}}:{suffix}", f"pardec:{{{at_once}}}:{suffix}"
        assert client.exists(piece_key)
        assert _contents(client, piece_key) == _contents(client, at_once_key)


def _contents(client, key):
    """A key's value; of a state, what the trie is (the copy's record depends on the steps)."""
    if client.type(key) != b"hash":
        return client.get(key)
    return {name: value for name, value in client.hgetall(key).items() if not name.startswith(b"copy_")}


def test_prompt_and_output_counts(client, session_id):
    store = MemoryDecodingStore(client, branch_length=3)
    store.start_session(session_id, [1, 2])
    store.propose(session_id, [5], max_nodes=0, max_depth=0)
    # The path [1, 2, 5] starts in the prompt; it counts as output from its generated token on.
    assert stored_counts(client, session_id, [1, 2]) == (1, 0)
    assert stored_counts(client, session_id, [1, 2, 5]) == (0, 1)
    assert stored_counts(client, session_id, [2, 5]) == (0, 1)


def test_prompt_evidence_outranks_output_evidence(client, session_id):
    assert PROMPT_WEIGHT == 4
    store = MemoryDecodingStore(client, branch_length=3)
    prompt, output = [1, 2, 3, 9], [1, 2, 4, 8] * 3 + [1, 2]
    # After (1, 2): 3 once in the prompt (weight 4) against 4 three times in the output (weight 3).
    # The trie ranks 3 first (the reference, which the property tests tie to the script); the
    # copy chain (4, after the latest [1, 2]) still puts 4 first in the merged tree.
    store.start_session(session_id, prompt)
    assert store.propose(session_id, output, max_nodes=2, max_depth=1) == ([4, 3], [-1, -1])
    assert stored_counts(client, session_id, [1, 2, 3]) == (1, 0)
    assert stored_counts(client, session_id, [1, 2, 4]) == (0, 3)
    assert reference_propose(prompt + output, 4, 3, max_nodes=2, max_depth=1) == ([3, 4], [-1, -1])
    # A fourth time ties (weight 4 each): the lower token goes first; a fifth time wins.
    output += [4, 8, 1, 2]
    assert reference_propose(prompt + output, 4, 3, max_nodes=2, max_depth=1) == ([3, 4], [-1, -1])
    output += [4, 8, 1, 2]
    assert reference_propose(prompt + output, 4, 3, max_nodes=2, max_depth=1) == ([4, 3], [-1, -1])


def test_ttl_is_set_and_refreshed(client, session_id):
    store = MemoryDecodingStore(client, ttl_s=100)
    store.start_session(session_id, EXAMPLE)
    keys = [f"pardec:{{{session_id}}}:{suffix}" for suffix in ("trie", "tokens", "state")]
    assert all(0 < client.ttl(key) <= 100 for key in keys)
    for key in keys:
        client.expire(key, 5)
    store.propose(session_id, [3], max_nodes=4, max_depth=2)
    assert all(50 < client.ttl(key) <= 100 for key in keys)


def test_expired_session_is_not_found(client, session_id):
    store = MemoryDecodingStore(client, ttl_s=1)
    store.start_session(session_id, EXAMPLE)
    for key in client.keys(f"pardec:{{{session_id}}}:*"):
        client.pexpire(key, 1)
    time.sleep(0.01)
    with pytest.raises(SessionNotFound):
        store.propose(session_id, [], max_nodes=4, max_depth=2)


def test_end_session_deletes_everything_and_is_idempotent(client, session_id):
    store = MemoryDecodingStore(client)
    store.start_session(session_id, EXAMPLE)
    assert len(client.keys(f"*{{{session_id}}}*")) == 3
    store.end_session(session_id)
    assert client.keys(f"*{{{session_id}}}*") == []
    store.end_session(session_id)
    with pytest.raises(SessionNotFound):
        store.propose(session_id, [1], max_nodes=4, max_depth=2)


def test_unknown_session(client):
    store = MemoryDecodingStore(client)
    with pytest.raises(SessionNotFound) as raised:
        store.propose("never-started", [1, 2], max_nodes=4, max_depth=2)
    assert isinstance(raised.value, KeyError)
    assert client.keys("*never-started*") == []


def test_start_session_replaces_existing_state(client, session_id):
    store = MemoryDecodingStore(client, branch_length=4)
    store.start_session(session_id, [1, 2, 9, 9, 1, 2, 8])
    store.propose(session_id, [5, 5], max_nodes=4, max_depth=2)
    store.start_session(session_id, EXAMPLE)
    assert store.propose(session_id, [], max_nodes=16, max_depth=3) == ([4, 1, 3, 1, 2, 2], [-1, 0, -1, 2, 1, 3])


def test_sessions_and_prefixes_do_not_interfere(client):
    store = MemoryDecodingStore(client, branch_length=4)
    other_prefix = MemoryDecodingStore(client, branch_length=4, key_prefix="elsewhere")
    first, second = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    store.start_session(first, EXAMPLE)
    store.start_session(second, [5, 6, 7, 5, 6, 8, 9, 6])
    other_prefix.start_session(first, [1, 2, 5, 1, 2])
    store.propose(second, [7, 5, 6], max_nodes=4, max_depth=2)
    assert store.propose(first, [], max_nodes=16, max_depth=3) == ([4, 1, 3, 1, 2, 2], [-1, 0, -1, 2, 1, 3])
    store.end_session(first)
    assert store.propose(second, [], max_nodes=16, max_depth=8) == (
        [8, 9, 7, 5, 6, 6, 7, 5, 6, 8, 9],
        [-1, 0, -1, 2, 1, 3, 4, 6, 7, 8, 9],
    )
    assert other_prefix.propose(first, [], max_nodes=16, max_depth=3) == ([5, 1, 2], [-1, 0, 1])


def test_keys_share_one_cluster_slot(client, session_id):
    store = MemoryDecodingStore(client)
    store.start_session(session_id, EXAMPLE)
    keys = client.keys(f"*{{{session_id}}}*")
    assert len(keys) == 3
    assert len({key_slot(key) for key in keys}) == 1


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda store: store.propose("s", [1], max_nodes=-1, max_depth=2), "max_nodes"),
        (lambda store: store.propose("s", [1], max_nodes=10**6, max_depth=2), "max_nodes"),
        (lambda store: store.propose("s", [1], max_nodes=4, max_depth=-1), "max_depth"),
        (lambda store: store.propose("s", [1], max_nodes=4, max_depth=2**40), "max_depth"),
        (lambda store: store.propose("s", [-1], max_nodes=4, max_depth=2), "new_tokens"),
        (lambda store: store.start_session("s", [2**32]), "prompt_tokens"),
        (lambda store: store.start_session("s", ["a"]), "prompt_tokens"),
        (lambda store: store.start_session("", [1]), "session_id"),
        (lambda store: store.start_session("a}b", [1]), "session_id"),
        (lambda store: store.end_session("x" * 1000), "session_id"),
    ],
)
def test_bad_arguments(client, call, argument):
    with pytest.raises(ValueError, match=argument):
        call(MemoryDecodingStore(client))


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"ttl_s": 0}, "ttl_s"),
        ({"branch_length": 0}, "branch_length"),
        ({"branch_length": 1000}, "branch_length"),
        ({"key_prefix": "a{b"}, "key_prefix"),
        ({"key_prefix": ""}, "key_prefix"),
    ],
)
def test_bad_store_options(client, options, argument):
    with pytest.raises(ValueError, match=argument):
        MemoryDecodingStore(client, **options)


# Small vocabularies make repeats (and so real trees) likely; 2**32 - 1 checks the encoding's edge.
tokens_strategy = st.lists(st.one_of(st.integers(0, 3), st.just(2**32 - 1)), max_size=24)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=tokens_strategy,
    pieces=st.lists(tokens_strategy, max_size=4),
    branch_length=st.integers(1, 6),
    max_nodes=st.integers(0, 24),
    max_depth=st.integers(0, 8),
)
def test_trees_are_well_formed_and_match_the_reference(client, prompt, pieces, branch_length, max_nodes, max_depth):
    store = MemoryDecodingStore(client, branch_length=branch_length)
    session = f"prop-{uuid.uuid4().hex}"
    store.start_session(session, prompt)
    committed, copy = list(prompt), ReferenceCopy(branch_length)
    try:
        for piece in [*pieces, []]:
            committed += piece
            tokens, parents = store.propose(session, piece, max_nodes=max_nodes, max_depth=max_depth)
            assert len(tokens) == len(parents) <= max_nodes
            assert all(-1 <= parent < index for index, parent in enumerate(parents))
            assert all(depth <= max_depth for depth in depths(parents))
            siblings = [(parent, token) for parent, token in zip(parents, tokens)]
            assert len(set(siblings)) == len(siblings)
            assert (tokens, parents) == reference_step(copy, committed, piece, len(prompt), max_nodes, max_depth)
    finally:
        store.end_session(session)


def test_restart_loses_sessions_and_reloads_the_script(tmp_path):
    with RedisServer(tmp_path, executable=find_redis_server()) as server:
        connection = redis.Redis.from_url(server.url)
        store = MemoryDecodingStore(connection, branch_length=3)
        store.start_session("s", EXAMPLE)
        server.restart()
        # The data is gone (no persistence) and the script cache too: EVALSHA must fall back.
        with pytest.raises(SessionNotFound):
            store.propose("s", [], max_nodes=4, max_depth=2)
        store.start_session("s", EXAMPLE)
        assert store.propose("s", [], max_nodes=16, max_depth=3) == ([4, 1, 3, 1, 2], [-1, 0, -1, 2, 1])
        connection.close()
    server.stop()  # stopping twice is fine


def test_server_that_cannot_start_reports_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited"):
        RedisServer(tmp_path, executable="/bin/false").start()


def test_socket_path_too_long_is_refused(tmp_path):
    with pytest.raises(ValueError, match="too long"):
        RedisServer(tmp_path / ("d" * 120))


def test_depth_beyond_branch_length_is_harmless(client, session_id):
    store = MemoryDecodingStore(client, branch_length=4)
    store.start_session(session_id, EXAMPLE)
    # The trie's tree stops at branch_length; the copy chain [4, 1, 2], periodic, at max_nodes.
    assert store.propose(session_id, [], max_nodes=16, max_depth=2**31 - 1) == (
        [4, 1, 3, 1, 2, 2, 4, 1, 2, 4, 1, 2, 4, 1, 2, 4],
        [-1, 0, -1, 2, 1, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    )


def test_memory_tokens_count_as_output_and_stay_apart_from_the_prompt(client, session_id):
    store = MemoryDecodingStore(client, branch_length=3)
    store.start_session(session_id, [1, 2], memory_tokens=[1, 2, 9, 9])
    assert stored_counts(client, session_id, [1, 2]) == (1, 1)
    assert stored_counts(client, session_id, [2, 9, 9]) == (0, 1)
    with pytest.raises(AssertionError):
        stored_counts(client, session_id, [9, 9, 1])  # the memory does not run on into the prompt
    assert client.get(f"pardec:{{{session_id}}}:tokens") == struct.pack(">2I", 1, 2)
    assert store.propose(session_id, [], max_nodes=16, max_depth=8) == ([9, 9], [-1, 0])


def test_dynamic_length_starts_at_three(client, session_id):
    store = MemoryDecodingStore(client, branch_length=12)
    store.start_session(session_id, list(range(20)) + [0, 1], dynamic_max_length=16)
    assert store.propose(session_id, [], max_nodes=16, max_depth=64) == ([2, 3, 4], [-1, 0, 1])
    store.start_session(session_id, list(range(20)) + [0, 1], dynamic_max_length=2)
    assert store.propose(session_id, [], max_nodes=16, max_depth=64) == ([2, 3], [-1, 0])


def test_a_loop_is_drafted_past_the_end_of_the_text(client, session_id):
    # The output loops on [1, 2]: the trie's paths stop at branch_length (3), the copy chain
    # goes on from its own start for as deep as asked.
    store = MemoryDecodingStore(client, branch_length=3)
    store.start_session(session_id, [7, 8, 9])
    assert store.propose(session_id, [1, 2, 1, 2, 1, 2], max_nodes=8, max_depth=7) == (
        [1, 2, 1, 2, 1, 2, 1],
        [-1, 0, 1, 2, 3, 4, 5],
    )
