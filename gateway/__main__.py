"""python -m pardec.gateway: run the public gateway on its own (deployments, `pardec up`)."""

from __future__ import annotations

import argparse
import logging
import sys

from pardec.drafter.flags import add_drafter_flags, drafter_config_from_flags
from pardec.gateway.config import GatewayConfig, LoadPolicy
from pardec.gateway.draft_ahead import OVERLAP_CHOICES
from pardec.gateway.http_options import add_http_flags, http_options_from_flags
from pardec.gateway.mindie import load_mindie_config
from pardec.gateway.server import start_gateway
from pardec.runtime.errors import ConfigError, PardecError
from pardec.runtime.limits import add_limit_flags
from pardec.runtime.security import BearerTokens, add_server_tls_flags, client_tls, server_tls_from_flags
from pardec.runtime.serving import configure_logging, wait_for_termination, write_ready_file

log = logging.getLogger("pardec.gateway")

EMBEDDED = "embedded"  # --drafter's value for drafting in the gateway's process


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.gateway", description="pardec gateway")
    parser.add_argument("--addr", default="127.0.0.1:50051", help="listen address (port 0 = any free port)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    parser.add_argument(
        "--verifier", default="127.0.0.1:50053",
        help="verifier replicas, host:port[,host:port...]: a session stays on one, and moves to another "
             "(re-prefilled) if its replica fails",
    )
    parser.add_argument(
        "--drafter", default="127.0.0.1:50052",
        help=f"drafter gRPC target (comma list or dns:/// for replicas), or {EMBEDDED!r}: draft in this process "
             "on --redis-url (one network hop fewer per step)",
    )  # fmt: skip
    add_drafter_flags(parser)
    parser.add_argument("--config", help="MindIE-style config.json")
    parser.add_argument("--max-model-len", type=int, metavar="N",
                        help="positions a sequence may hold (vLLM's): maxSeqLen N and maxInputTokenLen N - 1 (a config "
                             "file's smaller one stays), over the config's; the verifiers must be given the same")
    parser.add_argument("--metrics-addr", help="Prometheus metrics at HOST:PORT/metrics (port 0 = any free port)")
    parser.add_argument("--metrics-ready-file", help="write the metrics endpoint's bound address here")
    parser.add_argument(
        "--http-addr", help="OpenAI-compatible HTTP API at HOST:PORT (/v1/chat/completions, ...; port 0 = any free port)"
    )
    parser.add_argument("--http-ready-file", help="write the HTTP API's bound address here")
    add_http_flags(parser)
    parser.add_argument("--otlp-traces-endpoint", default="",
                        help="send a span per request to this OpenTelemetry collector over OTLP/gRPC: HOST:PORT, or "
                             "grpc://, http:// or https:// (TLS) HOST:PORT (vLLM's flag)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log a line per request once it ends: its id (X-Request-Id), status, tokens, steps and "
                             "times; never its text (vLLM's flag)")
    parser.add_argument("--log-stats-interval-s", type=float, default=10.0,
                        help="log a line of the load (throughput, parallel decoding's acceptance) at most this often "
                             "while requests run (default 10; 0 = off)")
    parser.add_argument("--disable-log-stats", action="store_true", help="no load lines (vLLM's flag)")
    parser.add_argument("--health-check-interval-s", type=float, default=2.0,
                        help="ask the verifier replicas' health this often: while none serves, the gateway's gRPC "
                             "health says NOT_SERVING and GET /health 503 (default 2; 0 = never: it serves while up)")
    parser.add_argument("--propose-timeout-s", type=float, help="per-step drafter deadline; a miss = a plain step")
    parser.add_argument(
        "--load-plain-from", type=int,
        help="in-flight requests from which every step runs plain (default 16; 0 = off: the cost model and the "
             "load governor decide at any load)",
    )  # fmt: skip
    parser.add_argument(
        "--load-govern-from", type=int,
        help="in-flight requests from which the gateway measures whether drafting pays at all, per load band "
             "(default 2; 0 = off)",
    )  # fmt: skip
    parser.add_argument(
        "--shared-memory", action="store_true", help="draft also from earlier requests' outputs (cross-request memory)"
    )
    parser.add_argument(
        "--overlap-drafting", choices=OVERLAP_CHOICES, default="auto",
        help="draft the next step's tree while the verifier runs this one (auto: when the verifier is not on CPU)",
    )  # fmt: skip
    add_server_tls_flags(parser, "the public port")
    parser.add_argument("--backend-tls-ca", help="PEM CA that verifier and drafter certificates must chain to (TLS)")
    parser.add_argument("--backend-tls-cert", help="PEM client certificate for the verifier and drafters (mTLS)")
    parser.add_argument("--backend-tls-key", help="PEM key of --backend-tls-cert")
    parser.add_argument(
        "--token", action="append", default=[], metavar="TENANT=TOKEN",
        help="require a bearer token; this one names TENANT (repeatable; prefer --tokens-file: argv is visible)",
    )  # fmt: skip
    parser.add_argument("--tokens-file", help='JSON {"TOKEN": "TENANT", ...}: bearer tokens and their tenants')
    add_limit_flags(parser, "gateway", public=True)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        settings = load_mindie_config(args.config)
        if args.max_model_len is not None:
            settings = settings.bounded(args.max_model_len, from_file=bool(args.config))
        extra = {"propose_timeout_s": args.propose_timeout_s} if args.propose_timeout_s else {}
        if args.shared_memory:
            extra["shared_memory"] = True
        extra["overlap_drafting"] = args.overlap_drafting
        extra["log_requests"] = args.enable_log_requests
        extra["log_stats_interval_s"] = 0.0 if args.disable_log_stats else args.log_stats_interval_s
        extra["health_check_interval_s"] = args.health_check_interval_s
        policy = {"plain_from": args.load_plain_from, "govern_from": args.load_govern_from}
        policy = {name: value for name, value in policy.items() if value is not None}
        if policy:
            extra["load_policy"] = LoadPolicy(**policy)
        if args.drafter == EMBEDDED:
            extra["embedded_drafter"] = drafter_config_from_flags(args)
        elif args.redis_url:
            raise ConfigError(f"--redis-url: only with --drafter {EMBEDDED} (drafter replicas have their own)")
        config = GatewayConfig(
            verifier_target=args.verifier, drafter_target="" if args.drafter == EMBEDDED else args.drafter,
            **settings.gateway_overrides(), **extra,
            tls=server_tls_from_flags(args),
            backend_tls=client_tls(args.backend_tls_ca, args.backend_tls_cert, args.backend_tls_key),
            tokens=BearerTokens.from_sources(args.token, args.tokens_file),
            max_message_bytes=args.max_message_bytes, max_concurrent_rpcs=args.max_concurrent_rpcs,
            otlp_traces_endpoint=args.otlp_traces_endpoint, http_options=http_options_from_flags(args),
        )
        running = start_gateway(config, args.addr, args.metrics_addr, args.http_addr)
    except (ConfigError, PardecError) as error:
        # One line naming the key, the value and the rule; exit code 2 = cannot start as configured.
        print(f"pardec gateway: configuration error: {error}", file=sys.stderr)
        return 2
    # First: a supervisor reads these once the gRPC address is there.
    if running.metrics_address:
        write_ready_file(args.metrics_ready_file, running.metrics_address)
    if running.http_address:
        write_ready_file(args.http_ready_file, running.http_address)
    write_ready_file(args.ready_file, running.address)
    wait_for_termination(running.server, also_stop=running.stop_http)
    running.flush_traces()  # after the drain: the last requests' spans too
    return 0


if __name__ == "__main__":
    sys.exit(main())
