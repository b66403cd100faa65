"""Hostile callers, through real servers on loopback: what a caller who can reach a port (with
or without credentials) can make a service spend. Refusals before authentication cost the same
for any message size, and the public message size is bounded; made-up method names make no
metric series; internal services take only the identities they are configured for; session ids
are checked and always scoped by tenant and model; a full gateway refuses the next call at once
and keeps answering health checks. Redis bounds: test_redis_bounds.py."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pardec.drafter.config import DrafterConfig
from pardec.drafter.memory import ConversationMemory
from pardec.drafter.service import DrafterServicer
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import start_gateway
from pardec.runtime.guards import certificate_fingerprint, certificate_name, server_guards
from pardec.runtime.limits import PUBLIC_MAX_MESSAGE_BYTES
from pardec.runtime.security import ANONYMOUS, BearerTokens, ClientTLS, ServerTLS, model_scope, open_channel
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from pardec.verifier.service import VerifierServicer
from tests.secure import PROMPT, TOKEN_A, _make_cert, start_and_end

GENERATE = "/pardec.v1.Gateway/Generate"
AUTH_A = (("authorization", f"Bearer {TOKEN_A}"),)


@pytest.fixture(scope="module")
def token_gateway(stack):
    """A gateway that requires bearer tokens, on the shared verifier and drafter, with metrics."""
    config = GatewayConfig(
        verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"],
        tokens=BearerTokens.from_mapping({TOKEN_A: "tenant-a"}),
    )
    running = start_gateway(config, "127.0.0.1:0", metrics_address="127.0.0.1:0")
    yield running
    running.stop()


def raw_call(address: str, method: str, body: bytes, metadata=None, timeout: float = 60) -> tuple[grpc.StatusCode, str]:
    """Sends ``body`` as it is (no client-side serialization) and returns the status."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        try:
            channel.unary_unary(method)(body, metadata=metadata, timeout=timeout)
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def malformed(size: int) -> bytes:
    """``size`` bytes of a message that protobuf refuses only at its very end: many tiny unknown
    fields (field 2000, varint 1) and then a truncated length. Explaining it field by field walks
    every one of them."""
    field = bytes([0x80, 0xFD, 0x01, 0x01])  # key of field 2000, wire type 0; value 1
    return field * (size // len(field)) + b"\x0a\xff"


# ------------------------------------------------------------- 1. refusals before authentication

def test_an_unauthenticated_refusal_costs_the_same_for_a_large_message(token_gateway):
    tiny = gateway_pb2.GenerateRequest(prompt="hi").SerializeToString()
    large = malformed(900 * 1024)
    assert len(large) < PUBLIC_MAX_MESSAGE_BYTES
    for body in (tiny, large):  # warm the connection path; both refused before anything parses
        code, details = raw_call(token_gateway.address, GENERATE, body)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in details
    timings = {"tiny": [], "large": []}
    for _ in range(7):  # interleaved, so that a busy machine slows both alike
        for name, body in (("tiny", tiny), ("large", large)):
            started = time.perf_counter()
            raw_call(token_gateway.address, GENERATE, body)
            timings[name].append(time.perf_counter() - started)
    tiny_s, large_s = statistics.median(timings["tiny"]), statistics.median(timings["large"])
    # Sending 900 KiB over loopback costs a little; walking its fields in Python cost hundreds
    # of times the tiny call before the body went unparsed.
    assert large_s < 10 * tiny_s + 0.05, (tiny_s, large_s)
    # With a valid token the same body is parsed, and refused naming what is wrong with it.
    code, details = raw_call(token_gateway.address, GENERATE, large, metadata=AUTH_A)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "truncated" in details


def test_a_message_over_the_public_limit_is_refused_naming_the_limit(token_gateway):
    body = gateway_pb2.GenerateRequest(prompt="x" * PUBLIC_MAX_MESSAGE_BYTES).SerializeToString()
    code, details = raw_call(token_gateway.address, GENERATE, body, metadata=AUTH_A)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and str(PUBLIC_MAX_MESSAGE_BYTES) in details
    # A message within the limit is read and judged on its merits (here: an empty prompt).
    code, details = raw_call(token_gateway.address, GENERATE, b"\x10\x01", metadata=AUTH_A)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in details


def metric_series(address: str) -> set[str]:
    page = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0] for line in page.splitlines() if line and not line.startswith("#")}


def test_made_up_method_names_make_no_metric_series(token_gateway):
    assert raw_call(token_gateway.address, "/pardec.v1.Gateway/Bogus123", b"")[0] == grpc.StatusCode.UNAUTHENTICATED
    before = metric_series(token_gateway.metrics_address)
    for name in ("Bogus456", "x" * 200, "Generate2"):
        code, _ = raw_call(token_gateway.address, f"/pardec.v1.Gateway/{name}", b"")
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = raw_call(token_gateway.address, f"/pardec.v1.Gateway/{name}", b"", metadata=AUTH_A)
        assert code == grpc.StatusCode.UNIMPLEMENTED
    after = metric_series(token_gateway.metrics_address)
    assert after == before, after - before
    assert not [series for series in after if "Bogus" in series]
    refused = token_gateway.generator.metrics.registry.get_sample_value(
        "pardec_requests_total", {"method": "unknown", "status": "UNAUTHENTICATED"}
    )
    assert refused == 4


# ------------------------------------------------------------- 2. internal services' identities

@pytest.fixture(scope="module")
def gateway_cert(pki) -> tuple[str, str]:
    """A client certificate of the same CA for the gateway: CN=pardec-gateway."""
    directory = Path(pki.ca).parent
    _make_cert(directory, "ca", "pardec-gateway", "pardec-gateway")
    return str(directory / "pardec-gateway.pem"), str(directory / "pardec-gateway.key")


def test_internal_services_take_only_their_allowed_clients(pki, redis_server, engine, gateway_cert):
    internal = ServerTLS(pki.server_cert, pki.server_key, pki.ca)
    guards = server_guards(internal, ["pardec-gateway"], "the drafter")
    drafter, drafter_address = start_server(
        [DrafterServicer(DrafterConfig(redis_url=redis_server.url)).add_to], "127.0.0.1:0", tls=internal,
        interceptors=guards,
    )
    verifier, verifier_address = start_server(
        [VerifierServicer(engine).add_to], "127.0.0.1:0", tls=internal,
        interceptors=server_guards(internal, ["pardec-gateway"], "the verifier"),
    )
    as_gateway = ClientTLS(pki.ca, *gateway_cert)
    as_tenant = ClientTLS(pki.ca, pki.client_a_cert, pki.client_a_key)
    try:
        assert start_and_end(drafter_address, as_gateway) == grpc.StatusCode.OK
        assert start_and_end(drafter_address, as_tenant) == grpc.StatusCode.PERMISSION_DENIED
        with open_channel(verifier_address, as_tenant, CHANNEL_OPTIONS) as channel:
            with pytest.raises(grpc.RpcError) as raised:
                verifier_pb2_grpc.VerifierStub(channel).GetModelInfo(verifier_pb2.GetModelInfoRequest(), timeout=30)
            assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "tenant-a" in raised.value.details() and "--allowed-clients" in raised.value.details()
            # Probes stay open to any certificate of the CA.
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        # The whole path: a gateway with the allowed certificate drafts and verifies through both.
        gateway = start_gateway(GatewayConfig(
            verifier_target=verifier_address, drafter_target=drafter_address, backend_tls=as_gateway,
        ), "127.0.0.1:0")
        try:
            with grpc.insecure_channel(gateway.address, options=CHANNEL_OPTIONS) as channel:
                reply = gateway_pb2_grpc.GatewayStub(channel).Generate(
                    gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=24), timeout=300
                )
            assert reply.token_ids and reply.stats.draft_tokens > 0
        finally:
            gateway.stop()
    finally:
        drafter.stop(None)
        verifier.stop(None)


def test_allowed_clients_need_mutual_tls_and_pardec_up_names_its_internal_certificate(pki, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pardec.drafter", "--redis-url", f"unix://{tmp_path}/none.sock",
         "--allowed-clients", "pardec-gateway"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "--allowed-clients: needs mutual TLS" in result.stderr
    assert certificate_name(pki.server_cert) == "localhost"
    assert certificate_name(pki.client_a_cert) == "tenant-a"
    # A name may be carried by other certificates of the CA ("localhost" by every one of these);
    # up allows its internal certificate by fingerprint, which no other certificate has.
    fingerprints = {certificate_fingerprint(cert) for cert in (pki.server_cert, pki.client_a_cert)}
    assert len(fingerprints) == 2 and all(f.startswith("sha256:") and len(f) == 71 for f in fingerprints)


# ------------------------------------------------------------- 3. session ids

def refusal(stub_call, request, metadata=None) -> tuple[grpc.StatusCode, str]:
    try:
        stub_call(request, timeout=60, metadata=metadata)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("session_id", ["tenant-a/chat", "a b", "x" * 101, "é", "a{b}"])
def test_client_session_ids_are_checked(stack, session_id):
    request = gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=2, session_id=session_id)
    code, details = refusal(stack.gateway.Generate, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("session_id:")
    assert "1 to 100 of" in details and len(details) < 300


def test_anonymous_conversations_live_in_their_own_namespace_scoped_by_model(stack, redis_server, token_gateway):
    memory = ConversationMemory(redis.Redis.from_url(redis_server.url), ttl_s=60, key_prefix="pardec")
    model = model_scope(token_gateway.generator.model.model_name)
    reply = stack.gateway.Generate(
        gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=12, session_id="anon-chat"), timeout=300
    )
    expected = f"{ANONYMOUS}/{model}/anon-chat"
    deadline = time.monotonic() + 10
    while not memory.read(expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory.read(expected) == list(reply.token_ids)
    assert memory.read("anon-chat") == [] and memory.read(f"{model}/anon-chat") == []
    # The token gateway's tenant-a, same id: its own memory, under its own name.
    with grpc.insecure_channel(token_gateway.address, options=CHANNEL_OPTIONS) as channel:
        gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateRequest(prompt="Name three colors.", max_new_tokens=8, session_id="anon-chat"),
            timeout=300, metadata=AUTH_A,
        )
    deadline = time.monotonic() + 10
    while not memory.read(f"tenant-a/{model}/anon-chat") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory.read(f"tenant-a/{model}/anon-chat") and memory.read(expected) == list(reply.token_ids)
    assert model_scope("HuggingFaceTB/SmolLM2-135M-Instruct").startswith("model-")


# ------------------------------------------------------------- 4. concurrency

COUNTING = "Count from 1 to 2000, one number per line, with nothing else."


def test_a_full_gateway_refuses_the_next_call_and_still_answers_health_checks(stack):
    config = GatewayConfig(
        verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"], max_concurrent_rpcs=2,
    )
    gateway = start_gateway(config, "127.0.0.1:0")
    channel = grpc.insecure_channel(gateway.address, options=CHANNEL_OPTIONS)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    long_request = gateway_pb2.GenerateRequest(
        prompt=COUNTING, max_new_tokens=1500, decoding=gateway_pb2.DECODING_MODE_PLAIN
    )
    streams = [stub.GenerateStream(long_request, timeout=600) for _ in range(2)]
    try:
        for stream in streams:
            assert next(stream).token_ids  # both generating: the gateway is full
        code, details = refusal(stub.Generate, gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-rpcs" in details, details
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # ... answered while both generations were still running, not after them.
        assert all(not next(stream).finish_reason for stream in streams)
        refused = gateway.generator.metrics.registry.get_sample_value(
            "pardec_requests_total", {"method": "Generate", "status": "RESOURCE_EXHAUSTED"}
        )
        assert refused == 1
    finally:
        for stream in streams:
            stream.cancel()
    # Cancelled streams give their slots back.
    deadline = time.monotonic() + 30
    while True:
        code, _ = refusal(stub.Generate, gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=2))
        if code == grpc.StatusCode.OK or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert code == grpc.StatusCode.OK
    channel.close()
    gateway.stop()


def test_a_model_name_that_is_no_redis_name_still_gets_its_shared_memory(stack, model, checkpoint, redis_server):
    """The shared memory is named after the model's scope (a digest of a name with braces, "/"
    or 200 characters), as a conversation's is: the raw name made every StartSession fail."""
    from pardec.verifier.config import VerifierConfig
    from pardec.verifier.engine.engine import Engine

    name = "org/{odd}-" + "m" * 200
    engine = Engine(model, checkpoint.tokenizer, name, VerifierConfig(measure_cost_curve=False, served_model_name=name))
    verifier, address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    gateway = start_gateway(GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"],
                                          shared_memory=True), "127.0.0.1:0")
    client = redis.Redis.from_url(redis_server.url)
    try:
        with grpc.insecure_channel(gateway.address, options=CHANNEL_OPTIONS) as channel:
            gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=12), timeout=300)
        pattern = f"pardec:{{shared:{ANONYMOUS}/{model_scope(name)}}}*"
        deadline = time.monotonic() + 10
        while not list(client.scan_iter(match=pattern)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(client.scan_iter(match=pattern))
    finally:
        gateway.stop()
        verifier.stop(None)
        engine.close()
