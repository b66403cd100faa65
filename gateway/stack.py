"""`pardec up`: the whole stack as local processes — Redis, verifier, drafters, gateway.

Every service binds port 0 unless told otherwise and reports its bound address through a
ready file, so nothing guesses ports; children die with the supervisor (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pardec.drafter.redis_server import DEFAULT_MAXMEMORY, RedisServer
from pardec.gateway.mindie import MindieSettings
from pardec.runtime.errors import ConfigError
from pardec.runtime.guards import certificate_fingerprint
from pardec.runtime.security import ServerTLS

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# Runs in each child before the service (Redis included): asks the kernel to SIGTERM it when the
# supervisor dies, then becomes the program its arguments name. Doing this in the child's own
# interpreter, not in a preexec_fn, lets subprocess spawn without running Python between fork and
# exec -- a forked copy of a process whose gRPC threads are busy (the tests, a supervisor serving
# requests) can abort there.
# A supervisor that died before the request (between the fork and the prctl) is no longer the
# parent: the child ends there instead of outliving it. The kernel signals when the *thread* that
# spawned the child ends: start (and restart) services from a thread that lives as long as they do.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    f"ctypes.CDLL('libc.so.6', use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)
DYING_WITH_PARENT = (sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()))  # a command's prefix


class Stopped(RuntimeError):
    """The stack was asked to stop (a signal) before every service served."""


def config_flags(settings: MindieSettings) -> list[str]:
    """The verifier's flags of what config.json sets of it (--model, --served-model-name, ...)."""
    flags = []
    for name, value in settings.verifier_overrides().items():
        if value is not None:
            flags += ["--model" if name == "model_path" else "--" + name.replace("_", "-"), str(value)]
    return flags


def _server_flags(tls: ServerTLS | None) -> list[str]:
    if tls is None:
        return []
    flags = ["--tls-cert", tls.cert_file, "--tls-key", tls.key_file]
    return flags + (["--tls-client-ca", tls.client_ca_file] if tls.mutual else [])


def verifier_threads(verifiers: int, cpus: int) -> int:
    """Threads per verifier when several share this machine's CPUs (0: one verifier, torch's
    default). Each verifier's OpenMP team spins at its barriers; two teams of 2 threads on 2 CPUs
    spun against each other's descheduled threads, and two verifiers loading together took over
    600 s (13 s alone). A share of the CPUs each keeps every team on cores of its own.

    >>> verifier_threads(1, 16), verifier_threads(2, 2), verifier_threads(3, 16), verifier_threads(4, 2)
    (0, 1, 5, 1)
    """
    return 0 if verifiers == 1 else max(1, cpus // verifiers)


class Stack:
    def __init__(
        self,
        workdir: Path,
        settings: MindieSettings,
        gateway_addr: str = "127.0.0.1:50051",
        drafters: int = 1,
        verifiers: int = 1,
        redis_url: str | None = None,
        config_path: str | None = None,
        start_timeout_s: float = 600.0,
        metrics_addr: str | None = None,
        log_level: str = "INFO",
        tls: ServerTLS | None = None,
        internal_tls: ServerTLS | None = None,
        tokens_file: str | None = None,
        shared_memory: bool = False,
        device: str = "cpu",
        gateway_limits: tuple[int, int] | None = None,
        redis_maxmemory: str = DEFAULT_MAXMEMORY,
        verifier_flags: tuple[str, ...] = (),
        http_addr: str | None = None,
        gateway_flags: tuple[str, ...] = (),
    ):
        """``tls``: the gateway's public port. ``internal_tls``: mutual TLS between the gateway
        and the verifier and drafters, one certificate for all three (it must carry 127.0.0.1
        as a subject alternative name and, if it has extended key usage, both serverAuth and
        clientAuth), chained to ``client_ca_file``. ``tokens_file``: the gateway's bearer tokens.
        ``shared_memory``: the gateway drafts also from earlier requests' outputs. ``drafters``
        0: the gateway drafts in its own process, on the same Redis. ``device``: where every verifier
        replica runs its model (cpu, cuda[:N], npu[:N]). With ``internal_tls`` the verifiers and
        drafters accept only that certificate (--allowed-clients by its fingerprint): a tenant's client
        certificate from the same CA is refused. ``gateway_limits``: the gateway's
        (--max-concurrent-rpcs, --max-message-bytes); ``redis_maxmemory``: the bound of the Redis
        it starts. ``verifier_flags``: more flags for every verifier (python -m pardec.verifier),
        ``gateway_flags`` for the gateway (python -m pardec.gateway).
        ``http_addr``: the gateway's OpenAI-compatible HTTP front (None: off)."""
        if drafters < 0:
            raise ConfigError(f"drafters: must be >= 0 (0 = drafting in the gateway), got {drafters}")
        if verifiers < 1:
            raise ConfigError(f"verifiers: must be >= 1, got {verifiers}")
        if internal_tls is not None and not internal_tls.mutual:
            raise ValueError("internal_tls: needs a CA (client_ca_file): internal hops use mutual TLS")
        self.workdir = Path(workdir)
        self.settings = settings
        self.gateway_addr = gateway_addr
        self.drafters = drafters
        self.verifiers = verifiers
        self.redis_url = redis_url
        self.config_path = config_path
        self.start_timeout_s = start_timeout_s
        self.metrics_addr = metrics_addr
        self.log_level = log_level
        self.tls = tls
        self.internal_tls = internal_tls
        self.tokens_file = tokens_file
        self.shared_memory = shared_memory
        self.device = device
        self.gateway_limits = gateway_limits
        self.redis_maxmemory = redis_maxmemory
        self.verifier_flags = tuple(verifier_flags)
        self.gateway_flags = tuple(gateway_flags)
        self.http_addr = http_addr
        self._redis: RedisServer | None = None
        self._stop_asked: threading.Event | None = None
        self._processes: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}

    def start(self, stop: threading.Event | None = None) -> "Stack":
        """Starts every service and waits for each to serve; ``stop`` set meanwhile (a signal) stops
        what started and raises Stopped."""
        self._stop_asked = stop
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            if self.redis_url is None:
                self._redis = RedisServer(self.workdir / "redis", maxmemory=self.redis_maxmemory,
                                          launcher=DYING_WITH_PARENT).start()
                self.redis_url = self._redis.url
            internal = _server_flags(self.internal_tls)
            if self.internal_tls is not None:
                # One certificate serves every internal hop: the gateway (and any drafter) calls
                # with it, so it is the one identity the verifiers and drafters take.
                internal += ["--allowed-clients", certificate_fingerprint(self.internal_tls.cert_file)]
            verifier_flags = ["--addr", "127.0.0.1:0", "--device", self.device, *internal]
            verifier_flags += config_flags(self.settings)
            threads = verifier_threads(self.verifiers, len(os.sched_getaffinity(0)))
            if threads:
                verifier_flags += ["--threads", str(threads)]
            verifier_flags += self.verifier_flags
            for name in self.verifier_names:
                self._spawn(name, verifier_flags, module="verifier")
            for index in range(self.drafters):
                self._spawn(
                    f"drafter-{index}", ["--addr", "127.0.0.1:0", "--redis-url", self.redis_url, *internal],
                    module="drafter",
                )
            self._wait_ready([n for n in self._processes])
            if self.drafters:
                drafting = ["--drafter", "ipv4:" + ",".join(self.addresses[f"drafter-{i}"] for i in range(self.drafters))]
            else:
                drafting = ["--drafter", "embedded", "--redis-url", self.redis_url]
            gateway_flags = [
                "--addr", self.gateway_addr,
                "--verifier", ",".join(self.addresses[name] for name in self.verifier_names),
                *drafting,
            ]
            gateway_flags += _server_flags(self.tls)
            if self.internal_tls is not None:
                gateway_flags += [
                    "--backend-tls-ca", self.internal_tls.client_ca_file,
                    "--backend-tls-cert", self.internal_tls.cert_file,
                    "--backend-tls-key", self.internal_tls.key_file,
                ]
            if self.tokens_file:
                gateway_flags += ["--tokens-file", self.tokens_file]
            if self.shared_memory:
                gateway_flags.append("--shared-memory")
            if self.gateway_limits is not None:
                gateway_flags += ["--max-concurrent-rpcs", str(self.gateway_limits[0]),
                                  "--max-message-bytes", str(self.gateway_limits[1])]
            if self.config_path:
                gateway_flags += ["--config", self.config_path]
            if self.metrics_addr:
                gateway_flags += [
                    "--metrics-addr", self.metrics_addr,
                    "--metrics-ready-file", str(self.workdir / "gateway-metrics.addr"),
                ]
            if self.http_addr is not None:
                gateway_flags += ["--http-addr", self.http_addr, "--http-ready-file", str(self.workdir / "gateway-http.addr")]
            self._spawn("gateway", [*gateway_flags, *self.gateway_flags])
            self._wait_ready(["gateway"])
            # The gateway writes these before its gRPC address, so they are there now.
            for extra, wanted in (("gateway-metrics", self.metrics_addr), ("gateway-http", self.http_addr)):
                if wanted is not None:
                    self.addresses[extra] = (self.workdir / f"{extra}.addr").read_text().strip()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def verifier_names(self) -> list[str]:
        """"verifier", then "verifier-1", "verifier-2", ... for extra replicas."""
        return ["verifier"] + [f"verifier-{index}" for index in range(1, self.verifiers)]

    @property
    def gateway_address(self) -> str:
        return self.addresses["gateway"]

    @property
    def http_address(self) -> str | None:
        """HOST:PORT of the OpenAI-compatible HTTP front, None when it is off."""
        return self.addresses.get("gateway-http")

    def process(self, name: str) -> subprocess.Popen:
        """A running service by name ("verifier", "verifier-1", ..., "drafter-0", ..., "gateway"),
        for operators' scripts and fault tests."""
        return self._processes[name]

    def pids(self) -> dict[str, int]:
        """Process id of every running service, and of Redis when the stack started it."""
        pids = {name: process.pid for name, process in self._processes.items() if process.poll() is None}
        if self._redis is not None and self._redis.pid is not None:
            pids["redis"] = self._redis.pid
        return pids

    @property
    def redis(self) -> RedisServer | None:
        """The Redis server the stack started itself (None when it was given REDIS_URL)."""
        return self._redis

    def _spawn(self, name: str, flags: list[str], module: str | None = None) -> None:
        ready = self.workdir / f"{name}.addr"
        ready.unlink(missing_ok=True)
        command = [
            sys.executable, "-m", f"pardec.{module or name}", *flags, "--ready-file", str(ready), "--log-level", self.log_level
        ]
        self._processes[name] = subprocess.Popen([*DYING_WITH_PARENT, *command])

    def _wait_ready(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pending = set(names)
        while pending:
            for name in sorted(pending):
                ready = self.workdir / f"{name}.addr"
                if ready.exists():
                    self.addresses[name] = ready.read_text().strip()
                    pending.discard(name)
                    log.info("%s serving on %s", name, self.addresses[name])
                elif self._processes[name].poll() is not None:
                    raise RuntimeError(f"{name} exited with code {self._processes[name].returncode} before serving")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {self.start_timeout_s:.0f}s: {sorted(pending)}")
            if self._stop_asked is not None and self._stop_asked.is_set():
                raise Stopped(f"asked to stop while {', '.join(sorted(pending))} started")
            time.sleep(0.05)

    def wait(self, stop: threading.Event) -> bool:
        """Returns when ``stop`` is set (False) or any service exits on its own (True)."""
        while not stop.wait(0.5):
            for name, process in self._processes.items():
                if process.poll() is not None:
                    log.error("%s exited with code %s; stopping the stack", name, process.returncode)
                    return True
        return False

    def stop(self, grace_s: float = 15.0) -> None:
        """Gateway first (it finishes in-flight requests), then the rest, then Redis."""
        order = sorted(self._processes, key=lambda n: n != "gateway")
        for name in order:
            process = self._processes[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._processes.clear()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
