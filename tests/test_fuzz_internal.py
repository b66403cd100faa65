"""Fuzzing the internal RPCs through real gRPC servers: malformed trees, unknown and released
sessions, double prefill, oversized inputs and hostile drafter configs get a precise status, no
service dies, and a session running alongside gets exactly what it gets alone. The public API
has its own in test_fuzz_public.py.
"""

from __future__ import annotations

import math
from collections import Counter

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pardec.v1 import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2
from tests.fuzzing import (
    BYSTANDER_PROMPT,
    BYSTANDER_TOKENS,
    FUZZ,
    TIMEOUT_S,
    assert_invalid,
    assert_serving,
    assert_unparseable_is_invalid,
    call,
    length_delimited,
)


@st.composite
def trees(draw, vocab_size: int, max_nodes: int):
    """A valid tree of up to 12 nodes, left valid or broken in one way: a token outside the
    vocabulary, a parent that is not an earlier node (cycles and self-loops included), lists
    of different lengths, or more nodes than the verifier takes."""
    size = draw(st.integers(0, 12))
    tokens = draw(st.lists(st.integers(0, vocab_size - 1), min_size=size, max_size=size))
    parents = [draw(st.integers(-1, i - 1)) for i in range(size)]
    breakage = draw(st.sampled_from(["none", "none", "token", "parent", "lengths", "oversized"]))
    if breakage == "token" and size:
        tokens[draw(st.integers(0, size - 1))] = draw(st.sampled_from([vocab_size, 2**32 - 1]))
    elif breakage == "parent" and size:
        node = draw(st.integers(0, size - 1))
        parents[node] = draw(st.sampled_from([-2, node, node + 1, size + 5, 2**31 - 1, -2**31]))
    elif breakage == "lengths":
        parents = parents[:-1] if size else [-1]
    elif breakage == "oversized":
        extra = draw(st.sampled_from([max_nodes + 1 - size, max_nodes + 40]))
        tokens, parents = tokens + [1] * extra, parents + [-1] * extra
    return tokens, parents


def tree_problem(tokens, parents, vocab_size, max_nodes) -> str | None:
    if len(tokens) > max_nodes:
        return "max_tree_nodes"
    if len(tokens) != len(parents):
        return "tree.parents"
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if not 0 <= token < vocab_size:
            return f"tree.token_ids[{i}]"
        if not -1 <= parent < i:
            return f"tree.parents[{i}]"
    return None


def test_verifier_fuzz(stack, engine):
    """Random trees against one session: broken ones are refused naming the first broken node,
    valid ones verify; a bystander session stepped in between decodes exactly as alone."""
    vocab, max_nodes = engine.vocab_size, engine.config.max_tree_nodes
    prompt = engine.tokenizer.encode_chat(BYSTANDER_PROMPT)
    reference = stack.gateway.Generate(gateway_pb2.GenerateRequest(
        prompt=BYSTANDER_PROMPT, max_new_tokens=BYSTANDER_TOKENS, decoding=gateway_pb2.DECODING_MODE_PLAIN,
    ), timeout=TIMEOUT_S)
    fuzzed, bystander = "fuzz-verifier-session", "fuzz-verifier-bystander"
    outcomes = Counter()
    stack.verifier.Prefill(verifier_pb2.PrefillRequest(session_id=fuzzed, token_ids=prompt[:40]), timeout=TIMEOUT_S)
    generated = [stack.verifier.Prefill(verifier_pb2.PrefillRequest(session_id=bystander, token_ids=prompt),
                                        timeout=TIMEOUT_S).next_token_id]

    @FUZZ
    @given(tree=trees(vocab, max_nodes))
    def fuzz(tree):
        tokens, parents = tree
        request = verifier_pb2.VerifyRequest(session_id=fuzzed, tree=common_pb2.TokenTree(token_ids=tokens, parents=parents))
        code, reply = call(stack.verifier.Verify, request)
        problem = tree_problem(tokens, parents, vocab, max_nodes)
        outcomes["refused" if problem else "verified"] += 1
        if problem:
            assert_invalid(code, reply, {problem})
        else:
            assert code == grpc.StatusCode.OK, reply
            assert len(reply.node_argmax) == len(tokens) + 1 and 0 <= reply.bonus_token_id < vocab
            expected_parent = -1
            for node, token in zip(reply.accepted_node_indices, reply.accepted_token_ids):
                assert parents[node] == expected_parent and tokens[node] == token
                expected_parent = node
        if len(generated) < BYSTANDER_TOKENS:
            generated.append(stack.verifier.Verify(verifier_pb2.VerifyRequest(session_id=bystander),
                                                   timeout=TIMEOUT_S).bonus_token_id)

    try:
        fuzz()
        print("verifier fuzz:", dict(outcomes))
        assert outcomes["verified"] >= 5 and outcomes["refused"] >= 5, outcomes
        while len(generated) < BYSTANDER_TOKENS:
            generated.append(stack.verifier.Verify(verifier_pb2.VerifyRequest(session_id=bystander),
                                                   timeout=TIMEOUT_S).bonus_token_id)
        assert generated[: len(reference.token_ids)] == list(reference.token_ids)
    finally:
        for session in (fuzzed, bystander):
            stack.verifier.Release(verifier_pb2.ReleaseRequest(session_id=session), timeout=TIMEOUT_S)
    assert_serving(stack)


def test_verifier_session_lifecycle_abuse(stack, engine):
    verifier = stack.verifier
    prefill = verifier_pb2.PrefillRequest(session_id="fuzz-lifecycle", token_ids=[1, 2, 3])
    verifier.Prefill(prefill, timeout=TIMEOUT_S)
    assert_invalid(*call(verifier.Prefill, prefill), {"session_id"})  # a second prefill would clobber it
    verifier.Release(verifier_pb2.ReleaseRequest(session_id="fuzz-lifecycle"), timeout=TIMEOUT_S)
    verifier.Release(verifier_pb2.ReleaseRequest(session_id="fuzz-lifecycle"), timeout=TIMEOUT_S)  # idempotent
    code, details = call(verifier.Verify, verifier_pb2.VerifyRequest(session_id="fuzz-lifecycle"))
    assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details
    code, details = call(verifier.Verify, verifier_pb2.VerifyRequest(session_id="x" * 100_000))
    assert code == grpc.StatusCode.NOT_FOUND and len(details) < 2000
    for bad in (
        verifier_pb2.PrefillRequest(session_id="s" * 300, token_ids=[1]),
        verifier_pb2.PrefillRequest(session_id="", token_ids=[1]),
    ):
        assert_invalid(*call(verifier.Prefill, bad), {"session_id"})
    too_long = verifier_pb2.PrefillRequest(session_id="fuzz-long", token_ids=[1] * (engine.config.max_input_tokens + 1))
    assert_invalid(*call(verifier.Prefill, too_long), {"token_ids"})
    sampling = common_pb2.SamplingParams(temperature=math.inf)
    assert_invalid(*call(verifier.Prefill, verifier_pb2.PrefillRequest(session_id="fuzz-inf", token_ids=[1],
                                                                      sampling=sampling)), {"sampling.temperature"})
    assert "fuzz-inf" not in engine._sessions


def sometimes(draw, valid, hostile):
    """A valid value, or now and then a hostile one (so that most calls get past validation)."""
    return draw(hostile if draw(st.integers(0, 15)) == 0 else valid)


@st.composite
def draft_configs(draw):
    config = drafter_pb2.DraftConfig(
        plugin_type=sometimes(draw, st.sampled_from(["", "memory_decoding", "la"]),
                              st.sampled_from(["lookahead", "x" * 5000])),
        dynamic_algo=draw(st.booleans()),
    )
    ranges = {"decoding_length": (1, 16), "level": (3, 16), "window": (1, 16), "guess_set_size": (1, 16)}
    for name, (low, high) in ranges.items():
        setattr(config, name, sometimes(draw, st.integers(low, min(high, low + 4)), st.sampled_from([high + 1, 2**32 - 1])))
    return config


def config_problem(config) -> str | None:
    if config.plugin_type not in ("", "memory_decoding", "la"):
        return "config.plugin_type"
    ranges = {"decoding_length": (1, 16), "level": (3, 16), "window": (1, 16), "guess_set_size": (1, 16)}
    for name, (low, high) in ranges.items():
        value = getattr(config, name)
        if value and not low <= value <= high:
            return f"config.{name}"
    return None


def session_problem(session_id: str) -> bool:
    return not 0 < len(session_id) <= 256 or "{" in session_id or "}" in session_id


def test_drafter_fuzz(stack):
    """Random sessions, configs and calls: precise statuses, well-formed trees, and a bystander
    drafting session proposes the same trees as the same calls made before the fuzz."""
    drafter = stack.drafter
    prompt = list(range(100, 140)) * 3

    def bystander_trees(session_id):
        drafter.StartSession(drafter_pb2.StartSessionRequest(session_id=session_id, prompt_token_ids=prompt),
                             timeout=TIMEOUT_S)
        out = [drafter.Propose(drafter_pb2.ProposeRequest(session_id=session_id, new_token_ids=[100 + i % 40],
                                                          max_nodes=8, max_depth=4), timeout=TIMEOUT_S).tree
               for i in range(6)]
        drafter.EndSession(drafter_pb2.EndSessionRequest(session_id=session_id), timeout=TIMEOUT_S)
        return out

    reference = bystander_trees("fuzz-drafter-reference")
    outcomes = Counter()

    @FUZZ
    @given(data=st.data(), config=draft_configs(), end_first=st.integers(0, 3).map(lambda n: n == 0))
    def fuzz(data, config, end_first):
        draw = data.draw
        session_id = sometimes(draw, st.text(st.characters(codec="utf-8"), min_size=1, max_size=12).filter(
            lambda t: not {"{", "}"} & set(t)), st.sampled_from(["", "{x}", "s" * 257]))
        prompt_tokens = sometimes(draw, st.lists(st.integers(0, 2**32 - 1), max_size=30), st.just([7] * (32 * 1024 + 1)))
        memory = sometimes(draw, st.sampled_from(["", "conversation-a"]), st.sampled_from(["{bad}", "m" * 244]))
        new_tokens = sometimes(draw, st.lists(st.integers(0, 2**32 - 1), max_size=20), st.just([1] * 514))
        max_nodes = sometimes(draw, st.integers(0, 64), st.sampled_from([513, 2**32 - 1]))
        max_depth = sometimes(draw, st.integers(0, 64), st.sampled_from([2**31, 2**32 - 1]))
        argmax = sometimes(draw, st.lists(st.integers(0, 2**32 - 1), max_size=10), st.just([0] * 514))
        start = drafter_pb2.StartSessionRequest(session_id=session_id, prompt_token_ids=prompt_tokens, config=config,
                                                client_session_id=memory)
        code, details = call(drafter.StartSession, start)
        problems = [name for name, broken in (
            ("session_id", session_problem(session_id)), (config_problem(config), config_problem(config)),
            ("prompt_token_ids", len(prompt_tokens) > 32 * 1024),
            ("client_session_id", memory.startswith(("{", "m"))),
        ) if broken]
        if problems:
            assert_invalid(code, details, set(problems))
        else:
            assert code == grpc.StatusCode.OK, details
        if not session_problem(session_id) and (end_first or problems):
            drafter.EndSession(drafter_pb2.EndSessionRequest(session_id=session_id), timeout=TIMEOUT_S)
        propose = drafter_pb2.ProposeRequest(session_id=session_id, new_token_ids=new_tokens, max_nodes=max_nodes,
                                             max_depth=max_depth, last_node_argmax=argmax)
        code, reply = call(drafter.Propose, propose)
        outcomes[code.name] += 1
        problems = [name for name, broken in (
            ("session_id", session_problem(session_id)), ("max_nodes", max_nodes > 512),
            ("new_token_ids", len(new_tokens) > 513), ("last_node_argmax", len(argmax) > 513),
            ("max_depth", max_depth > 2**31 - 1),
        ) if broken]
        if problems:
            assert_invalid(code, reply, set(problems))
        elif end_first or code == grpc.StatusCode.NOT_FOUND:
            assert code == grpc.StatusCode.NOT_FOUND and "session_id" in reply
            assert end_first or config_problem(config) or len(prompt_tokens) > 32 * 1024 or memory.startswith(("{", "m"))
        else:
            assert code == grpc.StatusCode.OK, reply
            tree = reply.tree
            assert len(tree.token_ids) == len(tree.parents) <= max_nodes
            depth = {-1: 0}
            for i, parent in enumerate(tree.parents):
                assert -1 <= parent < i
                depth[i] = depth[parent] + 1
                assert depth[i] <= max_depth
        if not session_problem(session_id):
            drafter.EndSession(drafter_pb2.EndSessionRequest(session_id=session_id), timeout=TIMEOUT_S)

    fuzz()
    print("drafter fuzz, Propose:", dict(outcomes))
    assert min(outcomes["OK"], outcomes["INVALID_ARGUMENT"], outcomes["NOT_FOUND"]) >= 3, outcomes
    assert bystander_trees("fuzz-drafter-bystander") == reference
    assert_serving(stack)


@pytest.mark.parametrize(
    "service, method, message, field_name",
    [
        ("verifier", "Verifier/Prefill", length_delimited(1, b"\xff") + length_delimited(2, b"\x01"), "session_id"),
        ("verifier", "Verifier/Verify", length_delimited(2, length_delimited(1, b"\x81")), "tree.token_ids"),
        ("drafter", "Drafter/StartSession", length_delimited(3, length_delimited(1, b"la\xff")), "config.plugin_type"),
        ("drafter", "Drafter/EndSession", length_delimited(1, b"\xed\xa0\x80"), "session_id"),
    ],
)
def test_unparseable_messages_name_the_field(stack, service, method, message, field_name):
    assert_unparseable_is_invalid(stack, service, method, message, field_name)
