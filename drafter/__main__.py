"""python -m drafter: run one drafter replica (scale them freely; state lives in Redis)."""

from __future__ import annotations

import argparse
import os
import sys

from drafter.config import DrafterConfig
from drafter.service import DrafterServicer
from pardec.errors import ConfigError
from pardec.metrics import RequestMetrics, RequestMetricsInterceptor, new_registry, serve_metrics
from pardec.security import add_server_tls_flags, client_tls, read_secret, server_tls_from_flags
from pardec.serving import configure_logging, start_server, wait_for_termination, write_ready_file


def main(argv=None) -> int:
    defaults = {name: field.default for name, field in DrafterConfig.__dataclass_fields__.items()}
    parser = argparse.ArgumentParser(prog="python -m drafter", description="pardec drafter")
    parser.add_argument("--addr", default="127.0.0.1:50052", help="listen address (port 0 = any free port)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    parser.add_argument("--redis-url", default=None, help="Redis URL (default: $REDIS_URL)")
    parser.add_argument("--session-ttl-s", type=int, default=defaults["session_ttl_s"])
    parser.add_argument(
        "--conversation-ttl-s", type=int, default=defaults["conversation_ttl_s"],
        help="how long a conversation's earlier answers (multi-turn drafting memory) are kept",
    )  # fmt: skip
    parser.add_argument(
        "--shared-memory-contexts", type=int, default=defaults["shared_memory_contexts"],
        help="most two-token contexts a shared cross-request drafting memory keeps",
    )  # fmt: skip
    parser.add_argument(
        "--redis-password-file", help="file holding the Redis AUTH password (default: $REDIS_PASSWORD, if set)"
    )
    parser.add_argument("--redis-tls-ca", help="PEM CA that the rediss:// server's certificate must chain to")
    parser.add_argument("--redis-tls-cert", help="PEM client certificate for Redis (tls-auth-clients)")
    parser.add_argument("--redis-tls-key", help="PEM key of --redis-tls-cert")
    add_server_tls_flags(parser, "the drafter's port")
    parser.add_argument("--metrics-addr", help="Prometheus metrics at HOST:PORT/metrics (port 0 = any free port)")
    parser.add_argument("--metrics-ready-file", help="write the metrics endpoint's bound address here")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = DrafterConfig(
            redis_url=args.redis_url or os.environ.get("REDIS_URL", ""),
            session_ttl_s=args.session_ttl_s,
            conversation_ttl_s=args.conversation_ttl_s,
            shared_memory_contexts=args.shared_memory_contexts,
            redis_password=read_secret(args.redis_password_file, "redis_password_file")
            if args.redis_password_file else os.environ.get("REDIS_PASSWORD"),
            redis_tls=client_tls(args.redis_tls_ca, args.redis_tls_cert, args.redis_tls_key),
            tls=server_tls_from_flags(args),
        )
    except ConfigError as error:
        # One line naming the setting and the rule; exit code 2 = cannot start as configured.
        print(f"pardec drafter: configuration error: {error}", file=sys.stderr)
        return 2
    # pardec_drafter_requests_total{method,status}; ..._request_duration_seconds{method} is the
    # drafter's own step latency (Propose) and session start time (StartSession).
    registry = new_registry()
    counting = RequestMetricsInterceptor(RequestMetrics(registry, "pardec_drafter"))
    server, address = start_server([DrafterServicer(config).add_to], args.addr, tls=config.tls, interceptors=[counting])
    if args.metrics_addr:
        _, metrics_address = serve_metrics(registry, args.metrics_addr)
        write_ready_file(args.metrics_ready_file, metrics_address)
    write_ready_file(args.ready_file, address)
    wait_for_termination(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
