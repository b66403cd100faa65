"""Command-line flags of a drafter's config, shared by `python -m pardec.drafter` and a gateway that
drafts in its own process (`python -m pardec.gateway --drafter embedded`)."""

from __future__ import annotations

import argparse
import os

from pardec.drafter.config import DrafterConfig
from pardec.runtime.security import client_tls, read_secret

_DEFAULTS = {name: field.default for name, field in DrafterConfig.__dataclass_fields__.items()}


def add_drafter_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url", default=None,
        help="Redis URL (default: $REDIS_URL); redis+cluster://host:port[,host:port...] for a Redis Cluster",
    )  # fmt: skip
    parser.add_argument("--session-ttl-s", type=int, default=_DEFAULTS["session_ttl_s"])
    parser.add_argument(
        "--conversation-ttl-s", type=int, default=_DEFAULTS["conversation_ttl_s"],
        help="how long a conversation's earlier answers (multi-turn drafting memory) are kept",
    )  # fmt: skip
    parser.add_argument(
        "--shared-memory-contexts", type=int, default=_DEFAULTS["shared_memory_contexts"],
        help="most two-token contexts a shared cross-request drafting memory keeps",
    )  # fmt: skip
    parser.add_argument(
        "--redis-password-file", help="file holding the Redis AUTH password (default: $REDIS_PASSWORD, if set)"
    )
    parser.add_argument("--redis-tls-ca", help="PEM CA that the rediss:// server's certificate must chain to")
    parser.add_argument("--redis-tls-cert", help="PEM client certificate for Redis (tls-auth-clients)")
    parser.add_argument("--redis-tls-key", help="PEM key of --redis-tls-cert")


def drafter_config_from_flags(args: argparse.Namespace, **more) -> DrafterConfig:
    """The DrafterConfig the flags name; ``more`` sets other fields (the drafter's own TLS)."""
    return DrafterConfig(
        redis_url=args.redis_url or os.environ.get("REDIS_URL", ""),
        session_ttl_s=args.session_ttl_s,
        conversation_ttl_s=args.conversation_ttl_s,
        shared_memory_contexts=args.shared_memory_contexts,
        redis_password=read_secret(args.redis_password_file, "redis_password_file")
        if args.redis_password_file else os.environ.get("REDIS_PASSWORD"),
        redis_tls=client_tls(args.redis_tls_ca, args.redis_tls_cert, args.redis_tls_key),
        **more,
    )
