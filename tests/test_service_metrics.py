"""Prometheus metrics of the verifier and the drafter themselves (the gateway's have their own
test in test_gateway_ops.py): request counts by method and status, step latency, sessions,
queue depth and KV-cache use, scraped over HTTP from real servers."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import grpc

from pardec.runtime.metrics import serve_metrics
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from pardec.verifier.metrics import verifier_metrics
from pardec.verifier.service import VerifierServicer


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as page:
        lines = page.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and not line.startswith("#")}


def test_verifier_metrics_count_rpcs_steps_and_sessions(engine):
    registry, counting = verifier_metrics(engine)
    server, address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0", interceptors=[counting])
    http, metrics_address = serve_metrics(registry, "127.0.0.1:0")
    try:
        before = scrape(metrics_address)
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            prompt = engine.tokenizer.encode_chat("Name a colour.")
            prefilled = stub.Prefill(verifier_pb2.PrefillRequest(session_id="metrics-a", token_ids=prompt), timeout=60)
            during = scrape(metrics_address)
            tree = common_pb2.TokenTree(token_ids=[1, 2], parents=[-1, 0])
            stub.Verify(verifier_pb2.VerifyRequest(session_id="metrics-a", tree=tree), timeout=60)
            try:
                stub.Verify(verifier_pb2.VerifyRequest(session_id="nobody", tree=tree), timeout=60)
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.NOT_FOUND
            stub.Release(verifier_pb2.ReleaseRequest(session_id="metrics-a"), timeout=60)
        after = scrape(metrics_address)
    finally:
        http.shutdown()
        http.server_close()
        server.stop(None)
    assert after['pardec_verifier_requests_total{method="Prefill",status="OK"}'] == 1
    assert after['pardec_verifier_requests_total{method="Verify",status="OK"}'] == 1
    assert after['pardec_verifier_requests_total{method="Verify",status="NOT_FOUND"}'] == 1
    assert after['pardec_verifier_request_duration_seconds_count{method="Verify"}'] == 2
    assert during["pardec_verifier_sessions"] == before["pardec_verifier_sessions"] + 1
    assert during["pardec_verifier_kv_cache_usage_perc"] > before["pardec_verifier_kv_cache_usage_perc"]
    assert after["pardec_verifier_sessions"] == before["pardec_verifier_sessions"]
    assert after["pardec_verifier_verify_steps_total"] == before["pardec_verifier_verify_steps_total"] + 1
    # The shared engine may hold the prompt's first blocks from an earlier test: those are not computed.
    computed = len(prompt) - prefilled.cached_tokens
    assert after["pardec_verifier_forward_tokens_total"] >= before["pardec_verifier_forward_tokens_total"] + computed + 3
    assert after["pardec_verifier_prompt_tokens_total"] == before["pardec_verifier_prompt_tokens_total"] + len(prompt)
    hits = "pardec_verifier_prefix_cache_hit_tokens_total"
    assert after[hits] == before[hits] + prefilled.cached_tokens
    assert after["pardec_verifier_forward_seconds_total"] > before["pardec_verifier_forward_seconds_total"]
    assert after["pardec_verifier_queue_depth"] == 0
    assert not any(key.startswith("pardec_verifier_requests_total{method=\"Check\"") for key in after)


def test_python_m_drafter_serves_its_metrics(redis_server, tmp_path):
    ready, metrics_ready = tmp_path / "drafter.addr", tmp_path / "metrics.addr"
    process = subprocess.Popen([
        sys.executable, "-m", "pardec.drafter", "--addr", "127.0.0.1:0", "--redis-url", redis_server.url,
        "--ready-file", str(ready), "--metrics-addr", "127.0.0.1:0", "--metrics-ready-file", str(metrics_ready),
        "--log-level", "WARNING",
    ])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), f"drafter exited with {process.poll()}"
        with grpc.insecure_channel(ready.read_text().strip(), options=CHANNEL_OPTIONS) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            config = drafter_pb2.DraftConfig(plugin_type="memory_decoding", decoding_length=8)
            stub.StartSession(drafter_pb2.StartSessionRequest(
                session_id="metrics-d", prompt_token_ids=[5, 6, 7, 5, 6], config=config), timeout=30)
            stub.Propose(drafter_pb2.ProposeRequest(session_id="metrics-d", new_token_ids=[7], max_nodes=8,
                                                    max_depth=8), timeout=30)
            stub.EndSession(drafter_pb2.EndSessionRequest(session_id="metrics-d"), timeout=30)
        metrics = scrape(metrics_ready.read_text().strip())
        for method in ("StartSession", "Propose", "EndSession"):
            assert metrics[f'pardec_drafter_requests_total{{method="{method}",status="OK"}}'] == 1
        assert metrics['pardec_drafter_request_duration_seconds_count{method="Propose"}'] == 1
    finally:
        process.terminate()
        process.wait(30)
