"""The drafter over real gRPC servers (port 0) and one real redis-server: validation, both
algorithms, and statelessness (replicas alternate, one stops mid-session)."""

from __future__ import annotations

import uuid

import grpc
import pytest

from pardec.drafter.config import DrafterConfig
from pardec.drafter.redis_server import RedisServer
from pardec.drafter.service import DrafterServicer
from pardec.runtime.errors import ConfigError
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import drafter_pb2, drafter_pb2_grpc

PROMPT = [5, 6, 7, 5, 6, 8, 9, 5, 6, 7, 10, 11, 5, 6]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("service-redis")) as server:
        yield server.url


class Replica:
    def __init__(self, redis_url: str):
        servicer = DrafterServicer(DrafterConfig(redis_url=redis_url))
        self.server, self.address = start_server([servicer.add_to], "127.0.0.1:0")
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = drafter_pb2_grpc.DrafterStub(self.channel)

    def stop(self):
        self.channel.close()
        self.server.stop(None).wait()


@pytest.fixture(scope="module")
def replicas(redis_url):
    started = [Replica(redis_url) for _ in range(3)]
    yield started
    for replica in started:
        replica.stop()


def code_of(call, request):
    with pytest.raises(grpc.RpcError) as raised:
        call(request, timeout=10)
    return raised.value.code(), raised.value.details()


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"plugin_type": "medusa"}, "config.plugin_type"),
        ({"decoding_length": 17}, "config.decoding_length"),
        ({"plugin_type": "la", "level": 2}, "config.level"),
        ({"plugin_type": "la", "level": 17}, "config.level"),
        ({"plugin_type": "la", "window": 17}, "config.window"),
        ({"plugin_type": "la", "guess_set_size": 99}, "config.guess_set_size"),
    ],
)
def test_start_session_validates_the_config(replicas, config, field):
    config = drafter_pb2.DraftConfig(**config)
    request = drafter_pb2.StartSessionRequest(session_id="v", prompt_token_ids=[1], config=config)
    code, details = code_of(replicas[0].stub.StartSession, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"client_session_id": "a{b"}, "client_session_id"),
        ({"shared_memory": "x}"}, "shared_memory"),
        ({"session_id": ""}, "session_id"),
    ],
)
def test_start_session_validates_memory_names(replicas, request_fields, field):
    request = drafter_pb2.StartSessionRequest(**{"session_id": "v", "prompt_token_ids": [1], **request_fields})
    code, details = code_of(replicas[0].stub.StartSession, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, details


def test_end_session_bounds_the_tokens_it_records(replicas):
    request = drafter_pb2.EndSessionRequest(session_id="v", new_token_ids=[1] * (32 * 1024 + 1))
    code, details = code_of(replicas[0].stub.EndSession, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("new_token_ids"), details


def test_propose_limits(replicas):
    stub, session = replicas[0].stub, f"limits-{uuid.uuid4().hex}"
    config = drafter_pb2.DraftConfig(plugin_type="la", level=16, window=16, guess_set_size=16)
    stub.StartSession(drafter_pb2.StartSessionRequest(session_id=session, prompt_token_ids=PROMPT, config=config))
    new_tokens, argmax = [5], []
    for _ in range(15):  # warm-up: each step's argmax fills one more of the 15 levels
        request = drafter_pb2.ProposeRequest(
            session_id=session, new_token_ids=new_tokens, max_nodes=480, max_depth=100, last_node_argmax=argmax
        )
        tree = stub.Propose(request).tree
        argmax = [(7 * i) % 50 for i in range(len(tree.token_ids) + 1)]
        new_tokens = argmax[:1]
    assert 15 * 16 - 1 <= len(tree.token_ids) <= 480  # the whole window fits, with the candidates
    code, details = code_of(stub.Propose, drafter_pb2.ProposeRequest(session_id=session, max_nodes=513, max_depth=4))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("max_nodes")
    code, _ = code_of(stub.Propose, drafter_pb2.ProposeRequest(session_id="never-started", max_nodes=4, max_depth=4))
    assert code == grpc.StatusCode.NOT_FOUND


def toy_model(token: int) -> int:
    return (token * 5 + 1) % 13


def drive(stubs_for_step, session, config, steps=12):
    """A generation against a toy greedy model; returns every tree proposed. stubs_for_step(k)
    picks the replica that serves step k."""
    stubs_for_step(0).StartSession(
        drafter_pb2.StartSessionRequest(session_id=session, prompt_token_ids=PROMPT, config=config)
    )
    committed, new_tokens, argmax, trees = list(PROMPT), [toy_model(PROMPT[-1])], [], []
    for step in range(steps):
        committed += new_tokens
        request = drafter_pb2.ProposeRequest(
            session_id=session, new_token_ids=new_tokens, max_nodes=30, max_depth=64, last_node_argmax=argmax
        )
        tree = stubs_for_step(step).Propose(request, timeout=10).tree
        tokens, parents = list(tree.token_ids), list(tree.parents)
        trees.append((tokens, parents))
        argmax = [toy_model(committed[-1])] + [toy_model(token) for token in tokens]
        accepted, row = [], 0
        while True:
            matches = (i for i, (t, p) in enumerate(zip(tokens, parents)) if p == row - 1 and t == argmax[row])
            child = next(matches, None)
            if child is None:
                break
            accepted.append(tokens[child])
            row = child + 1
        new_tokens = [*accepted, argmax[row]]
    stubs_for_step(steps).EndSession(drafter_pb2.EndSessionRequest(session_id=session))
    return trees


@pytest.mark.parametrize(
    "config",
    [
        drafter_pb2.DraftConfig(plugin_type="memory_decoding", decoding_length=16),
        drafter_pb2.DraftConfig(plugin_type="memory_decoding", decoding_length=16, dynamic_algo=True),
        drafter_pb2.DraftConfig(plugin_type="la", level=4, window=3, guess_set_size=3),
    ],
    ids=["memory_decoding", "dynamic_algo", "lookahead"],
)
def test_replicas_are_interchangeable_and_one_can_stop_mid_session(redis_url, config):
    single = Replica(redis_url)
    try:
        expected = drive(lambda step: single.stub, f"single-{uuid.uuid4().hex}", config)
    finally:
        single.stop()
    assert any(tokens for tokens, _ in expected)
    pool = [Replica(redis_url) for _ in range(3)]
    try:

        def alternate(step):
            if step == 5:
                pool[0].stop()  # mid-session: the rest of the session goes to the others
            alive = pool[1:] if step >= 5 else pool
            return alive[step % len(alive)].stub

        assert drive(alternate, f"multi-{uuid.uuid4().hex}", config) == expected
    finally:
        for replica in pool[1:]:
            replica.stop()


@pytest.mark.parametrize("field, value, rule", [
    ("session_ttl_s", 0, r"\[1, 2592000\]"), ("session_ttl_s", 3_000_000, r"\[1, 2592000\]"),
    ("conversation_ttl_s", 2_592_001, r"\[1, 2592000\]"), ("shared_memory_contexts", 2**31, r"\[1, 2147483647\]"),
    ("branch_length", 65, r"\[1, 64\]"),
])
def test_the_config_bounds_each_field_both_ways(field, value, rule):
    """Caught on construction, naming the field (the drafter's command line exits 2 with it),
    not when the store is built after it."""
    with pytest.raises(ConfigError, match=f"{field}: must be in {rule}, got {value}"):
        DrafterConfig(redis_url="redis://127.0.0.1:6379/0", **{field: value})
