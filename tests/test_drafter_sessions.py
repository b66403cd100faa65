"""SessionStore (both algorithms behind one script), dynamic_algo, and the drafting memories."""

from __future__ import annotations

import doctest
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pardec.drafter.memory
import tests.references.adaptive
from pardec.drafter.encoding import SessionNotFound, pack_tokens
from pardec.drafter.memory import MAX_ENTRIES, SharedMemory, parse_entries, update_entries
from pardec.drafter.redis_server import RedisServer
from pardec.drafter.sessions import SessionStore
from pardec.runtime.draft_params import DraftParams
from tests.references.adaptive import adapt_length, start_length
from tests.references.lookahead import LookaheadSession
from tests.references.stores import MemoryDecodingStore

PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 5, 6, 1, 2, 3]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("sessions-redis")) as server:
        connection = redis.Redis.from_url(server.url)
        yield connection
        connection.close()


def new_id(kind="s"):
    return f"{kind}-{uuid.uuid4().hex}"


def test_docstring_examples():
    for module in (tests.references.adaptive, pardec.drafter.memory):
        failures, tried = doctest.testmod(module)
        assert tried > 0 and failures == 0, module.__name__


def test_memory_decoding_through_the_dispatcher_equals_its_own_store(client):
    store, alone = SessionStore(client, branch_length=4), MemoryDecodingStore(client, branch_length=4)
    session, reference = new_id(), new_id()
    store.start_session(session, PROMPT, DraftParams())
    alone.start_session(reference, PROMPT)
    for new_tokens in ([1], [2, 3], [], [1, 2, 4, 1]):
        assert store.propose(session, new_tokens, [9, 9], 16, 8) == alone.propose(reference, new_tokens, 16, 8)


def test_lookahead_through_the_dispatcher_equals_the_reference(client):
    params = DraftParams("la", level=3, window=3, guess_set_size=2)
    store, reference = SessionStore(client), LookaheadSession(params)
    session = new_id()
    store.start_session(session, PROMPT, params)
    reference.start(PROMPT)
    argmax = []
    for new_tokens in ([1], [2], [3, 1], [2]):
        expected = reference.propose(new_tokens, argmax, 12, 12)
        assert store.propose(session, new_tokens, argmax, 12, 12) == (expected.tokens, expected.parents)
        argmax = [(7 * i + len(new_tokens)) % 6 for i in range(len(expected.tokens) + 1)]


def test_a_session_id_reused_for_the_other_algorithm_starts_clean(client):
    store, session = SessionStore(client), new_id()
    store.start_session(session, PROMPT, DraftParams())
    store.propose(session, [1], [], 16, 8)
    store.start_session(session, PROMPT, DraftParams("la"))
    names = {key.decode().rsplit(":", 1)[1] for key in client.keys(f"*{{{session}}}*")}
    assert names == {"meta", "la_state", "la_pool", "tokens"}
    store.end_session(session)
    assert client.keys(f"*{{{session}}}*") == []
    with pytest.raises(SessionNotFound):
        store.propose(session, [1], [], 16, 8)
    store.end_session(session)  # idempotent


# --- dynamic_algo ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    decoding_length=st.integers(1, 16),
    steps=st.lists(st.tuples(st.lists(st.integers(1, 3), max_size=6), st.integers(0, 16)), max_size=10),
)
def test_dynamic_length_follows_the_reference(client, decoding_length, steps):
    """The Lua side of dynamic_algo against tests/references/adaptive.py: each tree must equal the fixed-
    length store's tree for the length the reference predicts."""
    store, fixed = SessionStore(client, branch_length=4), MemoryDecodingStore(client, branch_length=4)
    session, reference = new_id("dyn"), new_id("fixed")
    store.start_session(session, PROMPT, DraftParams(decoding_length=decoding_length, dynamic_algo=True))
    fixed.start_session(reference, PROMPT)
    length, average, last_depth = start_length(decoding_length), tests.references.adaptive.START_AVERAGE, 0
    for new_tokens, max_nodes in steps:
        length, average = adapt_length(length, average, len(new_tokens), last_depth, decoding_length)
        expected = fixed.propose(reference, new_tokens, min(max_nodes, length), 64)
        assert store.propose(session, new_tokens, [], max_nodes, 64) == expected
        depths = []
        for parent in expected[1]:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        last_depth = max(depths, default=0)
    store.end_session(session)
    fixed.end_session(reference)


def test_dynamic_length_grows_on_hits_and_shrinks_on_misses(client):
    store, session = SessionStore(client, branch_length=12), new_id()
    text = list(range(100, 140))
    store.start_session(session, text + text[:2], DraftParams(decoding_length=8, dynamic_algo=True))
    sizes, committed = [], text[:2]
    tokens, parents = store.propose(session, [], [], 8, 64)
    for _ in range(6):  # the text repeats: every draft hits
        sizes.append(len(tokens))
        accepted = tokens[: len(tokens)]  # a chain here: each node's parent is the one before
        assert parents == list(range(-1, len(tokens) - 1))
        nxt = text[(len(committed) + len(accepted)) % len(text)]
        committed += [*accepted, nxt]
        tokens, parents = store.propose(session, [*accepted, nxt], [], 8, 64)
    assert sizes == [3, 4, 5, 6, 7, 8]
    for jump in (20, 5, 30, 10):  # now nothing is accepted: the text jumps elsewhere
        sizes.append(len(tokens))
        tokens, parents = store.propose(session, [text[jump]], [], 8, 64)
    assert sizes[6:] == [8, 8, 7, 6]


# --- memories ------------------------------------------------------------------------------------


def greedy_run(store, session, answer, max_nodes):
    """Commits `answer` step by step as the verifier would, greedy against a known answer;
    returns the mean accepted length."""
    steps, position, new_tokens = 0, 1, answer[:1]
    while position < len(answer):
        tokens, parents = store.propose(session, new_tokens, [], max_nodes, 64)
        accepted, row = [], -1
        while position + len(accepted) < len(answer):
            want = answer[position + len(accepted)]
            child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == row and t == want), None)
            if child is None:
                break
            accepted.append(want)
            row = child
        position += len(accepted)
        new_tokens = [*accepted, *answer[position : position + 1]]
        position += 1
        steps += 1
    return (position - 1) / steps


def test_shared_memory_drafts_a_repeated_request_far_better(client):
    store = SessionStore(client, branch_length=12)
    shared = f"model-{uuid.uuid4().hex}"
    prompt = [7, 8, 9, 10]
    answer = [(i * 37 + 11) % 200 + 1000 for i in range(60)]  # no repeats: the prompt cannot help
    first, second = new_id(), new_id()
    store.start_session(first, prompt, DraftParams(), shared=shared)
    before = greedy_run(store, first, answer, 16)
    store.end_session(first)
    store.start_session(second, prompt, DraftParams(), shared=shared)
    after = greedy_run(store, second, answer, 16)
    store.end_session(second)
    assert before == 1.0 and after > 5.0, (before, after)


def test_shared_memory_helps_lookahead_without_breaking_its_window(client):
    store = SessionStore(client)
    shared, params = f"model-{uuid.uuid4().hex}", DraftParams("la", level=3, window=2, guess_set_size=1)
    answer = [(i * 37 + 11) % 200 + 1000 for i in range(40)]
    first, second = new_id(), new_id()
    store.start_session(first, [7, 8], params, shared=shared)
    greedy_run(store, first, answer, params.tokens_per_step + 8)
    store.end_session(first)
    store.start_session(second, [7, 8], params, shared=shared)
    assert greedy_run(store, second, answer, params.tokens_per_step + 8) > 3.0


def test_conversation_memory_carries_answers_to_the_next_turn(client):
    store, conversation = SessionStore(client, branch_length=12), f"client-{uuid.uuid4().hex}"
    answer = [(i * 37 + 11) % 200 + 1000 for i in range(40)]
    first, second, stranger = new_id(), new_id(), new_id()
    store.start_session(first, [7, 8], DraftParams(), conversation=conversation)
    greedy_run(store, first, answer, 16)
    store.end_session(first)
    key = f"pardec:{{conversation:{conversation}}}:outputs"
    stored = client.get(key)  # the committed output (the drafter never sees the last step's)
    assert len(stored) > 40 and pack_tokens("t", answer).startswith(stored)
    assert 0 < client.ttl(key) <= 3600
    store.start_session(second, [7, 8], DraftParams(), conversation=conversation)
    store.start_session(stranger, [7, 8], DraftParams())
    assert greedy_run(store, second, answer, 16) > 5.0
    assert greedy_run(store, stranger, answer, 16) == 1.0


def test_the_tokens_no_propose_carried_reach_the_memories_at_the_end(client):
    store, conversation = SessionStore(client), f"client-{uuid.uuid4().hex}"
    session = new_id()
    store.start_session(session, [7, 8], DraftParams(), conversation=conversation)
    store.propose(session, [1, 2], [], 4, 4)
    store.end_session(session, [3, 4, 5])  # e.g. rested steps, then the last step's tokens
    assert store.conversations.read(conversation) == [1, 2, 3, 4, 5]
    store.end_session(session, [6])  # an ended (or unknown) session: nothing to record, no error
    assert client.keys(f"*{{{session}}}*") == []


def test_conversation_memory_keeps_only_the_last_tokens(client, monkeypatch):
    monkeypatch.setattr(pardec.drafter.memory, "MAX_CONVERSATION_TOKENS", 5)
    store, conversation = SessionStore(client), f"client-{uuid.uuid4().hex}"
    store.conversations.append(conversation, pack_tokens("t", [1, 2, 3, 4]))
    store.conversations.append(conversation, pack_tokens("t", [5, 6, 7]))
    assert store.conversations.read(conversation) == [3, 4, 5, 6, 7]


def test_shared_memory_is_bounded(client):
    name = f"bounded-{uuid.uuid4().hex}"
    memory = SharedMemory(client, branch_length=3, max_contexts=5, key_prefix="pardec")
    evicted = memory.learn(name, pack_tokens("t", list(range(20))))
    contexts_key, recency_key, _ = memory.keys(name)
    assert evicted == 18 - 5 and client.hlen(contexts_key) == client.zcard(recency_key) == 5
    # The newest contexts survive: (14, 15) .. (18, 19).
    assert memory.propose(name, [14, 15], 8, 8)[0] == [16, 17, 18]
    assert memory.propose(name, [0, 1], 8, 8) == ([], [], [])
    # Learning the old text again brings its context back, evicting a least recently updated one.
    memory.learn(name, pack_tokens("t", [0, 1, 2]))
    assert memory.propose(name, [0, 1], 8, 8)[0] == [2]
    assert memory.propose(name, [13, 14], 8, 8) == ([], [], [])
    assert memory.propose(name, [14, 15], 8, 8)[0] == [16, 17, 18]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(st.integers(0, 3), max_size=14), max_size=4), branch_length=st.integers(1, 4),
       piece=st.sampled_from([1, 2, 5, 4096]))
def test_shared_memory_entries_follow_the_reference(client, monkeypatch, texts, branch_length, piece):
    """Learned in pieces of `piece` contexts or whole, the same entries as the reference."""
    monkeypatch.setattr(pardec.drafter.memory, "LEARN_PIECE_TOKENS", piece)
    name = f"prop-{uuid.uuid4().hex}"
    memory = SharedMemory(client, branch_length=branch_length, max_contexts=1000, key_prefix="pardec")
    reference: dict = {}
    for text in texts:
        memory.learn(name, pack_tokens("t", text))
        for i in range(2, len(text)):
            context = (text[i - 2], text[i - 1])
            update_entries(reference.setdefault(context, []), tuple(text[i : i + branch_length]), MAX_ENTRIES, 16)
    contexts_key = memory.keys(name)[0]
    stored = {
        tuple(int.from_bytes(field[i : i + 4], "big") for i in (0, 4)): parse_entries(value)
        for field, value in client.hgetall(contexts_key).items()
    }
    assert stored == reference
    client.delete(*memory.keys(name))
