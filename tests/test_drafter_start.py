"""Sessions start in pieces (one script call each, so other sessions' calls run in between):
the result is exactly a start in one call, and a session is not there until its last piece. A
memory_decoding start's trie is built by the drafter (trie.TrieImage): byte for byte the trie
memory_decoding.lua builds when it inserts the same tokens itself."""

from __future__ import annotations

import argparse
import inspect
import re
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pardec.drafter import lookahead_store, trie
from pardec.drafter.encoding import SessionNotFound, pack_tokens
from pardec.drafter.lookahead_store import start_pieces
from pardec.drafter.redis_server import RedisServer
from pardec.drafter.sessions import SessionStore
from pardec.runtime.draft_params import DraftParams, LookaheadParams
from tests.references.stores import LookaheadStore, MemoryDecodingStore

EXAMPLE = [1, 2, 3, 1, 2, 4, 1, 2]
ONE_CALL = 2**31


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("start-redis")) as server:
        connection = redis.Redis.from_url(server.url)
        yield connection
        connection.close()


def new_id(kind="s"):
    return f"{kind}-{uuid.uuid4().hex}"


def chunk_tokens(monkeypatch, size):
    """Pieces of `size` trie fields (memory_decoding) or tokens (lookahead)."""
    monkeypatch.setattr(trie, "START_CHUNK_FIELDS", size)
    monkeypatch.setattr(lookahead_store, "START_CHUNK_TOKENS", size)


def contents(client, session):
    """Every key of the session, by its name after the hash tag."""
    found = {}
    for key in client.keys(f"*{{{session}}}*"):
        name = key.decode().rsplit(":", 1)[1]
        found[name] = client.hgetall(key) if client.type(key) == b"hash" else client.get(key)
    return found


def real_prompt(length):
    """The first `length` words, symbols and spaces of a real source file, ids by first
    appearance: the repeats of real text, without loading a tokenizer."""
    pieces = re.findall(r"\w+|[^\w\s]|\s+", inspect.getsource(argparse))
    assert len(pieces) >= length
    ids: dict[str, int] = {}
    return [ids.setdefault(piece, len(ids)) for piece in pieces[:length]]


def test_pieces_cut_memory_then_prompt():
    memory, prompt = bytes(range(12)), bytes(range(100, 120))  # 3 and 5 tokens
    pieces = start_pieces(prompt, memory, 2)
    assert [(len(p) // 4, len(m) // 4, ends, more) for p, m, ends, _, more in pieces] == [
        (0, 2, 0, 1), (1, 1, 1, 1), (2, 0, 0, 1), (2, 0, 0, 0),
    ]  # fmt: skip
    assert b"".join(p for p, *_ in pieces) == prompt and b"".join(m for _, m, *_ in pieces) == memory
    assert len({build_id for *_, build_id, _ in pieces}) == 1
    (empty,) = start_pieces(b"", b"", 2)  # a start is at least one call
    assert empty[:3] + empty[4:] == [b"", b"", 0, 0] and empty[3] != pieces[0][3]


tokens_strategy = st.lists(st.one_of(st.integers(0, 3), st.just(2**32 - 1)), max_size=20)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=tokens_strategy,
    memory=tokens_strategy,
    chunk=st.integers(1, 7),
    branch_length=st.integers(1, 5),
    dynamic_max_length=st.sampled_from([0, 4]),
    outputs=st.lists(st.lists(st.integers(0, 3), max_size=4), max_size=3),
)
def test_memory_decoding_in_pieces_equals_one_call(
    client, monkeypatch, prompt, memory, chunk, branch_length, dynamic_max_length, outputs
):
    store = MemoryDecodingStore(client, branch_length=branch_length)
    whole, pieces = new_id("whole"), new_id("pieces")
    chunk_tokens(monkeypatch, ONE_CALL)
    store.start_session(whole, prompt, dynamic_max_length=dynamic_max_length, memory_tokens=memory)
    chunk_tokens(monkeypatch, chunk)
    store.start_session(pieces, prompt, dynamic_max_length=dynamic_max_length, memory_tokens=memory)
    try:
        assert contents(client, pieces) == contents(client, whole)
        for new_tokens in [*outputs, []]:
            assert store.propose(pieces, new_tokens, 8, 8) == store.propose(whole, new_tokens, 8, 8)
    finally:
        store.end_session(whole)
        store.end_session(pieces)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=tokens_strategy,
    memory=tokens_strategy,
    chunk=st.integers(1, 7),
    level=st.integers(3, 5),
    window=st.integers(1, 4),
    outputs=st.lists(st.lists(st.integers(0, 3), max_size=4), max_size=3),
)
def test_lookahead_in_pieces_equals_one_call(client, monkeypatch, prompt, memory, chunk, level, window, outputs):
    store, params = LookaheadStore(client), LookaheadParams(level, window, 2)
    whole, pieces = new_id("whole"), new_id("pieces")
    chunk_tokens(monkeypatch, ONE_CALL)
    store.start_session(whole, prompt, params, memory)
    chunk_tokens(monkeypatch, chunk)
    store.start_session(pieces, prompt, params, memory)
    try:
        assert contents(client, pieces) == contents(client, whole)
        argmax: list[int] = []
        for new_tokens in [*outputs, []]:
            tree = store.propose(whole, new_tokens, argmax, 16, 8)
            assert store.propose(pieces, new_tokens, argmax, 16, 8) == tree
            argmax = [(5 * i + 1) % 4 for i in range(len(tree[0]) + 1)]
    finally:
        store.end_session(whole)
        store.end_session(pieces)


@pytest.mark.parametrize(
    "settings_", [DraftParams(dynamic_algo=True), DraftParams("la", level=5, window=5, guess_set_size=5)]
)
def test_a_long_real_prompt_in_pieces_equals_one_call(client, monkeypatch, settings_):
    """At the default piece sizes, through the dispatcher, with a conversation's memory. (A
    trie's fields cannot all go in one call, past Lua's limit on unpack(): its "whole" start is
    cut differently.)"""
    text = real_prompt(9500)
    memory, prompt, answer = text[:700], text[700:9000], text[9000:]
    conversation = new_id("conversation")
    store = SessionStore(client)
    store.conversations.append(conversation, pack_tokens("memory", memory))
    whole, pieces = new_id("whole"), new_id("pieces")
    chunk_tokens(monkeypatch, ONE_CALL)
    monkeypatch.setattr(trie, "START_CHUNK_FIELDS", 1500)
    store.start_session(whole, prompt, settings_, conversation=conversation)
    monkeypatch.undo()
    assert len(prompt) > 2 * lookahead_store.START_CHUNK_TOKENS
    assert len(list(trie.start_calls(prompt, store.branch_length, 0, memory))) > 2
    store.start_session(pieces, prompt, settings_, conversation=conversation)
    assert contents(client, pieces) == contents(client, whole)
    argmax: list[int] = []
    drafted = 0
    for at in range(0, len(answer), 25):
        new_tokens = answer[at : at + 25]
        tree = store.propose_scored(whole, new_tokens, argmax, 16, 16)
        assert store.propose_scored(pieces, new_tokens, argmax, 16, 16) == tree
        argmax = [answer[(at + i) % len(answer)] for i in range(len(tree[0]) + 1)]
        drafted += len(tree[0])
    assert drafted > 0
    for session in (whole, pieces):
        store.end_session(session)


def md_calls(prompt, chunk, monkeypatch, **options):
    chunk_tokens(monkeypatch, chunk)
    return list(trie.start_calls(prompt, 3, **options))


def test_a_session_is_not_there_until_its_last_piece(client, monkeypatch):
    store, session = MemoryDecodingStore(client, branch_length=3), new_id()
    keys = trie.memory_decoding_keys("pardec", session)
    (start, *first), second, (command, *last) = md_calls(EXAMPLE, 6, monkeypatch)  # 15 fields
    assert (start, second[0], command) == ("start", "continue", "continue")
    assert store._script(keys=keys, args=[start, 60, *first]) == 1
    with pytest.raises(SessionNotFound):
        store.propose(session, [], 16, 8)
    assert store._script(keys=keys, args=[second[0], 60, *second[1:]]) == 1
    # A piece of another build changes nothing; neither did the refused propose.
    stranger = list(last)
    stranger[0] = "another-build"
    before = contents(client, session)
    assert store._script(keys=keys, args=[command, 60, *stranger]) == 0
    assert contents(client, session) == before
    assert store._script(keys=keys, args=[command, 60, *last]) == 1
    assert store.propose(session, [], 16, 4) == ([4, 1, 3, 1, 2, 4], [-1, 0, -1, 2, 1, 4])  # trie.py's example
    store.end_session(session)


def test_a_build_stops_when_its_session_is_ended_or_started_again(client, monkeypatch):
    store, session = SessionStore(client, branch_length=3), new_id()
    keys = store._keys(session)
    (_, *first), *rest = md_calls(EXAMPLE, 6, monkeypatch)
    meta = ["memory_decoding", len(EXAMPLE), "", ""]
    assert store._script(keys=keys, args=["start", 60, *meta, *first]) == 1
    with pytest.raises(SessionNotFound):
        store.propose(session, [], [], 16, 8)
    store.end_session(session)  # nothing to hand to the memories: no output yet
    assert client.keys(f"*{{{session}}}*") == []
    assert store._script(keys=keys, args=[rest[0][0], 60, *rest[0][1:]]) == 0
    assert client.keys(f"*{{{session}}}*") == []
    # Started again while an older build is under way: the newer start's state stands.
    assert store._script(keys=keys, args=["start", 60, *meta, *first]) == 1
    store.start_session(session, [5, 6, 7, 5, 6, 8, 9, 6], DraftParams())
    for command, *args in rest:
        assert store._script(keys=keys, args=[command, 60, *args]) == 0
    assert store.propose(session, [], [], 16, 3) == ([8, 9, 7, 5, 6, 6], [-1, 0, -1, 2, 1, 3])
    store.end_session(session)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=tokens_strategy,
    memory=tokens_strategy,
    branch_length=st.integers(1, 5),
    outputs=st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=4),
)
def test_the_drafters_trie_is_the_scripts_byte_for_byte(client, prompt, memory, branch_length, outputs):
    """The script counts each step's output tokens into the trie the drafter wrote at start; the
    result is the TrieImage of the whole text (the memory, the prompt, every output token as
    output evidence): the same node ids, entries and state, so the two counting codes agree."""
    store, session = MemoryDecodingStore(client, branch_length=branch_length), new_id()
    store.start_session(session, prompt, memory_tokens=memory)
    image = trie.TrieImage(branch_length)
    image.add(memory, prompt=False, record=False)
    image.end_sequence()
    image.add(prompt, prompt=True, record=True)
    for new_tokens in outputs:
        store.propose(session, new_tokens, 8, 8)
        image.add(new_tokens, prompt=False, record=True)
    found = contents(client, session)
    fields = image.fields()
    assert found.get("trie", {}) == dict(zip(fields[0::2], fields[1::2]))
    assert int(found["state"][b"next_id"]) == image.next_id
    assert found["state"][b"active"] == image.packed_active()
    assert found.get("tokens", b"") == pack_tokens("text", [*prompt, *(t for step in outputs for t in step)])
    store.end_session(session)
