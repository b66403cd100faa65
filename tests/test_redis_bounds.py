"""Redis is bounded, and what its bounds do costs only drafting, through real servers: every
Redis pardec starts or deploys has maxmemory with an eviction policy that can evict drafting
state (every key pardec writes has a TTL); a Redis out of memory makes the drafter answer
UNAVAILABLE and the gateway decode plain, with the same output; a paused Redis fails a drafter
call UNAVAILABLE within its socket timeout instead of holding it."""

from __future__ import annotations

import os
import re
import shlex
import signal
from pathlib import Path

import grpc
import pytest
import redis
import yaml

from pardec.drafter.config import DrafterConfig
from pardec.drafter.core import _store_errors
from pardec.drafter.redis_server import DEFAULT_MAXMEMORY, MAXMEMORY_POLICY, RedisServer
from pardec.drafter.service import DrafterServicer
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import start_gateway
from pardec.runtime.errors import Unavailable
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.secure import PROMPT

ROOT = Path(__file__).resolve().parents[1]


def redis_args(args: list[str]) -> dict[str, str]:
    """Flag -> value of a command line, given as a list or as a `sh -c` script's words."""
    args = [word for arg in args for word in (shlex.split(arg) if " " in arg else [arg])]
    return {flag: args[i + 1] for i, flag in enumerate(args) if flag.startswith("--") and i + 1 < len(args)}


def test_every_deployed_redis_is_bounded_with_an_evicting_policy():
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())["services"]["redis"]["command"]
    documents = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "pardec.yaml").read_text()))
    redis_pod = next(d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == "pardec-redis")
    container = redis_pod["spec"]["template"]["spec"]["containers"][0]
    for args in (compose, container["args"]):
        flags = redis_args(args)
        assert re.fullmatch(r"\d+[kmg]b", flags["--maxmemory"]) and flags["--maxmemory-policy"] == MAXMEMORY_POLICY
    assert "limits" in container["resources"]  # the pod's limit sits above maxmemory
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert "--maxmemory" in docs and MAXMEMORY_POLICY in docs


def test_redis_server_is_bounded_and_every_key_pardec_writes_can_expire(tmp_path, stack):
    with RedisServer(tmp_path / "redis") as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == MAXMEMORY_POLICY
        assert int(client.config_get("maxmemory")["maxmemory"]) == 512 * 1024 * 1024 == _bytes(DEFAULT_MAXMEMORY)
        drafter, address = start_server([DrafterServicer(DrafterConfig(redis_url=server.url)).add_to], "127.0.0.1:0")
        gateway = start_gateway(GatewayConfig(
            verifier_target=stack.addresses["verifier"], drafter_target=address, shared_memory=True,
        ), "127.0.0.1:0")
        try:
            with grpc.insecure_channel(gateway.address, options=CHANNEL_OPTIONS) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                for session in ("", "conversation-1"):
                    stub.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=24, session_id=session),
                                  timeout=300)
            # A session still open (its drafter state written, not yet ended) expires too.
            with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                drafter_pb2_grpc.DrafterStub(channel).StartSession(
                    drafter_pb2.StartSessionRequest(session_id="left-open", prompt_token_ids=[1, 2, 3, 1, 2]), timeout=30
                )
        finally:
            gateway.stop()
            drafter.stop(None)
        keys = list(client.scan_iter())
        assert any(b"shared:" in key for key in keys) and any(b"conversation:" in key for key in keys)
        assert any(b"left-open" in key for key in keys)
        without_ttl = [key for key in keys if client.ttl(key) < 0]
        assert without_ttl == []  # so volatile-lru may evict any of them


def _bytes(size: str) -> int:
    number, unit = int(size[:-2]), size[-2:].lower()
    return number * {"kb": 1024, "mb": 1024**2, "gb": 1024**3}[unit]


def test_redis_out_of_memory_costs_only_drafting(tmp_path, stack):
    # Below what an empty Redis already uses: every write is refused OOM, nothing can be evicted.
    with RedisServer(tmp_path / "redis", maxmemory="100kb") as server:
        drafter, address = start_server([DrafterServicer(DrafterConfig(redis_url=server.url)).add_to], "127.0.0.1:0")
        gateway = start_gateway(GatewayConfig(
            verifier_target=stack.addresses["verifier"], drafter_target=address,
        ), "127.0.0.1:0")
        try:
            # What Redis refuses for memory reaches the drafter's caller as UNAVAILABLE (a plain
            # write here; a script whose first write went through runs to its end, and what it
            # wrote is evicted or missing at the next call: NOT_FOUND, equally a plain step).
            with pytest.raises(Unavailable, match="maxmemory"), _store_errors():
                redis.Redis.from_url(server.url).set("pardec:{oom}:probe", "x", ex=60)
            with grpc.insecure_channel(gateway.address, options=CHANNEL_OPTIONS) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                plain = stub.Generate(gateway_pb2.GenerateRequest(
                    prompt=PROMPT, max_new_tokens=32, decoding=gateway_pb2.DECODING_MODE_PLAIN), timeout=300)
                for session in ("", "conversation-oom"):
                    reply = stub.Generate(
                        gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=32, session_id=session), timeout=300
                    )
                    assert list(reply.token_ids) == list(plain.token_ids) and reply.text == plain.text
        finally:
            gateway.stop()
            drafter.stop(None)


def test_a_paused_redis_fails_drafter_calls_unavailable_instead_of_hanging(tmp_path):
    with RedisServer(tmp_path / "redis") as server:
        config = DrafterConfig(redis_url=server.url, redis_timeout_s=1.0)
        drafter, address = start_server([DrafterServicer(config).add_to], "127.0.0.1:0")
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
                stub = drafter_pb2_grpc.DrafterStub(channel)
                with pytest.raises(grpc.RpcError) as raised:
                    # A deadline far beyond the socket timeout: what answers is the drafter.
                    stub.StartSession(drafter_pb2.StartSessionRequest(session_id="paused", prompt_token_ids=[1, 2, 3]),
                                      timeout=120)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and "redis" in raised.value.details()
        finally:
            os.kill(server.pid, signal.SIGCONT)
            drafter.stop(None)
