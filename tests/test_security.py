"""Security on every hop, over real servers on loopback: TLS and mutual TLS (a throwaway CA made
with the openssl CLI at test time: tests/secure.py), bearer tokens at the gateway and
tenant-scoped session ids. One secure full stack (client -> gateway over TLS + token, gateway ->
verifier and drafters over mutual TLS) serves the same tokens as the insecure one. Redis AUTH and
TLS, and `pardec up` over TLS: test_security_redis_and_up.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pardec.drafter.config import DrafterConfig
from pardec.drafter.memory import ConversationMemory
from pardec.drafter.service import DrafterServicer
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import start_gateway
from pardec.runtime import health_probe
from pardec.runtime.errors import ConfigError
from pardec.runtime.security import (
    ANONYMOUS, BearerTokens, ClientTLS, ServerTLS, client_tls, memory_scope, open_channel, read_tokens,
    scoped_session_id,
)
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from pardec.verifier.service import VerifierServicer
from tests.secure import PROMPT, TOKEN_A, TOKEN_B, TOKEN_C, start_and_end


# ---------------------------------------------------------------- pure logic

def test_bearer_tokens_name_tenants_and_never_show_themselves(tmp_path):
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps({TOKEN_A: "tenant-a"}))
    tokens = BearerTokens.from_mapping(read_tokens([f"tenant-b={TOKEN_B}"], str(tokens_file)))
    assert tokens.tenant(TOKEN_A) == "tenant-a" and tokens.tenant(TOKEN_B) == "tenant-b"
    assert tokens.tenant(TOKEN_A + "x") is None and tokens.tenant("") is None
    assert TOKEN_A not in repr(tokens) and TOKEN_A not in repr(GatewayConfig("v:1", "d:1", tokens=tokens))
    assert not BearerTokens() and tokens
    with pytest.raises(ConfigError, match="at least 16 characters"):
        BearerTokens.from_mapping({"short": "tenant-a"})
    with pytest.raises(ConfigError, match="tenant 'a/b'"):
        BearerTokens.from_mapping({TOKEN_A: "a/b"})
    with pytest.raises(ConfigError, match="TENANT=TOKEN"):
        read_tokens(["no-equals-sign"])


def test_session_ids_are_scoped_to_the_tenant():
    assert scoped_session_id("tenant-a", "chat-1") == "tenant-a/chat-1"
    assert scoped_session_id("tenant-a", "chat-1") != scoped_session_id("tenant-b", "chat-1")
    # Tenant names hold no "/": ("a", "b/c") and ("a/b", "c") cannot both exist. Anonymous
    # callers have a namespace no tenant can be named.
    assert scoped_session_id("", "chat-1") == f"{ANONYMOUS}/chat-1" and scoped_session_id("tenant-a", "") == ""
    assert memory_scope("tenant-a", "m", "chat-1") == "tenant-a/m/chat-1" and memory_scope("", "m", "") == ""


def test_tls_settings_are_checked_at_startup(pki, tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        ServerTLS(str(tmp_path / "missing.pem"), pki.server_key)
    with pytest.raises(ConfigError, match="go together"):
        ClientTLS(pki.ca, pki.client_a_cert, None)
    assert client_tls(None, None, None) is None
    with pytest.raises(ConfigError, match="rediss://"):
        DrafterConfig(redis_url="redis://127.0.0.1:6379/0", redis_tls=ClientTLS(pki.ca))
    with pytest.raises(ConfigError, match="once"):
        DrafterConfig(redis_url="redis://:secret@127.0.0.1:6379/0", redis_password="secret")
    assert "hunter2" not in repr(DrafterConfig(redis_url="redis://127.0.0.1:6379/0", redis_password="hunter2"))


# ---------------------------------------------------------------- TLS and mTLS, drafter alone

@pytest.fixture(scope="module")
def secure_drafters(pki, redis_server):
    """Two drafters over the shared Redis: one TLS only, one mutual TLS."""
    config = DrafterConfig(redis_url=redis_server.url)
    tls_only, tls_address = start_server(
        [DrafterServicer(config).add_to], "127.0.0.1:0", tls=ServerTLS(pki.server_cert, pki.server_key)
    )
    mutual, mutual_address = start_server(
        [DrafterServicer(config).add_to], "127.0.0.1:0", tls=ServerTLS(pki.server_cert, pki.server_key, pki.ca)
    )
    yield {"tls": tls_address, "mtls": mutual_address}
    tls_only.stop(None)
    mutual.stop(None)


def test_tls_only_server_needs_its_ca_and_refuses_plaintext(pki, secure_drafters):
    address = secure_drafters["tls"]
    assert start_and_end(address, ClientTLS(pki.ca)) == grpc.StatusCode.OK
    assert start_and_end(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext client
    assert start_and_end(address, ClientTLS(pki.other_ca)) == grpc.StatusCode.UNAVAILABLE  # wrong CA
    assert health_probe.main([address, "--tls-ca", pki.ca]) == 0
    assert health_probe.main([address]) == 1


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(pki, secure_drafters):
    address = secure_drafters["mtls"]
    assert start_and_end(address, ClientTLS(pki.ca, pki.client_a_cert, pki.client_a_key)) == grpc.StatusCode.OK
    assert start_and_end(address, ClientTLS(pki.ca)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    assert start_and_end(address, ClientTLS(pki.ca, pki.rogue_cert, pki.rogue_key)) == grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------- the secure full stack

@dataclass
class SecureStack:
    gateway: str  # TLS + bearer tokens, drafting memory shared per tenant
    cert_gateway: str  # mutual TLS, tenant = client certificate CN
    gateway_metrics: object  # the token gateway's Prometheus registry
    model_name: str  # conversations are scoped by it too


@pytest.fixture(scope="module")
def secure_stack(pki, redis_server, engine):
    internal = ServerTLS(pki.server_cert, pki.server_key, pki.ca)
    backend = ClientTLS(pki.ca, pki.server_cert, pki.server_key)
    verifier, verifier_address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0", tls=internal)
    drafter, drafter_address = start_server(
        [DrafterServicer(DrafterConfig(redis_url=redis_server.url)).add_to], "127.0.0.1:0", tls=internal
    )
    tokens = BearerTokens.from_mapping({TOKEN_A: "tenant-a", TOKEN_B: "tenant-b", TOKEN_C: "tenant-c"})
    common = {"verifier_target": verifier_address, "drafter_target": drafter_address, "backend_tls": backend}
    gateway = start_gateway(
        GatewayConfig(**common, tls=ServerTLS(pki.server_cert, pki.server_key), tokens=tokens, shared_memory=True),
        "127.0.0.1:0",
    )
    cert_gateway = start_gateway(GatewayConfig(**common, tls=internal), "127.0.0.1:0")
    yield SecureStack(
        gateway.address, cert_gateway.address, gateway.generator.metrics.registry, gateway.generator.model.model_name
    )
    for running in (gateway, cert_gateway):
        running.stop()
    drafter.stop(None)
    verifier.stop(None)


def generate(address: str, tls: ClientTLS, token: str | None = None, **fields) -> gateway_pb2.GenerateResponse:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    fields = {"prompt": PROMPT, "max_new_tokens": 48, **fields}
    request = gateway_pb2.GenerateRequest(**fields)
    with open_channel(address, tls, CHANNEL_OPTIONS) as channel:
        return gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=300, metadata=metadata)


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code(), raised.value.details()


def test_secure_stack_serves_the_same_tokens_as_the_insecure_one(pki, stack, secure_stack):
    expected = stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=48), timeout=300)
    reply = generate(secure_stack.gateway, ClientTLS(pki.ca), TOKEN_A)
    assert list(reply.token_ids) == list(expected.token_ids) and reply.text == expected.text
    assert reply.stats.draft_tokens > 0  # the drafter answered over mutual TLS
    with open_channel(secure_stack.gateway, ClientTLS(pki.ca), CHANNEL_OPTIONS) as channel:
        chunks = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(
            gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=48), timeout=300,
            metadata=(("authorization", f"Bearer {TOKEN_B}"),),
        )
        streamed = [t for chunk in chunks for t in chunk.token_ids]
    assert streamed == list(expected.token_ids)


def test_gateway_requires_a_valid_bearer_token_but_not_for_probes(pki, secure_stack):
    tls = ClientTLS(pki.ca)

    def refused(method: str) -> float:
        labels = {"method": method, "status": "UNAUTHENTICATED"}
        return secure_stack.gateway_metrics.get_sample_value("pardec_requests_total", labels) or 0.0

    refused_before = refused("Generate"), refused("GenerateStream")
    code, details = refusal(lambda: generate(secure_stack.gateway, tls))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token is required" in details
    code, details = refusal(lambda: generate(secure_stack.gateway, tls, TOKEN_A + "-wrong"))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "not valid" in details and TOKEN_A not in details
    with open_channel(secure_stack.gateway, tls, CHANNEL_OPTIONS) as channel:
        stream = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(gateway_pb2.GenerateRequest(prompt=PROMPT))
        code, _ = refusal(lambda: list(stream))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert "pardec.v1.Gateway" in ProtoReflectionDescriptorDatabase(channel).get_services()
    # Refused calls never reach the servicer, and are counted all the same (probes are not).
    assert (refused("Generate"), refused("GenerateStream")) == (refused_before[0] + 2, refused_before[1] + 1)
    assert generate(secure_stack.gateway, tls, TOKEN_A, max_new_tokens=4).token_ids
    code, _ = refusal(lambda: generate(secure_stack.gateway, ClientTLS(pki.other_ca), TOKEN_A, max_new_tokens=4))
    assert code == grpc.StatusCode.UNAVAILABLE  # a client that trusts another CA never sends its token


def test_get_served_model_needs_what_generate_needs(pki, secure_stack):
    tls = ClientTLS(pki.ca)

    def served(address: str, client: ClientTLS, token: str | None = None) -> gateway_pb2.ServedModel:
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        with open_channel(address, client, CHANNEL_OPTIONS) as channel:
            return gateway_pb2_grpc.GatewayStub(channel).GetServedModel(
                gateway_pb2.GetServedModelRequest(), timeout=60, metadata=metadata
            )

    labels = {"method": "GetServedModel", "status": "UNAUTHENTICATED"}
    refused_before = secure_stack.gateway_metrics.get_sample_value("pardec_requests_total", labels) or 0.0
    code, details = refusal(lambda: served(secure_stack.gateway, tls))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token is required" in details
    code, details = refusal(lambda: served(secure_stack.gateway, tls, TOKEN_A + "-wrong"))
    assert code == grpc.StatusCode.UNAUTHENTICATED and TOKEN_A not in details
    assert secure_stack.gateway_metrics.get_sample_value("pardec_requests_total", labels) == refused_before + 2
    info = served(secure_stack.gateway, tls, TOKEN_A)
    assert info.model == secure_stack.model_name and info.decoding.shared_memory
    # Mutual TLS without tokens: the client certificate is the credential.
    by_certificate = served(secure_stack.cert_gateway, ClientTLS(pki.ca, pki.client_a_cert, pki.client_a_key))
    assert by_certificate.model == secure_stack.model_name and not by_certificate.decoding.shared_memory
    rogue = ClientTLS(pki.ca, pki.rogue_cert, pki.rogue_key)
    assert refusal(lambda: served(secure_stack.cert_gateway, rogue))[0] == grpc.StatusCode.UNAVAILABLE
    # `pardec info` takes the same TLS and token flags as `pardec generate`.
    command = [sys.executable, "-m", "pardec.gateway.cli", "info", "--addr", secure_stack.gateway, "--json",
               "--tls-ca", pki.ca]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PARDEC_TOKEN": TOKEN_A})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"] == secure_stack.model_name
    env = {k: v for k, v in os.environ.items() if k != "PARDEC_TOKEN"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr


class _ScopedByModel:
    """Reads "tenant/id" as the gateway stores it: "tenant/<model>/id" (anonymous: no tenant)."""

    def __init__(self, memory: ConversationMemory, model_name: str):
        self._memory, self._model = memory, model_name

    def read(self, conversation: str) -> list[int]:
        tenant, _, session = conversation.rpartition("/")
        return self._memory.read(memory_scope(tenant, self._model, session))


def remembered(memory: ConversationMemory, conversation: str, reply: gateway_pb2.GenerateResponse) -> bool:
    """Whether the conversation's drafting memory holds exactly this reply (EndSession hands the
    steps no Propose carried over when the request ends)."""
    deadline = time.monotonic() + 10
    while not (tokens := memory.read(conversation)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return tokens == list(reply.token_ids)


def test_tenants_using_the_same_session_id_never_share_drafting_memory(pki, redis_server, secure_stack):
    memory = ConversationMemory(redis.Redis.from_url(redis_server.url), ttl_s=60, key_prefix="pardec")
    memory = _ScopedByModel(memory, secure_stack.model_name)
    tls = ClientTLS(pki.ca)
    first = generate(secure_stack.gateway, tls, TOKEN_A, session_id="shared-name", max_new_tokens=24)
    assert remembered(memory, "tenant-a/shared-name", first)
    a_memory = memory.read("tenant-a/shared-name")
    assert memory.read("tenant-b/shared-name") == [] and memory.read("shared-name") == []
    # Tenant B "continues" the same session id: its drafter gets B's own (empty) memory, not A's
    # answer, and A's memory stays A's alone.
    other = generate(secure_stack.gateway, tls, TOKEN_B, session_id="shared-name", max_new_tokens=8,
                     prompt="Name three colors.")
    assert remembered(memory, "tenant-b/shared-name", other)
    assert memory.read("tenant-a/shared-name") == a_memory
    # Tenant A continuing its own session does get its memory back, and adds to it.
    generate(secure_stack.gateway, tls, TOKEN_A, session_id="shared-name", max_new_tokens=8)
    deadline = time.monotonic() + 10
    while len(memory.read("tenant-a/shared-name")) == len(a_memory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory.read("tenant-a/shared-name")[: len(a_memory)] == a_memory
    assert len(memory.read("tenant-a/shared-name")) > len(a_memory)


def test_shared_drafting_memory_is_per_tenant(pki, redis_server, secure_stack):
    """The gateway shares drafting memory across requests (--shared-memory), one per tenant:
    what tenant A's answers taught the drafter never drafts for tenant C."""
    client = redis.Redis.from_url(redis_server.url)

    def memories(tenant: str) -> list[bytes]:
        return list(client.scan_iter(match=f"pardec:{{shared:{tenant}/*"))

    def wait_for_memory(tenant: str) -> list[bytes]:
        deadline = time.monotonic() + 10
        while not memories(tenant) and time.monotonic() < deadline:
            time.sleep(0.05)
        return memories(tenant)

    assert memories("tenant-c") == []
    generate(secure_stack.gateway, ClientTLS(pki.ca), TOKEN_A, max_new_tokens=24)
    assert wait_for_memory("tenant-a") and memories("tenant-c") == []
    generate(secure_stack.gateway, ClientTLS(pki.ca), TOKEN_C, max_new_tokens=24)
    assert wait_for_memory("tenant-c")


def test_a_tenants_cached_prompt_blocks_are_its_own(pki, secure_stack):
    """The prefix cache is scoped by tenant: no tenant can tell from its own time to first
    token which prompts another sent."""
    prompt = f"Case {uuid.uuid4().hex}: " + "Explain what a hash function is, in plain words. " * 8
    tls = ClientTLS(pki.ca)
    first = generate(secure_stack.gateway, tls, TOKEN_A, prompt=prompt, max_new_tokens=4)
    again = generate(secure_stack.gateway, tls, TOKEN_A, prompt=prompt, max_new_tokens=4)
    other = generate(secure_stack.gateway, tls, TOKEN_B, prompt=prompt, max_new_tokens=4)
    assert first.stats.cached_prompt_tokens == 0 and again.stats.cached_prompt_tokens >= 64
    assert other.stats.cached_prompt_tokens == 0
    assert list(first.token_ids) == list(again.token_ids) == list(other.token_ids)


def test_mutual_tls_gateway_takes_the_tenant_from_the_client_certificate(pki, redis_server, secure_stack):
    memory = ConversationMemory(redis.Redis.from_url(redis_server.url), ttl_s=60, key_prefix="pardec")
    memory = _ScopedByModel(memory, secure_stack.model_name)
    with_b = ClientTLS(pki.ca, pki.client_b_cert, pki.client_b_key)
    reply = generate(secure_stack.cert_gateway, with_b, session_id="by-certificate", max_new_tokens=8)
    assert remembered(memory, "tenant-b/by-certificate", reply)
    assert memory.read("by-certificate") == []
    code, _ = refusal(lambda: generate(secure_stack.cert_gateway, ClientTLS(pki.ca), max_new_tokens=4))
    assert code == grpc.StatusCode.UNAVAILABLE  # no client certificate: the handshake fails
    rogue = ClientTLS(pki.ca, pki.rogue_cert, pki.rogue_key)
    code, _ = refusal(lambda: generate(secure_stack.cert_gateway, rogue, max_new_tokens=4))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_pardec_generate_speaks_tls_and_tokens(pki, secure_stack):
    command = [sys.executable, "-m", "pardec.gateway.cli", "generate", "--addr", secure_stack.gateway, "--json",
               "--max-new-tokens", "8", "--tls-ca", pki.ca, PROMPT]
    env = {**os.environ, "PARDEC_TOKEN": TOKEN_A}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["token_ids"]
    env.pop("PARDEC_TOKEN")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1 and "UNAUTHENTICATED" in result.stderr
