"""Propose is idempotent when the caller says the committed length: on the real Redis scripts, a
repeated call returns the same tree and leaves the session exactly as after one call."""

from __future__ import annotations

import uuid

import grpc
import pytest
import redis

from pardec.drafter.config import DrafterConfig
from pardec.drafter.redis_server import RedisServer
from pardec.drafter.service import DrafterServicer
from pardec.drafter.encoding import SessionNotFound
from pardec.drafter.sessions import SessionStore
from pardec.runtime.draft_params import DraftParams
from pardec.runtime.errors import FailedPrecondition
from pardec.runtime.serving import start_server
from pardec.v1 import drafter_pb2, drafter_pb2_grpc

PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 5, 6, 1, 2, 3]
# (new tokens, argmax of the previous tree) per step; the committed length follows from them.
STEPS = [([1], []), ([2, 3], [2, 3, 1, 9]), ([1, 2, 4], [5, 5, 1, 2, 4, 1]), ([1], [1, 2])]
SETTINGS = [
    pytest.param(DraftParams(), id="memory_decoding"),
    pytest.param(DraftParams(decoding_length=6, dynamic_algo=True), id="dynamic_algo"),
    pytest.param(DraftParams("la", level=3, window=3, guess_set_size=2), id="lookahead"),
]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("idempotent-redis")) as server:
        yield server.url


@pytest.fixture(scope="module")
def client(redis_url):
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


def state(client, session: str) -> dict[str, object]:
    """Every key of the session by its name, with its value (hashes whole) and nothing else."""
    found = {}
    for key in client.keys(f"*{{{session}}}*"):
        name = key.decode().rsplit(":", 1)[1]
        kind = client.type(key).decode()
        found[name] = client.hgetall(key) if kind == "hash" else client.get(key)
    return found


@pytest.mark.parametrize("params", SETTINGS)
def test_a_repeated_propose_returns_the_same_tree_and_learns_nothing_again(client, params):
    store = SessionStore(client, branch_length=4)
    once, twice = f"once-{uuid.uuid4().hex}", f"twice-{uuid.uuid4().hex}"
    for session in (once, twice):
        store.start_session(session, PROMPT, params)
    length = len(PROMPT)
    for new_tokens, argmax in STEPS:
        length += len(new_tokens)
        expected = store.propose_scored(once, new_tokens, argmax, 12, 8, committed_length=length)
        first = store.propose_scored(twice, new_tokens, argmax, 12, 8, committed_length=length)
        repeat = store.propose_scored(twice, new_tokens, argmax, 12, 8, committed_length=length)
        assert first == expected and repeat == expected
        assert state(client, twice) == state(client, once)
    assert len(client.get(f"pardec:{{{twice}}}:tokens")) == 4 * length


def test_without_the_key_a_repeat_records_its_tokens_again(client):
    store, session = SessionStore(client), f"s-{uuid.uuid4().hex}"
    store.start_session(session, PROMPT, DraftParams())
    store.propose(session, [1, 2], [], 8, 8)
    store.propose(session, [1, 2], [], 8, 8)
    assert len(client.get(f"pardec:{{{session}}}:tokens")) == 4 * (len(PROMPT) + 4)


def test_a_repeat_asking_fewer_nodes_gets_a_prefix_of_the_tree(client):
    store, session = SessionStore(client), f"s-{uuid.uuid4().hex}"
    store.start_session(session, PROMPT, DraftParams())
    tokens, parents, scores = store.propose_scored(session, [1, 2], [], 8, 8, committed_length=len(PROMPT) + 2)
    assert len(tokens) > 2
    again = store.propose_scored(session, [1, 2], [], 2, 8, committed_length=len(PROMPT) + 2)
    assert again == (tokens[:2], parents[:2], scores[:2])


def test_a_stale_or_miscounted_call_is_refused_and_changes_nothing(client):
    store, session = SessionStore(client), f"s-{uuid.uuid4().hex}"
    store.start_session(session, PROMPT, DraftParams())
    store.propose(session, [1], [], 8, 8)  # no key: the first call may come before the caller counts
    store.propose_scored(session, [2, 3], [], 8, 8, committed_length=len(PROMPT) + 3)
    store.propose_scored(session, [1], [], 8, 8, committed_length=len(PROMPT) + 4)
    before = state(client, session)
    for new_tokens, length in (([2, 3], len(PROMPT) + 3), ([5], len(PROMPT) + 7), ([], len(PROMPT) + 3)):
        with pytest.raises(FailedPrecondition, match=f"committed_length: {length} is neither"):
            store.propose_scored(session, new_tokens, [], 8, 8, committed_length=length)
        assert state(client, session) == before


def test_the_drafter_service_honours_the_key(redis_url, client):
    server, address = start_server([DrafterServicer(DrafterConfig(redis_url=redis_url)).add_to], "127.0.0.1:0")
    session = f"s-{uuid.uuid4().hex}"
    try:
        with grpc.insecure_channel(address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            stub.StartSession(drafter_pb2.StartSessionRequest(session_id=session, prompt_token_ids=PROMPT))
            request = drafter_pb2.ProposeRequest(
                session_id=session, new_token_ids=[1, 2], max_nodes=8, max_depth=8,
                committed_length=len(PROMPT) + 2,
            )
            first = stub.Propose(request)
            after_one = state(client, session)
            assert stub.Propose(request).tree == first.tree
            assert state(client, session) == after_one
            request.committed_length = len(PROMPT) + 9
            with pytest.raises(grpc.RpcError) as error:
                stub.Propose(request)
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "committed_length" in error.value.details()
    finally:
        server.stop(None)


def test_a_resent_head_the_session_already_holds_is_skipped_and_a_wrong_one_refused(client):
    # A call got through but its reply was lost: its caller sends its tokens again with the next
    # ones, under the length they reach together. The session ends as if each was sent once.
    once, resent = f"once-{uuid.uuid4().hex}", f"resent-{uuid.uuid4().hex}"
    store = SessionStore(client)
    for session in (once, resent):
        store.start_session(session, PROMPT, DraftParams())
        store.propose_scored(session, [1, 2], [], 8, 8, committed_length=len(PROMPT) + 2)
    store.propose_scored(once, [4, 7], [], 8, 8, committed_length=len(PROMPT) + 4)
    store.propose_scored(resent, [1, 2, 4, 7], [], 8, 8, committed_length=len(PROMPT) + 4)
    assert state(client, resent) == state(client, once)
    assert len(client.get(f"pardec:{{{resent}}}:tokens")) == 4 * (len(PROMPT) + 4)
    before = state(client, resent)
    with pytest.raises(FailedPrecondition, match="committed_length"):  # [9, 9] is not what it ends with
        store.propose_scored(resent, [9, 9, 4], [], 8, 8, committed_length=len(PROMPT) + 5)
    assert state(client, resent) == before


@pytest.mark.parametrize("params", SETTINGS)
def test_a_repeat_is_cut_to_its_own_depth_and_must_carry_the_same_tokens(client, params):
    store, session = SessionStore(client, branch_length=4), f"s-{uuid.uuid4().hex}"
    store.start_session(session, PROMPT, params)
    length = len(PROMPT) + 1
    tokens, parents, scores = store.propose_scored(session, [1], [], 12, 8, committed_length=length)
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    assert max(depths) > 1, (tokens, parents)
    shallow = store.propose_scored(session, [1], [], 12, 1, committed_length=length)
    head = depths.index(2)  # the longest head of the tree within depth 1
    assert shallow == (tokens[:head], parents[:head], scores[:head])
    before = state(client, session)
    with pytest.raises(FailedPrecondition, match="repeats the last call"):
        store.propose_scored(session, [7], [], 12, 8, committed_length=length)
    assert state(client, session) == before


@pytest.mark.parametrize("params", SETTINGS)
@pytest.mark.parametrize("evicted", ["trie", "tokens", "state"])
def test_a_session_missing_a_key_redis_evicted_is_gone_as_a_whole(client, params, evicted):
    """maxmemory's volatile-lru evicts a session's keys one by one: what is left is no session
    (SessionNotFound, every key deleted), not an error that a retry meets again."""
    store, session = SessionStore(client, branch_length=4), f"s-{uuid.uuid4().hex}"
    store.start_session(session, PROMPT, params)
    store.propose_scored(session, [1], [], 12, 8, committed_length=len(PROMPT) + 1)
    keys = {key.decode().rsplit(":", 1)[1]: key for key in client.keys(f"*{{{session}}}*")}
    lookahead_names = {"trie": "la_pool", "state": "la_state"}  # its own keys where they differ
    name = lookahead_names.get(evicted, evicted) if params.plugin_type == "la" else evicted
    client.delete(keys[name])
    if name == "la_pool":  # lookahead's n-gram pool is only what it learned: without it, it goes on
        store.propose_scored(session, [2], [], 12, 8, committed_length=len(PROMPT) + 2)
        return
    with pytest.raises(SessionNotFound):
        store.propose_scored(session, [2], [], 12, 8, committed_length=len(PROMPT) + 2)
    assert client.keys(f"*{{{session}}}*") == []
