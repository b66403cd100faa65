"""Operations over real servers: health and reflection on all three services, the gateway's
Prometheus metrics, graceful shutdown that finishes in-flight requests, and drafter fallbacks
that lose nothing (a real drafter stopped mid-run)."""

from __future__ import annotations

import doctest
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pardec.drafter.config import DrafterConfig
from pardec.drafter.service import DrafterServicer
import pardec.gateway.stack
from pardec.gateway.config import GatewayConfig
from pardec.gateway.server import start_gateway
from pardec.runtime import health_probe
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.prompts import CODE_PROMPTS

SERVICES = {"gateway": "pardec.v1.Gateway", "verifier": "pardec.v1.Verifier", "drafter": "pardec.v1.Drafter"}


def channel(address):
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def plain_request(prompt, max_new_tokens, **fields):
    return gateway_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=max_new_tokens, decoding=gateway_pb2.DECODING_MODE_PLAIN, **fields
    )


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_answers_health_checks_and_reflection(stack, name):
    with channel(stack.addresses[name]) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", SERVICES[name]):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        listed = ProtoReflectionDescriptorDatabase(ch).get_services()
        assert SERVICES[name] in listed and "grpc.health.v1.Health" in listed
        # grpcurl's `describe`: the service's methods come back with their messages.
        methods = [m.name for m in ProtoReflectionDescriptorDatabase(ch).FindFileContainingSymbol(
            SERVICES[name]).service[0].method]
        assert methods
    assert health_probe.main([stack.addresses[name], SERVICES[name]]) == 0


@pytest.fixture
def own_gateway(stack):
    """A gateway of its own (metrics on, stoppable) over the shared verifier and drafter."""
    config = GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"])
    running = start_gateway(config, "127.0.0.1:0", metrics_address="127.0.0.1:0")
    yield running
    running.stop()


def scrape(running) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{running.metrics_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_gateway_metrics_under_the_names_peers_use(own_gateway):
    assert not own_gateway.metrics_address.endswith(":0")
    with channel(own_gateway.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        reply = stub.Generate(gateway_pb2.GenerateRequest(prompt=CODE_PROMPTS[0], max_new_tokens=24), timeout=300)
        with pytest.raises(grpc.RpcError):
            stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", n=2), timeout=60)
    metrics = scrape(own_gateway)
    stats = reply.stats
    assert metrics['pardec_requests_total{method="Generate",status="OK"}'] == 1
    assert metrics['pardec_requests_total{method="Generate",status="INVALID_ARGUMENT"}'] == 1
    assert metrics["pardec_decode_steps_total"] == stats.steps
    assert metrics["pardec_spec_decode_num_draft_tokens_total"] == stats.draft_tokens
    assert metrics["pardec_spec_decode_num_accepted_tokens_total"] == stats.accepted_draft_tokens
    drafts = metrics["pardec_spec_decode_num_drafts_total"]
    assert 0 < drafts <= stats.steps
    assert metrics["pardec_spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + stats.accepted_draft_tokens / drafts)
    assert metrics["pardec_generation_tokens_total"] == len(reply.token_ids)
    assert metrics["pardec_time_to_first_token_seconds_count"] == 1
    assert metrics["pardec_e2e_request_latency_seconds_count"] == 1
    assert metrics["pardec_requests_running"] == 0
    # each finished request's figures, and a gap between commits per step (vLLM's names)
    reason = {"eos": "stop"}.get(reply.finish_reason, reply.finish_reason)
    assert metrics[f'pardec_request_success_total{{finished_reason="{reason}"}}'] == 1
    assert metrics["pardec_request_generation_tokens_sum"] == len(reply.token_ids)
    assert metrics["pardec_request_prompt_tokens_sum"] == stats.prompt_tokens
    assert metrics["pardec_inter_token_latency_seconds_count"] == stats.steps
    assert metrics["pardec_request_time_per_output_token_seconds_count"] == 1
    decode_s = (stats.total_ms - stats.ttft_ms) / 1e3
    assert metrics["pardec_request_decode_time_seconds_sum"] == pytest.approx(decode_s)
    assert metrics["pardec_request_time_per_output_token_seconds_sum"] == pytest.approx(
        decode_s / (len(reply.token_ids) - 1))
    assert metrics["pardec_inter_token_latency_seconds_sum"] <= decode_s
    with channel(own_gateway.address) as ch:  # a prediction's tokens, by whether they appeared in the answer
        predicted = gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
            prompt=CODE_PROMPTS[0], max_new_tokens=24, prediction=reply.text + " and more"), timeout=300).stats
    metrics = scrape(own_gateway)
    assert metrics['pardec_prediction_tokens_total{outcome="accepted"}'] == predicted.accepted_prediction_tokens > 0
    assert metrics['pardec_prediction_tokens_total{outcome="rejected"}'] == predicted.rejected_prediction_tokens > 0


def test_graceful_shutdown_finishes_in_flight_requests(own_gateway, stack):
    message = plain_request(CODE_PROMPTS[2], 32)
    expected = stack.gateway.Generate(message, timeout=300)
    with channel(own_gateway.address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        call = stub.GenerateStream(message, timeout=300)
        chunks = [next(call)]
        stopper = threading.Thread(target=own_gateway.stop, args=(120,))
        stopper.start()
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as refused:  # new calls are refused during the grace period
            stub.Generate(plain_request("hi", 2), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        chunks += list(call)
        stopper.join(timeout=120)
    assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
    assert chunks[-1].finish_reason == expected.finish_reason


def test_shutdown_reports_not_serving_to_health_checks(stack):
    config = GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"])
    running = start_gateway(config, "127.0.0.1:0")
    with channel(running.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopper = threading.Thread(target=running.stop, args=(5,))
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stopper.join(timeout=30)


def test_a_drafter_stopped_mid_run_loses_nothing(stack, redis_server, engine):
    drafter, drafter_address = start_server(
        [DrafterServicer(DrafterConfig(redis_url=redis_server.url)).add_to], "127.0.0.1:0"
    )
    config = GatewayConfig(
        verifier_target=stack.addresses["verifier"], drafter_target=drafter_address,
        propose_timeout_s=0.5, drafter_retry_s=0.2,
    )
    running = start_gateway(config, "127.0.0.1:0", metrics_address="127.0.0.1:0")
    try:
        message = gateway_pb2.GenerateRequest(prompt=CODE_PROMPTS[0], max_new_tokens=96)
        expected = stack.gateway.Generate(plain_request(CODE_PROMPTS[0], 96), timeout=300)
        with channel(running.address) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            call = stub.GenerateStream(message, timeout=300)
            chunks = [next(call) for _ in range(4)]  # a few drafted steps first
            drafter.stop(None).wait()
            chunks += list(call)
            assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
            assert "".join(c.text for c in chunks) == expected.text
            stats = chunks[-1].stats
            assert stats.draft_tokens > 0 and stats.steps < len(expected.token_ids) - 1
            fallbacks = scrape(running)['pardec_drafter_fallbacks_total{reason="propose"}']
            assert fallbacks >= 1
            # A drafter that is already down when a request starts: plain decoding, same text.
            again = stub.Generate(message, timeout=300)
            assert list(again.token_ids) == list(expected.token_ids) and again.stats.draft_tokens == 0
            assert scrape(running)['pardec_drafter_fallbacks_total{reason="start"}'] == 1
        assert engine.sessions == 0
    finally:
        running.stop()
        drafter.stop(None)


def test_a_drafter_back_after_a_restart_drafts_again_within_the_request(stack, redis_server):
    """Refused calls back off (0.2 s, doubling): a drafter restarted mid-stream on the same
    address (its sessions are in Redis) drafts for the same request again."""
    drafter, address = start_server([DrafterServicer(DrafterConfig(redis_url=redis_server.url)).add_to], "127.0.0.1:0")
    config = GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=address,
                           propose_timeout_s=0.5, drafter_retry_s=0.2)
    running = start_gateway(config, "127.0.0.1:0")
    restarted = None
    try:
        # A long answer, with n-grams to draft: long enough to outlast the refusals' back-off
        # (0.2 s doubling: the fifth try comes 3 s after the stop) on a fast machine too.
        prompt = "Count from 1 to 1000, separated by commas."
        expected = stack.gateway.Generate(plain_request(prompt, 800), timeout=300)
        with channel(running.address) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).GenerateStream(
                gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=800), timeout=300)
            chunks = [next(call) for _ in range(3)]
            drafter.stop(None).wait()
            stopped = time.monotonic()
            while time.monotonic() - stopped < 1.0:  # refused at 0, 0.2 and 0.6 s: plain steps
                chunks.append(next(call))
            restarted, _ = start_server([DrafterServicer(DrafterConfig(redis_url=redis_server.url)).add_to], address)
            back = len(chunks)
            chunks += list(call)
        assert [t for c in chunks for t in c.token_ids] == list(expected.token_ids)
        assert any(len(c.token_ids) > 1 for c in chunks[back:]), "no drafted tokens after the restart"
    finally:
        running.stop()
        drafter.stop(None)
        if restarted is not None:
            restarted.stop(None)


def test_python_m_gateway_serves_the_seed_config_example_with_metrics(stack, tmp_path):
    from tests.test_config_mindie import MEMORY_DECODING_EXAMPLE

    config = tmp_path / "config.json"
    config.write_text(MEMORY_DECODING_EXAMPLE)  # as MindIE's documentation prints it
    ready, metrics_ready = tmp_path / "gateway.addr", tmp_path / "metrics.addr"
    process = subprocess.Popen([
        sys.executable, "-m", "pardec.gateway", "--addr", "127.0.0.1:0", "--config", str(config),
        "--verifier", stack.addresses["verifier"], "--drafter", stack.addresses["drafter"],
        "--ready-file", str(ready), "--metrics-addr", "127.0.0.1:0", "--metrics-ready-file", str(metrics_ready),
        "--log-level", "WARNING",
    ])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), f"gateway exited with {process.poll()}"
        message = gateway_pb2.GenerateRequest(prompt=CODE_PROMPTS[0], max_new_tokens=16)
        with channel(ready.read_text().strip()) as ch:
            reply = gateway_pb2_grpc.GatewayStub(ch).Generate(message, timeout=300)
        expected = stack.gateway.Generate(plain_request(CODE_PROMPTS[0], 16), timeout=300)
        assert list(reply.token_ids) == list(expected.token_ids)
        assert reply.stats.decoding_method == "memory_decoding"
        url = f"http://{metrics_ready.read_text().strip()}/metrics"
        with urllib.request.urlopen(url, timeout=10) as page:
            assert 'pardec_requests_total{method="Generate",status="OK"} 1.0' in page.read().decode()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_pardec_generate_stream_prints_the_same_text(stack, capsys):
    from pardec.gateway import cli

    address = stack.addresses["gateway"]
    args = ["generate", "--addr", address, "--max-new-tokens", "16", "--max-decoding-length", "4", CODE_PROMPTS[0]]
    assert cli.main([*args, "--stream"]) == 0
    streamed = capsys.readouterr()
    assert cli.main(args) == 0
    unary = capsys.readouterr()
    assert streamed.out == unary.out and streamed.out.strip()
    assert ", memory_decoding]" in streamed.err and "16 tokens" in streamed.err  # [model, method]


def test_several_verifiers_on_one_machine_share_its_cpus():
    failures, tried = doctest.testmod(pardec.gateway.stack)
    assert tried and not failures
