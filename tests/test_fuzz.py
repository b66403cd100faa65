"""Fuzzing through real gRPC servers: hostile requests get a precise status or a correct answer,
no service dies, and a session running alongside gets exactly the tokens it gets alone.

Public API: hypothesis builds GenerateRequests from extreme values (NaN/inf/negative floats,
2^32-1 counts, control characters, many stop strings, giant session ids, enum values that do
not exist); an oracle built from the documented rules says which fields are invalid. Raw wire
messages carry invalid UTF-8 in string fields, which no protobuf client would send. Internal
RPCs: malformed trees, unknown and released sessions, double prefill, oversized inputs.
Every successful case keeps max_new_tokens small so the file runs in about two minutes.
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from gateway.rules import MAX_PROMPT_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from pardec.parsing import explain
from pardec.serving import CHANNEL_OPTIONS
from pardec.v1 import common_pb2, drafter_pb2, gateway_pb2, verifier_pb2
from tests.prompts import CODE_PROMPTS

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
TIMEOUT_S = 120
BYSTANDER_PROMPT = CODE_PROMPTS[0]
BYSTANDER_TOKENS = 16


def call(method, request):
    """(status, reply or details) of a unary call or of a whole stream."""
    try:
        reply = method(request, timeout=TIMEOUT_S)
        return grpc.StatusCode.OK, list(reply) if hasattr(reply, "__next__") else reply
    except grpc.RpcError as error:
        return error.code(), error.details()


def assert_invalid(code, details, fields):
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details, fields)
    assert any(name in details for name in fields), (details, fields)


def assert_serving(stack):
    for address in stack.addresses.values():
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, address


class Bystander:
    """A normal greedy session run over and over while the fuzz runs; every run must equal the
    run made before the fuzz started."""

    def __init__(self, stack):
        self.gateway = stack.gateway
        self.request = gateway_pb2.GenerateRequest(prompt=BYSTANDER_PROMPT, max_new_tokens=BYSTANDER_TOKENS)
        self.reference = list(self.gateway.Generate(self.request, timeout=TIMEOUT_S).token_ids)
        self.outputs: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.outputs.append(list(self.gateway.Generate(self.request, timeout=TIMEOUT_S).token_ids))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(TIMEOUT_S)
        assert not self._thread.is_alive()
        assert self.outputs, "the bystander never finished a request"
        assert all(output == self.reference for output in self.outputs)


# ---- the public API ---------------------------------------------------------------------------

SERVER = GatewayConfig(verifier_target="unused", drafter_target="unused")
texts = st.text(st.characters(codec="utf-8"), max_size=40)  # control characters and NUL included
counts = st.sampled_from([2, 3, 16, 2**31, 2**32 - 1])
finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
not_finite = st.sampled_from([math.nan, math.inf, -math.inf])


@st.composite
def generate_requests(draw):
    """Each field is valid (at its edges) or, now and then, hostile: about a third of the
    requests are wholly valid and must be answered."""

    def pick(valid, hostile):
        return draw(hostile if draw(st.integers(0, 11)) == 0 else valid)

    request = gateway_pb2.GenerateRequest(
        prompt=pick(st.one_of(texts.filter(bool), st.just("Hello")), st.sampled_from(["", "word " * 3000])),
        max_new_tokens=pick(st.integers(1, 3), st.sampled_from([2561, 10**6, 2**32 - 1])),
        decoding=pick(st.sampled_from([0, 1]), st.sampled_from([2, -1, 2**31 - 1])),
        n=pick(st.sampled_from([0, 1]), counts),
        best_of=pick(st.sampled_from([0, 1]), counts),
        use_beam_search=pick(st.just(False), st.just(True)),
        logprobs=pick(st.just(False), st.just(True)),
        top_logprobs=pick(st.just(0), counts),
        stop=pick(st.one_of(st.lists(texts.filter(bool), max_size=3), st.just(["x" * 1000] * 500)),
                  st.lists(texts, min_size=1, max_size=3).map(lambda stops: [*stops, ""])),
        session_id=pick(st.one_of(st.just(""), texts.filter(lambda t: not {"{", "}"} & set(t))),
                        st.sampled_from(["{tag}", "s" * 201, "s" * 100_000])),
    )
    if draw(st.booleans()):
        sampling = request.sampling
        sampling.temperature = pick(st.one_of(st.sampled_from([0.0, -0.0, 1e-45, 3e38]), finite.map(abs)),
                                    st.one_of(not_finite, st.floats(max_value=-1.0, width=32)))
        sampling.top_k = draw(st.one_of(st.integers(0, 100), counts))
        sampling.top_p = pick(st.floats(0, 1, width=32), st.one_of(not_finite, st.sampled_from([-1.0, 1.5, 3e38])))
        if draw(st.booleans()):
            sampling.seed = draw(st.integers(0, 2**64 - 1))
        if draw(st.booleans()):
            sampling.repetition_penalty = pick(
                st.one_of(st.sampled_from([1e-45, 0.5, 1.0, 1.3, 3e38]), finite.filter(lambda x: x > 0)),
                st.one_of(not_finite, st.sampled_from([0.0, -1.0])),
            )
        sampling.presence_penalty = pick(st.just(0.0), st.one_of(not_finite, finite.filter(bool)))
        sampling.frequency_penalty = pick(st.just(0.0), st.one_of(not_finite, finite.filter(bool)))
    floors = {"decoding_length": 1, "level": 3, "window": 1, "guess_set_size": 1}
    for name, floor in floors.items():
        if draw(st.integers(0, 3)) == 0:
            ceiling = getattr(SERVER.draft, name)
            setattr(request.draft, name, pick(st.integers(floor, ceiling), st.sampled_from([0, ceiling + 1, 2**32 - 1])))
    return request


def invalid_fields(request: gateway_pb2.GenerateRequest, prompt_tokens: int, max_seq_len: int) -> set[str]:
    """The fields the documented rules refuse (empty: the request must succeed)."""
    bad = set()
    if request.decoding not in (0, 1):
        bad.add("decoding")
    for name in ("n", "best_of"):
        if getattr(request, name) > 1:
            bad.add(name)
    for name in ("use_beam_search", "logprobs", "top_logprobs"):
        if getattr(request, name):
            bad.add(name)
    params = request.sampling
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name) != 0:  # NaN included
            bad.add(f"sampling.{name}")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        bad.add("sampling.temperature")
    if not 0 <= params.top_p <= 1:
        bad.add("sampling.top_p")
    if params.HasField("repetition_penalty") and not (
        params.repetition_penalty > 0 and math.isfinite(params.repetition_penalty)
    ):
        bad.add("sampling.repetition_penalty")
    if not all(request.stop) or len(request.stop) > MAX_STOP_STRINGS or any(
        len(stop) > MAX_STOP_CHARS for stop in request.stop
    ):
        bad.add("stop")
    if len(request.session_id) > 200 or {"{", "}"} & set(request.session_id):
        bad.add("session_id")
    if not request.prompt or len(request.prompt) > MAX_PROMPT_CHARS:
        bad.add("prompt")
    elif prompt_tokens > SERVER.max_input_tokens:
        bad.add("prompt")
    elif prompt_tokens + request.max_new_tokens > max_seq_len:
        bad.add("max_new_tokens")
    if request.decoding != gateway_pb2.DECODING_MODE_PLAIN:
        floors = {"decoding_length": 1, "level": 3, "window": 1, "guess_set_size": 1}
        for name, floor in floors.items():
            if request.draft.HasField(name) and not floor <= getattr(request.draft, name) <= getattr(SERVER.draft, name):
                bad.add(f"draft.{name}")
    return bad


def check_answer(request, reply_or_chunks, streamed: bool):
    if streamed:
        chunks = reply_or_chunks
        assert chunks and all(not c.finish_reason for c in chunks[:-1])
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks for t in c.token_ids]
        finish = chunks[-1].finish_reason
    else:
        text, tokens, finish = reply_or_chunks.text, list(reply_or_chunks.token_ids), reply_or_chunks.finish_reason
    assert 1 <= len(tokens) <= request.max_new_tokens
    assert finish in ("length", "stop", "eos")
    assert finish != "length" or len(tokens) == request.max_new_tokens
    assert not any(stop in text for stop in request.stop)


def test_public_api_fuzz(stack, engine):
    """Each hypothesis request: INVALID_ARGUMENT naming an invalid field, or a correct answer
    (greedy ones equal plain decoding); a bystander session is untouched; all still serve."""
    max_seq_len = engine.config.max_seq_len
    outcomes = Counter()

    @FUZZ
    @given(request=generate_requests(), streamed=st.booleans())
    def fuzz(request, streamed):
        prompt_tokens = len(engine.tokenizer.encode_chat(request.prompt)) if request.prompt else 0
        expected = invalid_fields(request, prompt_tokens, max_seq_len)
        method = stack.gateway.GenerateStream if streamed else stack.gateway.Generate
        code, reply = call(method, request)
        outcomes["refused" if expected else "answered"] += 1
        if expected:
            assert_invalid(code, reply, expected)
            return
        assert code == grpc.StatusCode.OK, (reply, request)
        check_answer(request, reply, streamed)
        if request.sampling.temperature == 0 and request.decoding == gateway_pb2.DECODING_MODE_DEFAULT:
            plain = gateway_pb2.GenerateRequest()
            plain.CopyFrom(request)
            plain.decoding = gateway_pb2.DECODING_MODE_PLAIN
            plain.session_id = ""
            plain.ClearField("draft")
            ids = [t for c in reply for t in c.token_ids] if streamed else list(reply.token_ids)
            assert ids == list(stack.gateway.Generate(plain, timeout=TIMEOUT_S).token_ids)

    with Bystander(stack):
        fuzz()
    print("public API fuzz:", dict(outcomes))
    assert outcomes["answered"] >= 5 and outcomes["refused"] >= 5, outcomes
    assert_serving(stack)
    assert engine._engine_thread.is_alive()


def test_default_max_new_tokens_ends_at_a_stop_string(stack):
    # max_new_tokens 0 takes the server's default (256); the stop strings keep it short here.
    request = gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=0, stop=[" ", "\n", ".", ","])
    reply = stack.gateway.Generate(request, timeout=TIMEOUT_S)
    assert reply.finish_reason in ("stop", "eos") and len(reply.token_ids) < 256


@pytest.mark.parametrize(
    "request_, field_name",
    [
        (common_pb2.SamplingParams(temperature=math.inf), "sampling.temperature"),
        (common_pb2.SamplingParams(repetition_penalty=math.inf), "sampling.repetition_penalty"),
        (common_pb2.SamplingParams(repetition_penalty=math.nan), "sampling.repetition_penalty"),
    ],
)
def test_non_finite_sampling_is_refused(stack, request_, field_name):
    request = gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=2, sampling=request_)
    assert_invalid(*call(stack.gateway.Generate, request), {field_name})


def test_a_tiny_repetition_penalty_with_sampling_answers(stack):
    # Dividing float32 logits by 1e-45 overflowed to inf and the draw failed (INTERNAL).
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=3, repetition_penalty=1e-45)
    request = gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=3, sampling=sampling)
    assert len(stack.gateway.Generate(request, timeout=TIMEOUT_S).token_ids) == 3


def test_unknown_decoding_mode_is_refused(stack):
    request = gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=2, decoding=7)
    assert_invalid(*call(stack.gateway.Generate, request), {"decoding"})


def test_giant_values_are_quoted_short(stack):
    # The whole value in the message would pass gRPC's 16 KiB status limit (RESOURCE_EXHAUSTED).
    request = gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=2, session_id="s" * 100_000)
    code, details = call(stack.gateway.Generate, request)
    assert_invalid(code, details, {"session_id"})
    assert len(details) < 2000


# ---- raw wire messages: invalid UTF-8 and broken encodings -----------------------------------

def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


INVALID_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\xc0\xaf"]
invalid_utf8 = st.builds(lambda head, bad, tail: head + bad + tail,
                         st.text(max_size=8).map(str.encode), st.sampled_from(INVALID_UTF8), st.binary(max_size=8))
valid_utf8 = st.text(max_size=8).map(str.encode)


def raw_method(address: str, path: str, response_class, streaming: bool):
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(path, request_serializer=lambda data: data, response_deserializer=response_class.FromString)


def test_invalid_utf8_in_public_strings_is_invalid_argument(stack):
    methods = {
        streaming: raw_method(stack.addresses["gateway"], f"/pardec.v1.Gateway/{name}",
                              gateway_pb2.GenerateResponse, streaming)
        for streaming, name in ((False, "Generate"), (True, "GenerateStream"))
    }
    names = {1: "prompt", 10: "stop", 11: "session_id"}

    @FUZZ
    @given(
        fields=st.lists(st.tuples(st.sampled_from(sorted(names)), st.one_of(valid_utf8, invalid_utf8)), max_size=5),
        bad_field=st.sampled_from(sorted(names)), bad=invalid_utf8, streaming=st.booleans(),
    )
    def fuzz(fields, bad_field, bad, streaming):
        fields = [*fields, (bad_field, bad)]
        message = varint_field(2, 2) + b"".join(length_delimited(number, value) for number, value in fields)
        first_bad = next(number for number, value in fields if not _is_utf8(value))
        code, details = call(methods[streaming], message)
        assert_invalid(code, details, {names[first_bad]})
        assert "UTF-8" in details

    fuzz()
    assert_serving(stack)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@pytest.mark.parametrize(
    "service, method, message, field_name",
    [
        ("gateway", "Gateway/Generate", length_delimited(1, b"Hi")[:-1], "prompt"),  # truncated
        ("gateway", "Gateway/Generate", b"\xff\xff\xff", "request"),
        ("gateway", "Gateway/Generate", _varint(1 << 3 | 7), "prompt"),  # wire type 7
        ("gateway", "Gateway/Generate", length_delimited(12, b"\x08"), "draft.decoding_length"),
        ("verifier", "Verifier/Prefill", length_delimited(1, b"\xff") + length_delimited(2, b"\x01"), "session_id"),
        ("verifier", "Verifier/Verify", length_delimited(2, length_delimited(1, b"\x81")), "tree.token_ids"),
        ("drafter", "Drafter/StartSession", length_delimited(3, length_delimited(1, b"la\xff")), "config.plugin_type"),
        ("drafter", "Drafter/EndSession", length_delimited(1, b"\xed\xa0\x80"), "session_id"),
    ],
)
def test_unparseable_messages_name_the_field(stack, service, method, message, field_name):
    response = {"gateway": gateway_pb2.GenerateResponse, "verifier": verifier_pb2.VerifyResponse,
                "drafter": drafter_pb2.EndSessionResponse}[service]
    code, details = call(raw_method(stack.addresses[service], f"/pardec.v1.{method}", response, False), message)
    assert_invalid(code, details, {field_name})


def test_explain_names_nested_and_repeated_fields():
    descriptor = gateway_pb2.GenerateRequest.DESCRIPTOR
    message = length_delimited(10, b"ok") + length_delimited(10, b"\xff")
    assert explain(descriptor, message).startswith("stop[1]: not valid UTF-8")
    assert explain(descriptor, b"").startswith("request:")  # nothing wrong found: the type is named


# ---- internal RPCs ----------------------------------------------------------------------------

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
