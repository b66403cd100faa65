"""python -m drafter: run one drafter replica (scale them freely; state lives in Redis)."""

from __future__ import annotations

import argparse
import os

from drafter.config import DrafterConfig
from drafter.service import DrafterServicer
from pardec.serving import configure_logging, start_server, wait_for_termination, write_ready_file


def main(argv=None) -> None:
    defaults_ttl = DrafterConfig.__dataclass_fields__["session_ttl_s"].default
    parser = argparse.ArgumentParser(prog="python -m drafter", description="pardec drafter")
    parser.add_argument("--addr", default="127.0.0.1:50052", help="listen address (port 0 = any free port)")
    parser.add_argument("--ready-file", help="write the bound address here once serving")
    parser.add_argument("--redis-url", default=None, help="Redis URL (default: $REDIS_URL)")
    parser.add_argument("--session-ttl-s", type=int, default=defaults_ttl)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    config = DrafterConfig(
        redis_url=args.redis_url or os.environ.get("REDIS_URL", ""), session_ttl_s=args.session_ttl_s
    )
    server, address = start_server([DrafterServicer(config).add_to], args.addr)
    write_ready_file(args.ready_file, address)
    wait_for_termination(server)


if __name__ == "__main__":
    main()
