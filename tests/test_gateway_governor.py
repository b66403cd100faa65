"""The gateway's load governor (gateway/governor.py): pure logic, fed literal step timings."""

from __future__ import annotations

import doctest
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

import pardec.gateway.governor
from pardec.gateway.config import GatewayConfig, LoadPolicy
from pardec.gateway.governor import Governor, band_of
from pardec.gateway.server import start_gateway
from pardec.runtime.serving import CHANNEL_OPTIONS
from pardec.v1 import gateway_pb2, gateway_pb2_grpc


def test_docstring_examples():
    failures, tried = doctest.testmod(pardec.gateway.governor)
    assert tried > 0 and failures == 0


def run_epoch(governor: Governor, in_flight: int, seconds_per_token: dict[bool, float], tokens: int = 1) -> bool:
    """Feeds one whole epoch (warm-up round included) of steps at the given cost; returns the arm."""
    drafting = governor.drafting(in_flight)
    steps = in_flight + max(16, 6 * in_flight)
    for _ in range(steps):
        governor.record(in_flight, drafting, tokens, tokens * seconds_per_token[drafting] * in_flight)
    return drafting


def arms(governor: Governor, in_flight: int, draft_rate: float, plain_rate: float, epochs: int) -> str:
    cost = {True: 1 / draft_rate, False: 1 / plain_rate}
    return "".join("D" if run_epoch(governor, in_flight, cost) else "p" for _ in range(epochs))


def new_governor(**overrides) -> Governor:
    return Governor(**{"govern_from": 2, "epoch_rounds": 6, "explore_every": 8, "margin": 1.03, **overrides})


def test_drafting_that_costs_throughput_is_switched_off_and_still_tried_now_and_then():
    governor = new_governor()
    # Two epochs of each arm first, then plain, with one drafting epoch in eight.
    assert arms(governor, 16, draft_rate=90.0, plain_rate=100.0, epochs=20) == "DpDp" + "pppppppD" * 2


def test_drafting_that_pays_stays_on():
    governor = new_governor()
    assert arms(governor, 4, draft_rate=120.0, plain_rate=100.0, epochs=13) == "DpDpDDDDDDDpD"


def test_a_change_of_regime_is_followed():
    """Drafting loses at first, then the workload turns to copying: the exploring epochs see
    it and drafting is back on within a few of them."""
    governor = new_governor(explore_every=4, history=4)
    arms(governor, 16, draft_rate=90.0, plain_rate=100.0, epochs=12)
    later = arms(governor, 16, draft_rate=150.0, plain_rate=100.0, epochs=16)
    assert later.endswith("DDDpDDDp"), later  # drafting again, plain tried one epoch in four


def run_epoch_at(governor: Governor, in_flight: int, rates: dict[bool, float], tokens: dict[bool, int]) -> str:
    """One whole epoch where each arm runs at its rate (tokens/s) committing its tokens per step."""
    drafting = governor.drafting(in_flight)
    for _ in range(in_flight + max(16, 6 * in_flight)):
        governor.record(in_flight, drafting, tokens[drafting], tokens[drafting] * in_flight / rates[drafting])
    return "D" if drafting else "p"


def test_when_drafts_stop_being_accepted_drafting_stops_at_the_first_epoch_that_shows_it():
    """Drafting paid 1.3x at 2 tokens per step (code edits). Then the prompts turn to chat,
    drafts are no longer accepted and drafting costs 15%: the first drafting epoch on chat
    switches to plain, read at its 1 token per step, without waiting for exploring epochs to
    outvote the eight samples taken on code."""
    governor = new_governor()
    code = "".join(run_epoch_at(governor, 4, {True: 130.0, False: 100.0}, {True: 2, False: 1}) for _ in range(20))
    assert code.endswith("DDDDDDDp")
    chat = "".join(run_epoch_at(governor, 4, {True: 85.0, False: 100.0}, {True: 1, False: 1}) for _ in range(10))
    # Before: "DDDDDDDpDDDDDDDpD" and only then plain.
    assert chat == "DppppppDpp", chat


def test_an_epoch_lasts_at_least_min_epoch_s_of_the_gateways_time():
    """Epochs of 6 rounds would be 28 steps at 4 in flight; steps of 0.04 s of a session's time
    (0.01 s of the gateway's) need 100 counted steps for 1 s."""
    epochs = []
    governor = new_governor(min_epoch_s=1.0, on_epoch=lambda *epoch: epochs.append(epoch))
    for _ in range(4 + 99):
        governor.record(4, True, 1, 0.04)
    assert epochs == []
    governor.record(4, True, 1, 0.04)
    assert len(epochs) == 1


def test_each_load_band_learns_on_its_own():
    governor = new_governor()
    for _ in range(12):
        arms(governor, 4, draft_rate=120.0, plain_rate=100.0, epochs=1)
        arms(governor, 20, draft_rate=90.0, plain_rate=100.0, epochs=1)
    assert governor.drafting(5) and not governor.drafting(31)
    assert band_of(5) == "4-7" and band_of(31) == "16-31"


def test_below_govern_from_sessions_always_may_draft():
    governor = new_governor(govern_from=8)
    assert arms(governor, 4, draft_rate=50.0, plain_rate=100.0, epochs=10) == "D" * 10
    off = new_governor(govern_from=0)
    assert arms(off, 32, draft_rate=50.0, plain_rate=100.0, epochs=10) == "D" * 10


def test_the_warm_up_round_and_steps_begun_under_the_other_arm_are_not_counted():
    epochs = []
    governor = new_governor(on_epoch=lambda band, arm, rate, gain, following: epochs.append((band, arm, rate)))
    drafting = governor.drafting(4)
    for _ in range(4):  # the warm-up round: slow, as forwards still carry the other arm's trees
        governor.record(4, drafting, 1, 10.0)
    for _ in range(8):  # began under the other arm: ignored entirely
        governor.record(4, not drafting, 1, 0.001)
    for _ in range(24):  # 24 steps of 1 token, each 0.4 s of a session's time with 4 in flight
        governor.record(4, drafting, 1, 0.4)
    assert epochs == [("4-7", True, pytest.approx(10.0))]  # 24 tokens over 24 * 0.4 / 4 s


def test_throughput_counts_tokens_per_second_of_the_gateway_not_of_a_session():
    """Three 1-token steps of 0.3 s each with 3 in flight are 10 tokens/s; one 2-token step of
    0.3 s with 3 in flight is 20."""
    seen = []
    governor = new_governor(on_epoch=lambda band, arm, rate, gain, following: seen.append(rate))
    run_epoch(governor, 3, {True: 0.1, False: 0.1})
    run_epoch(governor, 3, {True: 0.1, False: 0.1}, tokens=2)
    assert seen == [pytest.approx(10.0), pytest.approx(10.0)]  # 0.1 s per token per session either way


def test_the_machine_drifting_between_epochs_is_not_taken_for_a_gain():
    """The machine slows down by 5% per epoch while drafting costs 4%: rates taken minutes
    apart would favour whichever arm ran first, adjacent epochs do not."""
    gains = []
    governor = new_governor(on_epoch=lambda band, arm, rate, gain, following: gains.append(gain))
    speed, chosen = 100.0, ""
    for _ in range(30):
        chosen += "D" if run_epoch(governor, 16, {True: 1 / (0.96 * speed), False: 1 / speed}) else "p"
        speed *= 0.95
    assert chosen.startswith("DpDp") and chosen[4:].count("D") <= 4, chosen
    assert 0.9 < gains[-1] < 1.0


def test_a_gain_inside_the_margin_leaves_drafting_off():
    governor = new_governor(margin=1.05)
    assert arms(governor, 16, draft_rate=103.0, plain_rate=100.0, epochs=12) == "DpDp" + "pppppppD"
    assert arms(governor, 8, draft_rate=110.0, plain_rate=100.0, epochs=12) == "DpDp" + "DDDDDDDp"


def test_through_the_stack_the_governor_switches_arms_and_the_output_stays_plain_decodings(stack):
    """Four concurrent requests with epochs of one round and exploration every other epoch, so
    the arm changes many times while the requests run: every output equals plain decoding's."""
    policy = LoadPolicy(epoch_rounds=1, explore_every=2, min_gain=1.0)
    config = GatewayConfig(stack.addresses["verifier"], stack.addresses["drafter"], load_policy=policy)
    running = start_gateway(config, "127.0.0.1:0")
    prompts = [f"Tell a short story about a {animal} who learns to cook." for animal in ("cat", "fox", "owl", "bear")]
    try:
        with grpc.insecure_channel(running.address, options=CHANNEL_OPTIONS) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            def generate(prompt, decoding):
                request = gateway_pb2.GenerateRequest(prompt=prompt, max_new_tokens=128, decoding=decoding)
                return list(stub.Generate(request, timeout=300).token_ids)

            with ThreadPoolExecutor(4) as pool:
                plain = list(pool.map(lambda p: generate(p, gateway_pb2.DECODING_MODE_PLAIN), prompts))
                parallel = list(pool.map(lambda p: generate(p, gateway_pb2.DECODING_MODE_DEFAULT), prompts))
        assert parallel == plain
        epochs = running.generator.metrics.governor_epochs
        assert sum(epochs.labels(band, "draft")._value.get() for band in ("2-3", "4-7")) >= 1
        assert sum(epochs.labels(band, "plain")._value.get() for band in ("2-3", "4-7")) >= 1
    finally:
        running.server.stop(None)
