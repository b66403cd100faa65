"""The drafting state on a real Redis Cluster: three masters, each with a replica, on loopback
(tests/redis_cluster_nodes.py), AUTH on. A drafter replica and gateways (one through the
drafter, others drafting in their own process) run on it beside the shared verifier: greedy
output with drafting is plain decoding's, each session's keys share one slot, sessions spread
over the masters, and a master killed mid-stream costs only drafting, which then resumes by
itself on the promoted replica.
"""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest

from pardec.drafter.config import DrafterConfig
from pardec.drafter.redis_cluster import parse_cluster_url
from pardec.drafter.service import DrafterServicer
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import serve as serve_gateway
from pardec.runtime.draft_params import DraftParams
from pardec.runtime.errors import ConfigError
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.conftest import Stack
from tests.redis_cluster_nodes import RedisClusterNodes

# The stack's lossless tests, run here against the cluster (the `stack` and
# `algorithm_gateway` fixtures below replace the shared ones for this module).
from tests.test_end_to_end import (  # noqa: F401
    test_greedy_parallel_decoding_is_token_identical_to_plain,
    test_lookahead_and_dynamic_algo_are_token_identical_to_plain,
)

PASSWORD = "cluster-test-password"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisClusterNodes(tmp_path_factory.mktemp("cluster"), 3, 1, password=PASSWORD) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def drafter_config(cluster) -> DrafterConfig:
    return DrafterConfig(redis_url=cluster.url, redis_password=PASSWORD)


@pytest.fixture(scope="module")
def stack(stack, drafter_config):
    """The shared verifier, with a drafter replica and a gateway on the cluster."""
    drafter_server, drafter_addr = start_server([DrafterServicer(drafter_config).add_to], "127.0.0.1:0")
    gateway_server, gateway_addr = serve_gateway(
        GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=drafter_addr), "127.0.0.1:0"
    )
    channels = [grpc.insecure_channel(address, options=CHANNEL_OPTIONS) for address in (gateway_addr, drafter_addr)]
    yield Stack(
        gateway_pb2_grpc.GatewayStub(channels[0]), stack.verifier, drafter_pb2_grpc.DrafterStub(channels[1]),
        {**stack.addresses, "gateway": gateway_addr, "drafter": drafter_addr},
    )
    for channel in channels:
        channel.close()
    gateway_server.stop(None)
    drafter_server.stop(None)


@pytest.fixture(scope="module", params=["la-4-5-5", "md16-embedded"])
def algorithm_gateway(request, stack, drafter_config):
    """Another algorithm through the cluster's drafter replica, or drafted in the gateway's own
    process on the same cluster settings ("-embedded")."""
    draft = {
        "la-4-5-5": DraftParams("la", level=4, window=5, guess_set_size=5),
        "md16": DraftParams("memory_decoding", decoding_length=16),
    }[request.param.removesuffix("-embedded")]
    if request.param.endswith("-embedded"):
        config = GatewayConfig(stack.addresses["verifier"], embedded_drafter=drafter_config, draft=draft)
    else:
        config = GatewayConfig(stack.addresses["verifier"], stack.addresses["drafter"], draft=draft)
    server, address = serve_gateway(config, "127.0.0.1:0")
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    yield request.param, gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    server.stop(None)


def test_cluster_urls_are_checked_at_configuration():
    url = parse_cluster_url("rediss+cluster://:p%40ss@10.0.0.1:7000,10.0.0.2,[::1]:7002/")
    assert url.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert (url.password, url.tls) == ("p@ss", True)
    for bad, says in [
        ("redis+cluster://h:1/1", "no databases"),
        ("redis+cluster://h:port", "must be a number"),
        ("redis+cluster://h:1?ssl=1", "no query"),
        ("redis+cluster://:a@h:1", "give it once"),
    ]:
        with pytest.raises(ConfigError, match=says):
            DrafterConfig(redis_url=bad, redis_password="a" if "give it once" in says else None)


def _keys_by_node(cluster) -> dict[str, int]:
    """Every pardec key on the masters -> the port of the master holding it."""
    return {key.decode(): node.port for node in cluster.masters() for key in node.client.scan_iter(match="pardec:*")}


def test_each_session_keys_share_one_slot_and_sessions_spread_over_the_masters(stack, cluster):
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    sessions = [f"spread-{uuid.uuid4().hex[:8]}-{index}" for index in range(12)]
    for index, session in enumerate(sessions):
        config = drafter_pb2.DraftConfig(plugin_type="la" if index % 2 else "memory_decoding")
        stack.drafter.StartSession(drafter_pb2.StartSessionRequest(
            session_id=session, prompt_token_ids=prompt, config=config, client_session_id=f"chat-{index % 3}",
            shared_memory="model-a",
        ), timeout=30)
        reply = stack.drafter.Propose(drafter_pb2.ProposeRequest(
            session_id=session, new_token_ids=[1, 2], max_nodes=8, max_depth=4, committed_length=len(prompt) + 2,
        ), timeout=30)
        assert reply.tree.token_ids  # the session's own n-grams draft
    placed = _keys_by_node(cluster)
    masters_used = set()
    for session in sessions:
        mine = {key: port for key, port in placed.items() if key.startswith(f"pardec:{{{session}}}:")}
        assert len(mine) >= 4, mine  # meta, tokens, and the algorithm's own keys
        assert len(set(mine.values())) == 1
        slots = {cluster.nodes[0].client.execute_command("CLUSTER", "KEYSLOT", key) for key in mine}
        assert len(slots) == 1
        masters_used |= set(mine.values())
    assert len(masters_used) >= 2, "twelve sessions all hashed to one master"
    for session in sessions:
        stack.drafter.EndSession(drafter_pb2.EndSessionRequest(session_id=session, new_token_ids=[5]), timeout=30)
    placed = _keys_by_node(cluster)
    assert not any(key.startswith("pardec:{spread-") for key in placed)
    # The memories each live in their own slot, one key set per conversation or shared memory.
    for tag in ("conversation:chat-0", "conversation:chat-1", "conversation:chat-2", "shared:model-a"):
        assert len({port for key, port in placed.items() if key.startswith(f"pardec:{{{tag}}}:")}) == 1, tag


def test_a_node_without_the_scripts_gets_them_again(stack, cluster):
    """A node that lost its script cache (restarted; on Redis 7 also a promoted replica, since
    SCRIPT LOAD no longer replicates) answers NOSCRIPT: the client loads the script on every
    master and runs the call again."""
    for node in cluster.live_nodes():
        node.client.script_flush()
    config = drafter_pb2.DraftConfig(plugin_type="memory_decoding")
    stack.drafter.StartSession(drafter_pb2.StartSessionRequest(
        session_id="flushed", prompt_token_ids=[7, 8, 9, 7, 8], config=config), timeout=30)
    reply = stack.drafter.Propose(drafter_pb2.ProposeRequest(
        session_id="flushed", new_token_ids=[9, 7, 8], max_nodes=4, max_depth=4), timeout=30)
    assert list(reply.tree.token_ids)[:1] == [9]
    stack.drafter.EndSession(drafter_pb2.EndSessionRequest(session_id="flushed"), timeout=30)


def _wait_for_no_sessions(cluster, timeout_s: float = 10.0) -> None:
    """Earlier requests' EndSessions run in the background; wait until their keys are gone."""
    deadline = time.monotonic() + timeout_s
    while any(key.endswith(":meta") for key in _keys_by_node(cluster)) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_master_failing_over_mid_stream_costs_only_drafting(stack, cluster):
    # A long answer with n-grams to draft: the stream outlasts the failover, and drafts again after it.
    counting = "Count from 1 to 1000, separated by commas."
    request = gateway_pb2.GenerateRequest(prompt=counting, max_new_tokens=900)
    plain_request = gateway_pb2.GenerateRequest(
        prompt=counting, max_new_tokens=900, decoding=gateway_pb2.DECODING_MODE_PLAIN
    )
    plain = list(stack.gateway.Generate(plain_request, timeout=300).token_ids)
    _wait_for_no_sessions(cluster)
    promoted_at: list[float] = []
    victim = replica = None

    def watch_promotion():
        while replica.role() != "master":
            time.sleep(0.02)
        promoted_at.append(time.monotonic())

    tokens, steps, watcher = [], [], None
    for chunk in stack.gateway.GenerateStream(request, timeout=300):
        tokens.extend(chunk.token_ids)
        steps.append((time.monotonic(), len(chunk.token_ids)))
        if len(steps) == 4:
            # The master holding this stream's drafting session goes down; its replica takes over.
            [meta] = [key for key in _keys_by_node(cluster) if key.endswith(":meta")]
            victim = cluster.master_of(meta)
            [replica] = cluster.replicas_of[victim.port]
            victim.kill()
            watcher = threading.Thread(target=watch_promotion, daemon=True)
            watcher.start()
        if chunk.HasField("stats"):
            stats = chunk.stats
    assert tokens == plain
    assert stats.accepted_draft_tokens > 0  # drafted before the kill at least
    watcher.join(30)
    assert promoted_at, "the replica was not promoted"
    killed_at = steps[3][0]
    after = [count for at, count in steps if at > promoted_at[0]]
    print(f"promoted {promoted_at[0] - killed_at:.2f} s after the kill; {len(after)} steps of the stream "
          f"after it, {sum(count > 1 for count in after)} of them committing drafted tokens")
    # Refused calls back off (gateway/drafting.py), so the same request drafts again once the
    # replica serves its session.
    assert any(count > 1 for count in after), "no drafted tokens after the failover, within the stream"
    # Drafting resumes by itself, on the promoted master too: the drafter and the gateway keep
    # running, and their cluster client follows the new map.
    _wait_for_no_sessions(cluster)
    again = stack.gateway.Generate(request, timeout=300)
    assert list(again.token_ids) == plain and again.stats.accepted_draft_tokens > 0
    session = next(f"after-{index}" for index in range(10_000)
                   if cluster.master_of(f"pardec:{{after-{index}}}:meta") is replica)
    config = drafter_pb2.DraftConfig(plugin_type="memory_decoding")
    stack.drafter.StartSession(drafter_pb2.StartSessionRequest(
        session_id=session, prompt_token_ids=[7, 8, 9, 7, 8], config=config), timeout=30)
    reply = stack.drafter.Propose(drafter_pb2.ProposeRequest(
        session_id=session, new_token_ids=[9, 7, 8], max_nodes=4, max_depth=4), timeout=30)
    assert list(reply.tree.token_ids)[:1] == [9]
    assert any(replica.client.scan_iter(match=f"pardec:{{{session}}}:*"))
