"""Redis Cluster as the drafting state's store, chosen by URL.

    redis+cluster://[[user]:password@]host:port[,host:port...][/]     plaintext
    rediss+cluster://[[user]:password@]host:port[,host:port...][/]    TLS

The hosts are seeds: the client learns every master and replica from whichever answers first,
so one reachable seed is enough. Cluster mode has no databases (the path may only be / or /0).

Every script call touches keys of one hash slot: a session's keys share the tag
`{<session>}`, a conversation's `{conversation:<id>}`, a shared memory's `{shared:<name>}`
(drafter/encoding.py hash_tag), and a call that needs two of them makes two calls. So sessions
spread over the masters by their ids, and losing a master loses only its sessions' drafting.

Failures cost drafting only, as a single Redis down does: the call fails UNAVAILABLE at once
(drafter/core.py) and the gateway runs plain steps and asks again later. Inside a call the
client retries once, without sleeping, after refreshing its map of the cluster, so the first call
after a replica's promotion reaches the new master; longer retries would hold a step that has a
budget of its own (the gateway's propose timeout).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from pardec.runtime.security import ClientTLS

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
DEFAULT_PORT = 6379
# Retries inside one call, each after the client refreshed its map of the slots' masters.
RETRIES_IN_CALL = 1

# What a cluster answers while a master fails over or slots move: worth another try later.
TRANSIENT_ERRORS = (
    redis.exceptions.ClusterError,  # CLUSTERDOWN, MASTERDOWN, "TTL exhausted" (a MOVED/ASK storm)
    redis.exceptions.TryAgainError,
    redis.exceptions.AskError,  # MOVED too
    redis.exceptions.ReadOnlyError,
    redis.exceptions.RedisClusterException,  # no seed reachable, slot not covered
)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


@dataclass(frozen=True)
class ClusterURL:
    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    tls: bool


def parse_cluster_url(url: str) -> ClusterURL:
    """The seeds and credentials of a redis+cluster:// or rediss+cluster:// URL; ValueError
    names what is wrong."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"a cluster URL starts redis+cluster:// or rediss+cluster://, got {scheme}://")
    parts = urlsplit(f"cluster://{rest}")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"Redis Cluster has no databases: the path may only be / or /0, got {parts.path!r}")
    if parts.query or parts.fragment:
        raise ValueError("a cluster URL takes no query or fragment: give options as flags")
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, password = None, None
    if credentials:
        user, has_password, secret = credentials.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    nodes = tuple(_node(seed) for seed in hosts.split(","))
    return ClusterURL(nodes, username, password, CLUSTER_SCHEMES[scheme.lower()])


def _node(seed: str) -> tuple[str, int]:
    if seed.startswith("["):  # [IPv6]:port
        host, _, port = seed[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = seed.partition(":")
    if not host:
        raise ValueError(f"cluster seed {seed!r}: needs a host (host:port[,host:port...])")
    try:
        number = int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"cluster seed {seed!r}: the port must be a number") from None
    if not 0 < number < 65536:
        raise ValueError(f"cluster seed {seed!r}: port {number} is outside 1..65535")
    return host, number


class LazyCluster:
    """A RedisCluster made at its first use, and made again at the next use if that failed.

    RedisCluster asks a seed for the cluster's map as it is built: built at once, a drafter or a
    gateway started while the cluster is unreachable would not start at all, where on a single
    Redis it starts and decodes plain until Redis is back. Scripts registered here run on
    whichever client is current (redis-py's Script calls evalsha and script_load on it)."""

    def __init__(self, url: ClusterURL, password: str | None, tls: ClientTLS | None, timeout_s: float | None):
        self._seeds = [ClusterNode(host, port) for host, port in url.nodes]
        self._options: dict = {
            "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
            "require_full_coverage": False,  # a master down costs its own slots, not the others'
            "retry": Retry(NoBackoff(), RETRIES_IN_CALL),
        }
        if url.username is not None:
            self._options["username"] = url.username
        if password is not None or url.password is not None:
            self._options["password"] = password if password is not None else url.password
        if url.tls:
            self._options["ssl"] = True
        if tls is not None:
            self._options.update(ssl_ca_certs=tls.ca_file, ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file)
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()
        self._encoder = redis.connection.Encoder("utf-8", "strict", False)

    def client(self) -> RedisCluster:
        with self._lock:
            if self._client is None:
                self._client = RedisCluster(startup_nodes=list(self._seeds), **self._options)
            return self._client

    def get_encoder(self):
        return self._encoder

    def register_script(self, script: str) -> redis.commands.core.Script:
        return redis.commands.core.Script(self, script)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __getattr__(self, name: str):
        return getattr(self.client(), name)


def connect_cluster(
    url: str, password: str | None = None, tls: ClientTLS | None = None, timeout_s: float | None = None
) -> LazyCluster:
    return LazyCluster(parse_cluster_url(url), password, tls, timeout_s)
