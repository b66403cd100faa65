"""python -m drafter: run one drafter replica (scale them freely; state lives in Redis)."""

from __future__ import annotations

import argparse
import os

from drafter.config import DrafterConfig
from drafter.service import DrafterServicer
from pardec.serving import configure_logging, start_server, wait_for_termination, write_ready_file


def main(argv=None) -> None:
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
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    config = DrafterConfig(
        redis_url=args.redis_url or os.environ.get("REDIS_URL", ""),
        session_ttl_s=args.session_ttl_s,
        conversation_ttl_s=args.conversation_ttl_s,
        shared_memory_contexts=args.shared_memory_contexts,
    )
    server, address = start_server([DrafterServicer(config).add_to], args.addr)
    write_ready_file(args.ready_file, address)
    wait_for_termination(server)


if __name__ == "__main__":
    main()
