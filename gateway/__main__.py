"""python -m gateway: run the public gateway on its own (deployments, `pardec up`)."""

from __future__ import annotations

import argparse

from gateway.config import GatewayConfig
from gateway.mindie import load_mindie_config
from gateway.server import serve
from pardec.serving import configure_logging, wait_for_termination, write_ready_file


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="pardec gateway")
    parser.add_argument("--addr", default="127.0.0.1:50051", help="listen address (port 0 = any free port)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    parser.add_argument("--verifier", default="127.0.0.1:50053", help="verifier gRPC target")
    parser.add_argument("--drafter", default="127.0.0.1:50052", help="drafter gRPC target (comma list or dns:/// for replicas)")
    parser.add_argument("--config", help="MindIE-style config.json")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    settings = load_mindie_config(args.config)
    config = GatewayConfig(
        verifier_target=args.verifier, drafter_target=args.drafter, **settings.gateway_overrides()
    )
    server, address = serve(config, args.addr)
    write_ready_file(args.ready_file, address)
    wait_for_termination(server)


if __name__ == "__main__":
    main()
