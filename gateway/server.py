"""Builds a running gateway from its config."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from pardec.gateway.clients import DrafterClient
from pardec.gateway.config import GatewayConfig
from pardec.gateway.embedded_drafter import EmbeddedDrafter
from pardec.gateway.generation import Generator
from pardec.gateway.http_front import OpenAIFront
from pardec.gateway.http_anthropic import add_routes as add_anthropic_routes
from pardec.gateway.http_metrics import add_routes as add_metrics_routes
from pardec.gateway.http_responses import add_routes as add_responses_routes
from pardec.gateway.http_sagemaker import add_routes as add_sagemaker_routes
from pardec.gateway.http_tgi import add_routes as add_tgi_routes
from pardec.gateway.http_tokenize import add_routes as add_tokenize_routes
from pardec.gateway.http_options import HttpOptions
from pardec.gateway.backend_health import BackendWatch
from pardec.gateway.http_health import add_routes as add_health_routes
from pardec.gateway.http_server import HttpServer
from pardec.gateway.load_log import LoadLog
from pardec.gateway.metrics import GatewayMetrics
from pardec.gateway.replicas import VerifierReplicas
from pardec.gateway.service import GatewayServicer
from pardec.runtime.errors import ConfigError
from pardec.runtime.limits import ConcurrencyLimit
from pardec.runtime.metrics import serve_metrics
from pardec.runtime.security import Authenticator
from pardec.runtime.serving import is_loopback_address, set_serving, start_server, stop_gracefully

log = logging.getLogger(__name__)


def build_generator(
    config: GatewayConfig, verifier_wait_s: float = 600.0, metrics: GatewayMetrics | None = None
) -> Generator:
    """Connects to the verifier (waiting for it to load its model) and checks MindIE's model
    rules against what it serves; a broken rule raises ConfigError."""
    metrics = metrics or GatewayMetrics()
    verifier = VerifierReplicas.connect(
        config.verifier_target, config.rpc_timeout_s, config.backend_tls, on_failover=metrics.verifier_failover
    )
    if config.embedded_drafter is not None:
        drafter = EmbeddedDrafter(config.embedded_drafter, config.drafter_session_timeout_s, config.propose_timeout_s)
    else:
        drafter = DrafterClient(
            config.drafter_target, config.drafter_session_timeout_s, config.propose_timeout_s, config.backend_tls
        )
    model = verifier.model_info(wait_s=verifier_wait_s)
    log.info(
        "serving %s (%s, %s), maxSeqLen %d", model.model_name, model.architecture, model.quantization,
        model.max_seq_len,
    )
    return Generator(config, verifier, drafter, model, metrics)


@dataclass
class RunningGateway:
    server: grpc.Server
    address: str
    generator: Generator
    metrics_server: object | None = None  # prometheus_client's WSGI server
    metrics_address: str | None = None
    http: HttpServer | None = None  # the OpenAI-compatible HTTP API
    limit: ConcurrencyLimit | None = None  # the admission slots both fronts take
    load_log: LoadLog | None = None  # a log line of the load every interval (gateway/load_log.py)
    backend_watch: BackendWatch | None = None  # whether a verifier replica serves (gateway/backend_health.py)

    @property
    def http_address(self) -> str | None:
        return self.http.address if self.http is not None else None

    def stop_http(self, grace_s: float = 10.0) -> None:
        if self.http is not None:
            self.http.stop(grace_s)
            self.http = None

    def stop(self, grace_s: float | None = None) -> None:
        for watch in (self.load_log, self.backend_watch):  # first: GET /health says it is draining
            if watch is not None:
                watch.stop()
        if grace_s is None:
            self.server.stop(None)
        else:
            stop_gracefully(self.server, grace_s)
        self.stop_http(grace_s or 0.0)
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        self.generator.drafter.close()
        self.flush_traces()

    def flush_traces(self) -> None:
        """Sends the spans still queued (a request's span ends as its generation does)."""
        if self.generator.reports.tracer is not None:
            self.generator.reports.tracer.shutdown()


def start_gateway(
    config: GatewayConfig, address: str, metrics_address: str | None = None, http_address: str | None = None
) -> RunningGateway:
    """Starts the gateway and, with ``metrics_address`` (port 0 allowed), its Prometheus endpoint;
    with ``http_address``, its OpenAI-compatible HTTP API (gateway/http_front.py)."""
    authenticator = Authenticator(config.tokens, tenant_from_client_cert=bool(config.tls and config.tls.mutual))
    if http_address is not None and authenticator.tenant_from_client_cert and not config.tokens:
        raise ConfigError(
            "--http-addr: tenants named by client certificates (mutual TLS without bearer tokens) are not read "
            "on the HTTP API; give the gateway bearer tokens (--tokens-file) or leave the HTTP API off"
        )
    if http_address is None and config.http_options != HttpOptions():
        raise ConfigError("--allowed-origins, --enable-request-id-headers, ...: options of the HTTP API, which is off "
                          "(no --http-addr)")
    generator = build_generator(config)
    for served, where in ((address, "gRPC"), (http_address, "HTTP")):
        if served and config.tokens and config.tls is None and not is_loopback_address(served):
            log.warning("bearer tokens without --tls-cert: tokens cross the network in plaintext (%s)", where)
    requests = generator.metrics.requests
    limit = ConcurrencyLimit(
        config.max_concurrent_rpcs, "gateway", lambda method: requests.refused(method, grpc.StatusCode.RESOURCE_EXHAUSTED)
    )
    server, bound = start_server(
        [GatewayServicer(generator, authenticator).add_to], address, tls=config.tls,
        interceptors=authenticator.interceptors(
            on_refused=lambda method: requests.refused(method, grpc.StatusCode.UNAUTHENTICATED)
        ),
        max_concurrent_rpcs=config.max_concurrent_rpcs, max_message_bytes=config.max_message_bytes,
        what="gateway", limit=limit,
    )
    running = RunningGateway(server, bound, generator, limit=limit)

    def alive() -> bool:  # the gRPC server not stopped: the threads below end with it (`serve`'s callers)
        return server.wait_for_termination(0)

    if config.log_stats_interval_s:
        running.load_log = LoadLog(generator.metrics.registry, config.log_stats_interval_s, alive)
    if config.health_check_interval_s:
        running.backend_watch = BackendWatch(generator.verifier, config.health_check_interval_s,
                                             lambda serving: set_serving(server, serving), alive)
    if http_address is not None:
        try:
            front = OpenAIFront(generator, authenticator, limit, config.max_message_bytes)
            add_tokenize_routes(front)
            add_health_routes(front, running.backend_watch)
            add_responses_routes(front)
            add_sagemaker_routes(front)
            add_metrics_routes(front)
            add_tgi_routes(front)
            add_anthropic_routes(front)
            # Connections beyond generations' slots: streams, refusals, keep-alive, probes.
            running.http = HttpServer(config.http_options.wrap(front.app), http_address, config.tls,
                                      max_connections=4 * config.max_concurrent_rpcs + 64)
        except BaseException:
            running.stop()
            raise
        log.info("OpenAI-compatible API on %s://%s/v1", "https" if config.tls else "http", running.http.address)
    if metrics_address is not None:
        running.metrics_server, running.metrics_address = serve_metrics(generator.metrics.registry, metrics_address)
        log.info("metrics on http://%s/metrics", running.metrics_address)
    return running


def serve(config: GatewayConfig, address: str) -> tuple[grpc.Server, str]:
    running = start_gateway(config, address)
    return running.server, running.address
