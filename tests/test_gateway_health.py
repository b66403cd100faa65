"""Whether the gateway can serve, said where load balancers look (gateway/backend_health.py):
its gRPC health and GET /health follow its verifier replicas, down and back up again."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pardec.gateway.config import GatewayConfig
from pardec.gateway.replicas import VerifierReplicas
from pardec.gateway.server import start_gateway
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from pardec.verifier.service import VerifierServicer

NOWHERE = "127.0.0.1:1"  # nothing listens there


def test_replicas_serve_while_one_does(stack):
    live = stack.addresses["verifier"]
    assert VerifierReplicas.connect(f"{NOWHERE},{live}", 5.0).unavailable(1.0) == ""
    why = VerifierReplicas.connect(NOWHERE, 5.0).unavailable(1.0)
    assert why == f"no verifier replica serves: {NOWHERE}: UNAVAILABLE"


def _http_health(running) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{running.http_address}/health", timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _grpc_health(channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def _until(condition, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def test_the_gateway_serves_while_its_verifier_does(stack, engine):
    verifier, address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    config = GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"],
                           health_check_interval_s=0.1)
    running = start_gateway(config, "127.0.0.1:0", http_address="127.0.0.1:0")
    again = None
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            assert _http_health(running) == (200, {"status": "ok"}) and _grpc_health(channel) == serving
            verifier.stop(None)
            _until(lambda: _http_health(running)[0] == 503)
            assert _http_health(running)[1] == {"status": "unavailable"}  # the why is the log's, not anyone's
            assert running.backend_watch.unavailable == f"no verifier replica serves: {address}: UNAVAILABLE"
            assert _grpc_health(channel) == _grpc_health(channel, "pardec.v1.Gateway") == not_serving
            with pytest.raises(urllib.error.HTTPError) as ping:  # SageMaker's probe says it too
                urllib.request.urlopen(f"http://{running.http_address}/ping", timeout=10)
            assert ping.value.code == 503
            again, _ = start_server([VerifierServicer(engine).add_to], address)  # the replica back, where it was
            _until(lambda: _http_health(running)[0] == 200)
            assert _grpc_health(channel) == _grpc_health(channel, "pardec.v1.Gateway") == serving
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                prompt="Hi", max_new_tokens=2), timeout=60)
            assert len(reply.token_ids) == 2
        running.backend_watch.stop()  # what a gateway's stop does first: it drains from then on
        assert _http_health(running) == (503, {"status": "unavailable"})
    finally:
        running.stop()
        for server in (verifier, again):
            if server is not None:
                server.stop(None)


def test_a_verifier_that_answers_its_health_but_refuses_the_gateway_or_serves_another_model(stack, engine, model,
                                                                                             checkpoint, pki):
    """The health check is open to anyone; whether the verifier lets this gateway in
    (--allowed-clients) and serves the model it serves takes an authorized call (GetModelInfo,
    brief: no tokenizer), so that a load balancer stops sending what every replica would refuse."""
    from pardec.runtime.guards import server_guards
    from pardec.runtime.security import ClientTLS, ServerTLS
    from pardec.verifier.config import VerifierConfig
    from pardec.verifier.engine.engine import Engine

    tls = ServerTLS(pki.server_cert, pki.server_key, pki.ca)

    def verifier_at(address: str, allowed: str, served: Engine = engine):
        return start_server([VerifierServicer(served).add_to], address, tls=tls,
                            interceptors=server_guards(tls, [allowed], "the verifier"))

    first, address = verifier_at("127.0.0.1:0", "localhost")  # the gateway presents the server certificate
    config = GatewayConfig(verifier_target=address, drafter_target=stack.addresses["drafter"],
                           health_check_interval_s=0.1, backend_tls=ClientTLS(pki.ca, pki.server_cert, pki.server_key))
    running = start_gateway(config, "127.0.0.1:0", http_address="127.0.0.1:0")
    servers, other = [first], None
    try:
        assert _http_health(running)[0] == 200
        first.stop(None)
        servers.append(verifier_at(address, "tenant-b")[0])  # back where it was, letting another client in
        _until(lambda: _http_health(running)[0] == 503)
        assert address in running.backend_watch.unavailable and "tenant-b" not in running.backend_watch.unavailable
        servers.pop().stop(None)
        other = Engine(model, checkpoint.tokenizer, "another-model",
                       VerifierConfig(measure_cost_curve=False, served_model_name="another-model"))
        servers.append(verifier_at(address, "localhost", other)[0])
        _until(lambda: "another-model" in running.backend_watch.unavailable)
        assert _http_health(running)[0] == 503
        servers.pop().stop(None)
        servers.append(verifier_at(address, "localhost")[0])  # its own model again
        _until(lambda: _http_health(running)[0] == 200)
    finally:
        running.stop()
        for server in servers:
            server.stop(None)
        if other is not None:
            other.close()
