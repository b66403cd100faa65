"""Drafting in the gateway's process (gateway/embedded_drafter.py) on a real redis-server: the
same trees and errors as a drafter replica, sessions shared with replicas, and a Redis that is
gone or does not answer costing a step its tree, never a hang."""

from __future__ import annotations

import doctest
import socket
import time
import uuid

import grpc
import pytest

import pardec.drafter.core
from pardec.drafter.config import DrafterConfig
from pardec.drafter.redis_server import RedisServer
from pardec.drafter.service import DrafterServicer
from pardec.runtime.draft_params import DraftParams
from pardec.gateway.embedded_drafter import EmbeddedDrafter
from pardec.runtime.errors import InvalidArgument, NotFound, Unavailable
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import drafter_pb2, drafter_pb2_grpc

PROMPT = [5, 6, 7, 5, 6, 8, 9, 5, 6, 7, 10, 11, 5, 6]


def test_draft_settings_doctests():
    assert doctest.testmod(pardec.drafter.core).failed == 0


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("embedded-redis")) as server:
        yield server.url


@pytest.fixture(scope="module")
def embedded(redis_url):
    drafter_ = EmbeddedDrafter(DrafterConfig(redis_url=redis_url), timeout_s=10, propose_timeout_s=0.5)
    yield drafter_
    drafter_.close()


@pytest.fixture(scope="module")
def replica(redis_url):
    server, address = start_server([DrafterServicer(DrafterConfig(redis_url=redis_url)).add_to], "127.0.0.1:0")
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    yield drafter_pb2_grpc.DrafterStub(channel)
    channel.close()
    server.stop(None).wait()


def started(embedded, prompt=PROMPT, params=DraftParams()) -> str:
    session = uuid.uuid4().hex
    assert embedded.wait_started(embedded.start_session(session, prompt, params), timeout_s=10)
    return session


def test_it_drafts_the_trees_a_replica_drafts(embedded, replica):
    # The same prompt and steps both ways: the same trees and estimates.
    ours, theirs = started(embedded), uuid.uuid4().hex
    replica.StartSession(drafter_pb2.StartSessionRequest(session_id=theirs, prompt_token_ids=PROMPT), timeout=10)
    for new_tokens in ([7], [10, 11], [5]):
        tree = embedded.propose(ours, new_tokens, max_nodes=8, max_depth=4)
        reply = replica.Propose(
            drafter_pb2.ProposeRequest(session_id=theirs, new_token_ids=new_tokens, max_nodes=8, max_depth=4), timeout=10
        )
        assert tree[:2] == (list(reply.tree.token_ids), list(reply.tree.parents))
        assert tree[2] == pytest.approx(list(reply.accept_probabilities), rel=1e-6)  # float in the proto
    assert tree[0], "the prompt repeats 5, 6: something to draft"


def test_a_session_it_started_is_served_by_a_replica_and_back(embedded, replica):
    session = started(embedded)
    reply = replica.Propose(drafter_pb2.ProposeRequest(session_id=session, new_token_ids=[7], max_nodes=4, max_depth=4), timeout=10)
    assert list(reply.tree.token_ids)
    assert embedded.propose(session, [5], max_nodes=4, max_depth=4)[0]
    embedded.end_session(session, [6])
    with pytest.raises(NotFound, match="session_id"):
        embedded.propose(session, [], max_nodes=4, max_depth=4)


def test_lookahead_sessions_and_probes_in_the_background(embedded):
    session = started(embedded, PROMPT * 3, DraftParams("la", level=4, window=5, guess_set_size=5))
    future = embedded.propose_future(session, [7], max_nodes=16, max_depth=3)
    tokens, parents, probabilities = embedded.proposal(future)
    assert len(tokens) == len(parents) == len(probabilities) > 0


def test_more_new_tokens_than_one_propose_takes_are_recorded_first(embedded):
    session = started(embedded)
    many = [40 + i % 7 for i in range(pardec.drafter.core.MAX_NEW_TOKENS + 90)]
    tokens, _, _ = embedded.propose(session, many, max_nodes=8, max_depth=4)
    # The session saw all of them: 40..46 repeats, so it drafts the cycle on from the last token.
    assert tokens and tokens[0] == 40 + (many[-1] - 40 + 1) % 7


def test_bad_calls_fail_with_the_replicas_statuses_and_messages(embedded):
    with pytest.raises(InvalidArgument, match="session_id: must not be empty"):
        embedded.propose("", [1], max_nodes=4, max_depth=4)
    with pytest.raises(InvalidArgument, match="max_nodes: 513 exceeds 512"):
        embedded.propose(started(embedded), [1], max_nodes=513, max_depth=4)
    with pytest.raises(NotFound, match="never started or expired"):
        embedded.propose(uuid.uuid4().hex, [1], max_nodes=4, max_depth=4)
    bad_name = embedded.start_session(uuid.uuid4().hex, PROMPT, DraftParams(), client_session_id="{x}")
    with pytest.raises(InvalidArgument, match="client_session_id"):
        embedded.wait_started(bad_name, timeout_s=10)


def test_a_redis_that_is_gone_is_unavailable(tmp_path):
    gone = EmbeddedDrafter(DrafterConfig(redis_url=f"unix://{tmp_path}/none.sock"), timeout_s=2, propose_timeout_s=0.5)
    try:
        with pytest.raises(Unavailable, match="redis"):
            gone.propose("s", [1], max_nodes=4, max_depth=4)
        with pytest.raises(Unavailable, match="redis"):
            gone.wait_started(gone.start_session("s", PROMPT, DraftParams()), timeout_s=10)
    finally:
        gone.close()


def test_a_redis_that_does_not_answer_costs_one_propose_deadline():
    # A listening socket that never replies: the call fails at the deadline instead of hanging.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        mute = EmbeddedDrafter(DrafterConfig(redis_url=f"redis://127.0.0.1:{port}/0"), timeout_s=2, propose_timeout_s=0.3)
        try:
            start = time.monotonic()
            with pytest.raises(Unavailable, match="redis"):
                mute.propose("s", [1], max_nodes=4, max_depth=4)
            assert time.monotonic() - start < 1.5
        finally:
            mute.close()
