"""The drafter's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pardec.drafter.encoding import MAX_CONTEXTS, MAX_TTL_S
from pardec.drafter.redis_cluster import is_cluster_url, parse_cluster_url
from pardec.runtime.errors import ConfigError
from pardec.runtime.security import ClientTLS, ServerTLS


@dataclass(frozen=True)
class DrafterConfig:
    # Where every session's state lives, e.g. redis://host:6379/0, rediss://host:6380/0 (TLS),
    # unix:///path/redis.sock, or a Redis Cluster: redis+cluster://host:port[,host:port...]
    # (rediss+cluster:// with TLS; drafter/redis_cluster.py).
    redis_url: str
    # A session's keys expire this long after its last call (clients that vanish).
    session_ttl_s: int = 600
    # Longest n-gram continuation stored in the trie (PIA's branch_length).
    branch_length: int = 12
    # Redis key prefix; keys are hash-tagged per session for Redis Cluster.
    key_prefix: str = "pardec"
    # A conversation's earlier answers (multi-turn memory) expire this long after the last one.
    conversation_ttl_s: int = 3600
    # Most two-token contexts a shared cross-request memory keeps (~0.3 KB each).
    shared_memory_contexts: int = 100_000
    # Redis AUTH password (requirepass); None: the URL's own, if any. Never printed.
    redis_password: str | None = field(default=None, repr=False)
    # TLS to Redis (a rediss:// URL): the CA to check it by (None: the system's roots) and a
    # client certificate when Redis asks for one (tls-auth-clients).
    redis_tls: ClientTLS | None = None
    # TLS of the drafter's own port (None: plaintext); with a client CA, mutual TLS.
    tls: ServerTLS | None = None
    # A drafter replica's bound on connecting to Redis and on each reply: a paused or unreachable
    # Redis fails the call UNAVAILABLE (the gateway then decodes plain) instead of holding the
    # replica's thread for as long as Redis stays stuck.
    redis_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ConfigError("redis_url: must be set (e.g. redis://127.0.0.1:6379/0)")
        if is_cluster_url(self.redis_url):
            try:
                url_password = parse_cluster_url(self.redis_url).password
            except ValueError as error:
                raise ConfigError(f"redis_url: {error}") from None
        else:
            url_password = urlsplit(self.redis_url).password
        if self.redis_tls is not None and not self.redis_url.startswith(("rediss://", "rediss+cluster://")):
            raise ConfigError(
                f"redis_tls: needs a rediss:// or rediss+cluster:// URL, got {self.redis_url.split('://')[0]}://"
            )
        if self.redis_password is not None and url_password is not None:
            raise ConfigError("redis_password: the URL carries a password too; give it once")
        for name, value, most in (("session_ttl_s", self.session_ttl_s, MAX_TTL_S),
                                  ("conversation_ttl_s", self.conversation_ttl_s, MAX_TTL_S),
                                  ("shared_memory_contexts", self.shared_memory_contexts, MAX_CONTEXTS)):
            if not 1 <= value <= most:
                raise ConfigError(f"{name}: must be in [1, {most}], got {value}")
        if not self.redis_timeout_s > 0:
            raise ConfigError(f"redis_timeout_s: must be > 0, got {self.redis_timeout_s}")
        if not 1 <= self.branch_length <= 64:
            raise ConfigError(f"branch_length: must be in [1, 64], got {self.branch_length}")
