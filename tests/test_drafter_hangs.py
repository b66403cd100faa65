"""A drafter that hangs, or a Redis that hangs under it, and a drafter that answers nonsense,
through real processes and sockets: every request still gets exactly plain decoding's tokens, a
hang costs it at most one propose timeout and never delays its reply, and once the drafter
answers again requests draft again."""

from __future__ import annotations

import doctest
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from pardec.drafter.redis_server import RedisServer
from pardec.gateway import drafter_health
from pardec.gateway.clients import DrafterClient
from pardec.gateway.config import GatewayConfig
from pardec.gateway.generation import Generator, Request
from pardec.gateway.metrics import GatewayMetrics
from pardec.gateway.replicas import VerifierReplicas
from pardec.gateway.server import start_gateway
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.prompts import CODE_PROMPTS

PROPOSE_TIMEOUT_S = 0.5
MAX_NEW_TOKENS = 64
# Room for a loaded 2-core machine on top of one propose timeout. Other work on the machine can
# stretch plain time itself by more than that, so the bound is on what drafting costs a request
# (its drafter calls) and on how long its reply waits after the last step (its ends).
SLACK_S = 2.5


def message(plain=False):
    mode = gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT
    return gateway_pb2.GenerateRequest(prompt=CODE_PROMPTS[1], max_new_tokens=MAX_NEW_TOKENS, decoding=mode)


@pytest.fixture(scope="module")
def hanging_stack(stack, tmp_path_factory):
    """A drafter replica in its own process on a Redis of its own, and a gateway in front of it
    and the shared verifier."""
    workdir = tmp_path_factory.mktemp("hang")
    redis_server = RedisServer(workdir / "r").start()
    ready = workdir / "drafter.addr"
    drafter = subprocess.Popen([
        sys.executable, "-m", "pardec.drafter", "--addr", "127.0.0.1:0", "--redis-url", redis_server.url,
        "--ready-file", str(ready), "--log-level", "ERROR",
    ])
    deadline = time.monotonic() + 60
    while not ready.exists() and drafter.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), f"drafter exited with {drafter.poll()}"
    config = GatewayConfig(
        verifier_target=stack.addresses["verifier"], drafter_target=ready.read_text().strip(),
        propose_timeout_s=PROPOSE_TIMEOUT_S,
    )
    running = start_gateway(config, "127.0.0.1:0")
    channel = grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS)
    yield gateway_pb2_grpc.GatewayStub(channel), drafter, redis_server
    channel.close()
    running.stop()
    for signal_ in (signal.SIGCONT, signal.SIGTERM):
        drafter.send_signal(signal_)
    drafter.wait(30)
    redis_server.stop()


def timed(stub, request):
    start = time.monotonic()
    reply = stub.Generate(request, timeout=300)
    return reply, time.monotonic() - start


@pytest.mark.parametrize("what", ["drafter", "redis"])
def test_a_hanging_drafter_costs_at_most_one_propose_timeout_and_no_token(hanging_stack, what):
    stub, drafter, redis_server = hanging_stack
    plain, plain_s = timed(stub, message(plain=True))
    drafted, _ = timed(stub, message())
    assert list(drafted.token_ids) == list(plain.token_ids) and drafted.stats.accepted_draft_tokens > 0
    pid = drafter.pid if what == "drafter" else redis_server.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        figures = []
        for _ in range(4):
            reply, took = timed(stub, message())
            assert list(reply.token_ids) == list(plain.token_ids)
            drafter_s, after_last_step_s = reply.stats.drafter_ms / 1e3, took - reply.stats.total_ms / 1e3
            figures.append((round(took, 2), round(drafter_s, 3), round(after_last_step_s, 3)))
            assert drafter_s < PROPOSE_TIMEOUT_S + SLACK_S and after_last_step_s < SLACK_S, figures
        print(f"{what} stopped: plain {plain_s:.2f}s; per request (total s, in drafter calls s, "
              f"reply after last step s): {figures}")
    finally:
        os.kill(pid, signal.SIGCONT)
    # The gateway's breaker lets requests ask again after a while; then they draft.
    deadline = time.monotonic() + drafter_health.BREAKER_OPEN_S + 60
    while True:
        time.sleep(drafter_health.BREAKER_OPEN_S / 2)
        again, _ = timed(stub, message())
        assert list(again.token_ids) == list(plain.token_ids)
        if again.stats.accepted_draft_tokens > 0:
            break
        assert time.monotonic() < deadline, "requests never drafted again"


def test_check_tree_examples():
    assert doctest.testmod(drafter_health).failed == 0


class CorruptingDrafter:
    """The real drafter client over the network, whose trees are corrupted on arrival."""

    def __init__(self, client: DrafterClient, corrupt):
        self._client, self._corrupt, self.corrupted = client, corrupt, 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    def propose(self, *args, **kwargs):
        tokens, parents, probabilities = self._client.propose(*args, **kwargs)
        if tokens:
            self.corrupted += 1
            return self._corrupt(tokens, parents, probabilities)
        return tokens, parents, probabilities


CORRUPTIONS = {
    "token_outside_vocabulary": lambda t, p, s: ([*t[:-1], 10**6], p, s),
    "parent_after_its_child": lambda t, p, s: (t, [len(t), *p[1:]], s),
    "fewer_parents_than_tokens": lambda t, p, s: (t + t[:1], p, s),
    "estimates_for_other_nodes": lambda t, p, s: (t, p, [*s, 0.5]),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_malformed_tree_from_the_drafter_becomes_a_plain_step(stack, corruption):
    config = GatewayConfig(verifier_target=stack.addresses["verifier"], drafter_target=stack.addresses["drafter"])
    verifier = VerifierReplicas.connect(config.verifier_target, config.rpc_timeout_s)
    drafter = CorruptingDrafter(DrafterClient(config.drafter_target, 10.0, 10.0), CORRUPTIONS[corruption])
    metrics = GatewayMetrics()
    generator = Generator(config, verifier, drafter, verifier.model_info(60), metrics)
    try:
        plain = generator.generate(Request(CODE_PROMPTS[1], max_new_tokens=48, plain=True))
        drafted = generator.generate(Request(CODE_PROMPTS[1], max_new_tokens=48))
    finally:
        drafter.close()
    assert drafted.token_ids == plain.token_ids
    assert drafter.corrupted >= 1 and drafted.stats.draft_tokens == 0
    assert metrics.fallbacks.labels("malformed")._value.get() >= 1
