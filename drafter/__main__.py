"""python -m pardec.drafter: run one drafter replica (scale them freely; state lives in Redis)."""

from __future__ import annotations

import argparse
import sys

from pardec.drafter.config import DrafterConfig
from pardec.drafter.flags import add_drafter_flags, drafter_config_from_flags
from pardec.drafter.service import DrafterServicer
from pardec.runtime.errors import ConfigError
from pardec.runtime.guards import add_allowed_clients_flag, parse_allowed_clients, server_guards
from pardec.runtime.limits import add_limit_flags, check_limits
from pardec.runtime.metrics import RequestMetrics, RequestMetricsInterceptor, new_registry, serve_metrics
from pardec.runtime.security import add_server_tls_flags, server_tls_from_flags
from pardec.runtime.serving import (
    add_connection_age_flag, configure_logging, listening, start_server, wait_for_termination, write_ready_file,
)

# Replicas added at run time take their share of a DNS-resolving gateway's calls within about this
# long (runtime/serving.py add_connection_age_flag); a reconnect per connection per age is its cost.
MAX_CONNECTION_AGE_S = 30.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pardec.drafter", description="pardec drafter")
    parser.add_argument("--addr", default="127.0.0.1:50052", help="listen address (port 0 = any free port)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    add_drafter_flags(parser)
    add_server_tls_flags(parser, "the drafter's port")
    add_allowed_clients_flag(parser, "the drafter")
    add_limit_flags(parser, "drafter")
    add_connection_age_flag(parser, MAX_CONNECTION_AGE_S)
    parser.add_argument(
        "--redis-timeout-s", type=float, default=DrafterConfig.redis_timeout_s,
        help="bound on connecting to Redis and on each reply; a miss fails the call UNAVAILABLE",
    )  # fmt: skip
    parser.add_argument("--metrics-addr", help="Prometheus metrics at HOST:PORT/metrics (port 0 = any free port)")
    parser.add_argument("--metrics-ready-file", help="write the metrics endpoint's bound address here")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = drafter_config_from_flags(args, tls=server_tls_from_flags(args), redis_timeout_s=args.redis_timeout_s)
        guards = server_guards(config.tls, parse_allowed_clients(args.allowed_clients), "the drafter")
        check_limits(args.max_concurrent_rpcs)
    except ConfigError as error:
        # One line naming the setting and the rule; exit code 2 = cannot start as configured.
        print(f"pardec drafter: configuration error: {error}", file=sys.stderr)
        return 2
    # pardec_drafter_requests_total{method,status}; ..._request_duration_seconds{method} is the
    # drafter's own step latency (Propose) and session start time (StartSession).
    registry = new_registry()
    counting = RequestMetricsInterceptor(RequestMetrics(registry, "pardec_drafter"))
    try:  # metrics first: a bind that fails leaves no gRPC server half started
        metrics_address = args.metrics_addr and listening(
            "--metrics-addr", args.metrics_addr, lambda: serve_metrics(registry, args.metrics_addr)[1])
        server, address = listening("--addr", args.addr, lambda: start_server(
            [DrafterServicer(config).add_to], args.addr, tls=config.tls, interceptors=[*guards, counting],
            max_concurrent_rpcs=args.max_concurrent_rpcs, what="drafter", max_connection_age_s=args.max_connection_age_s,
        ))
    except ConfigError as error:
        print(f"pardec drafter: configuration error: {error}", file=sys.stderr)
        return 2
    if metrics_address:
        write_ready_file(args.metrics_ready_file, metrics_address)
    write_ready_file(args.ready_file, address)
    wait_for_termination(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
