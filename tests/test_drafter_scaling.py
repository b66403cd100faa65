"""Drafter replicas added at run time take a fair share of the gateway's Propose calls within
seconds, and replicas removed cost no request anything: the output stays plain decoding's.

Real drafter processes listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 (one port) behind one DNS
name, which a DNS server of the test's own serves (tests/dns_names.py) and changes as replicas come
and go, as a cluster's DNS follows a headless Service's ready pods. The in-process gateway reaches
them through its ordinary DrafterClient on ``dns://<that server>/<name>:<port>``: gRPC's own
resolver and round robin, re-resolving when a drafter closes a connection past its age
(--max-connection-age-s), the mechanism a gateway in Kubernetes uses."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pardec.gateway.config import GatewayConfig, LoadPolicy
from pardec.gateway.server import start_gateway
from pardec.runtime.serving import CHANNEL_OPTIONS, start_server
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from pardec.verifier.service import VerifierServicer
from tests.dns_names import DnsNames
from tests.prompts import CODE_PROMPTS

NAME = "drafters.pardec.test"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
# Short, so that the test sees re-resolution within its run; deployments keep the drafter's default.
AGE_S = 2.0
MAX_NEW_TOKENS = 40
STREAMS = 2


def loopback_aliases_bind() -> bool:
    """127.0.0.2 and up are loopback on Linux; elsewhere (macOS) only 127.0.0.1 is, untold."""
    with socket.socket() as probe:
        try:
            probe.bind((HOSTS[1], 0))
        except OSError:
            return False
    return True


pytestmark = pytest.mark.skipif(not loopback_aliases_bind(), reason="127.0.0.2 is not a loopback address here")


class Replica:
    """One `python -m pardec.drafter` process on ``host:port``, its metrics on their own port."""

    def __init__(self, host: str, port: int, redis_url: str, workdir: Path):
        self.host = host
        ready, metrics = workdir / f"{host}.addr", workdir / f"{host}.metrics"
        self.process = subprocess.Popen([
            sys.executable, "-m", "pardec.drafter", "--addr", f"{host}:{port}", "--redis-url", redis_url,
            "--max-connection-age-s", str(AGE_S), "--ready-file", str(ready),
            "--metrics-addr", "127.0.0.1:0", "--metrics-ready-file", str(metrics), "--log-level", "WARNING",
        ])  # fmt: skip
        deadline = time.monotonic() + 60
        while not (ready.exists() and metrics.exists()):
            assert self.process.poll() is None, f"drafter on {host} exited with {self.process.returncode}"
            assert time.monotonic() < deadline, f"drafter on {host} not serving"
            time.sleep(0.05)
        self.port = int(ready.read_text().strip().rsplit(":", 1)[1])
        self._metrics = metrics.read_text().strip()

    def proposes(self) -> int:
        """Propose calls this replica answered (its pardec_drafter_requests_total)."""
        with urllib.request.urlopen(f"http://{self._metrics}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return int(sum(
            sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "pardec_drafter_requests_total" and sample.labels.get("method") == "Propose"
        ))  # fmt: skip

    def stop(self, how: signal.Signals) -> None:
        self.process.send_signal(how)
        self.process.wait(30)


class Load:
    """``STREAMS`` clients streaming drafted generations of the code prompts, one after another,
    until stopped; every outcome is kept, failures included."""

    def __init__(self, gateway_address: str):
        self._channel = grpc.insecure_channel(gateway_address, options=CHANNEL_OPTIONS)
        self.stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self.outcomes: list[tuple[int, list[int] | BaseException, int]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(STREAMS)]

    def start(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        self._channel.close()

    def _run(self, first: int) -> None:
        index = first
        while not self._stop.is_set():
            prompt = index % len(CODE_PROMPTS)
            tokens, accepted = [], 0
            try:
                for chunk in self.stub.GenerateStream(request(prompt), timeout=120):
                    tokens.extend(chunk.token_ids)
                    if chunk.HasField("stats"):
                        accepted = chunk.stats.accepted_draft_tokens
                self.outcomes.append((prompt, tokens, accepted))
            except grpc.RpcError as error:
                self.outcomes.append((prompt, error, 0))
            index += 1


def request(prompt: int, plain: bool = False) -> gateway_pb2.GenerateRequest:
    mode = gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT
    return gateway_pb2.GenerateRequest(prompt=CODE_PROMPTS[prompt], max_new_tokens=MAX_NEW_TOKENS, decoding=mode)


@pytest.fixture(scope="module")
def verifier_address(engine):
    server, address = start_server([VerifierServicer(engine).add_to], "127.0.0.1:0")
    yield address
    server.stop(None)


class Fleet:
    """Drafter replicas behind one name, a gateway resolving it, and plain decoding's outputs."""

    def __init__(self, hosts: tuple[str, ...], verifier_address: str, redis_url: str, workdir: Path):
        self._redis_url, self._workdir = redis_url, workdir
        self.replicas: dict[str, Replica] = {}
        first = Replica(hosts[0], 0, redis_url, workdir)
        self.port = first.port
        self.replicas[first.host] = first
        for host in hosts[1:]:
            self.replicas[host] = Replica(host, self.port, redis_url, workdir)
        self.names = DnsNames(NAME, list(self.replicas))
        # The drafter asked at every step, the governor off: on a busy CPU the cost model finds
        # drafting not worth asking for, and then too few calls reach the drafters to count.
        config = GatewayConfig(
            verifier_target=verifier_address, drafter_target=self.names.target(self.port),
            load_policy=LoadPolicy(govern_from=0, probe_every=1, always_ask_below=0.99),
        )
        self.gateway = start_gateway(config, "127.0.0.1:0")
        self.load = Load(self.gateway.address)
        self.plain = {
            p: list(self.load.stub.Generate(request(p, plain=True), timeout=120).token_ids)
            for p in range(len(CODE_PROMPTS))
        }

    def add(self, hosts: tuple[str, ...]) -> None:
        """Ready replicas first, then their addresses in DNS: a pod is listed once ready."""
        for host in hosts:
            self.replicas[host] = Replica(host, self.port, self._redis_url, self._workdir)
        self.names.set(list(self.replicas))

    def remove(self, host: str, how: signal.Signals) -> None:
        """Out of DNS and signalled at once, as Kubernetes ends a pod while its endpoint goes."""
        replica = self.replicas.pop(host)
        self.names.set(list(self.replicas))
        replica.stop(how)

    def counts(self) -> dict[str, int]:
        return {host: replica.proposes() for host, replica in self.replicas.items()}

    def fallbacks(self) -> float:
        registry = self.gateway.generator.metrics.registry
        return registry.get_sample_value("pardec_drafter_fallbacks_total", {"reason": "propose"}) or 0.0

    def check_outcomes(self) -> None:
        """Every request finished, with exactly plain decoding's tokens."""
        assert self.load.outcomes
        for prompt, tokens, _ in self.load.outcomes:
            assert not isinstance(tokens, BaseException), f"a request failed: {tokens}"
            assert tokens == self.plain[prompt]

    def close(self) -> None:
        self.load.stop()
        self.gateway.stop()
        self.names.close()
        for replica in self.replicas.values():
            replica.process.kill()
            replica.process.wait(30)


@pytest.fixture
def fleet(verifier_address, redis_server, tmp_path):
    fleets: list[Fleet] = []

    def make(hosts: tuple[str, ...]) -> Fleet:
        fleets.append(Fleet(hosts, verifier_address, redis_server.url, tmp_path))
        return fleets[-1]

    yield make
    for started in fleets:
        started.close()


def wait_until(condition, timeout_s: float) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not met in time"
        time.sleep(0.1)
    return time.monotonic() - started


def test_replicas_added_at_run_time_take_a_fair_share_of_propose_calls_within_seconds(fleet):
    fleet = fleet(HOSTS[:1])
    fleet.load.start()
    wait_until(lambda: fleet.counts()[HOSTS[0]] > 0, 60)
    fleet.add(HOSTS[1:])
    # Each connection of the gateway closes within an age (plus gRPC's jitter of a tenth), the
    # gateway resolves the name again and connects to every address it now lists.
    joined_s = wait_until(lambda: all(count > 0 for count in fleet.counts().values()), 30)
    before = fleet.counts()
    started = time.monotonic()
    # Over connections closing and reopening (two ages), and enough calls to judge a share
    # however busy the CPU is.
    wait_until(
        lambda: time.monotonic() - started >= 2 * AGE_S and sum(fleet.counts().values()) - sum(before.values()) >= 60,
        120,
    )
    after = fleet.counts()
    share = {host: after[host] - before[host] for host in after}
    total = sum(share.values())
    print(f"all three answering {joined_s:.1f}s after the two were added; the next {total} Propose calls "
          f"(in {time.monotonic() - started:.1f}s): {share}")
    for host, calls in share.items():
        assert calls >= total / 3 / 2, f"{host} took {calls} of {total} Propose calls"
    fleet.load.stop()
    fleet.check_outcomes()


def test_replicas_removed_mid_stream_cost_no_request_anything(fleet):
    fleet = fleet(HOSTS)
    fleet.load.start()
    wait_until(lambda: all(count > 0 for count in fleet.counts().values()), 3 * AGE_S + 30)
    # Scale-down: SIGTERM drains the replica (GOAWAY, calls in flight finish).
    fallbacks = fleet.fallbacks()
    fleet.remove(HOSTS[1], signal.SIGTERM)
    drained = fleet.counts()
    time.sleep(2 * AGE_S)
    scaled_down_fallbacks = fleet.fallbacks() - fallbacks
    assert all(fleet.counts()[host] > drained[host] for host in fleet.replicas), "the survivors stopped drafting"
    # A crash: the replica's calls in flight fail, and the gateway decodes those steps plain.
    fleet.remove(HOSTS[2], signal.SIGKILL)
    crashed, finished = fleet.counts(), len(fleet.load.outcomes)
    wait_until(lambda: len(fleet.load.outcomes) > finished + STREAMS, 120)
    assert fleet.counts()[HOSTS[0]] > crashed[HOSTS[0]], "the survivor stopped drafting"
    fleet.load.stop()
    print(f"{len(fleet.load.outcomes)} requests; steps decoded plain for a failed Propose: "
          f"{scaled_down_fallbacks:.0f} at the scale-down, {fleet.fallbacks() - fallbacks:.0f} in all")
    fleet.check_outcomes()
