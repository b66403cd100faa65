"""Fuzzing the public API through real gRPC servers: hostile requests get a precise status or a
correct answer, no service dies, and a session running alongside gets exactly the tokens it
gets alone.

Hypothesis builds GenerateRequests from extreme values (NaN/inf/negative floats, 2^32-1 counts,
control characters, many stop strings, giant session ids, enum values that do not exist); an
oracle built from the documented rules says which fields are invalid. Raw wire messages carry
invalid UTF-8 in string fields, which no protobuf client would send. Every successful case keeps
max_new_tokens small. The internal RPCs have theirs in test_fuzz_internal.py.
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import grpc
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pardec.verifier.api import MAX_LOGPROBS, MIN_TEMPERATURE
from pardec.gateway.chat import input_tokens
from pardec.gateway.config import GatewayConfig
from pardec.gateway.service import messages_from_proto
from pardec.gateway.rules import MAX_PROMPT_CHARS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from pardec.runtime.security import SESSION_ID
from pardec.runtime.parsing import explain
from pardec.v1 import common_pb2, gateway_pb2
from tests.fuzzing import (BYSTANDER_PROMPT, BYSTANDER_TOKENS, FUZZ, TIMEOUT_S, assert_invalid, assert_serving,
                           assert_unparseable_is_invalid, call, length_delimited, raw_method, varint, varint_field)


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
    """Each field is valid (at its edges) or, one time in twelve, hostile: some of the requests
    are wholly valid and must be answered (the test adds five such examples of its own)."""

    def pick(valid, hostile):
        # One in twelve hostile; sampled_from leans to its first entry (valid), where an integer
        # range leans to 0 and made most requests hostile somewhere.
        return draw(hostile if draw(st.sampled_from([False] * 11 + [True])) else valid)

    request = gateway_pb2.GenerateRequest(
        prompt=pick(st.one_of(texts.filter(bool), st.just("Hello")), st.sampled_from(["", "word " * 3000])),
        max_new_tokens=pick(st.integers(1, 3), st.sampled_from([2561, 10**6, 2**32 - 1])),
        decoding=pick(st.sampled_from([0, 1]), st.sampled_from([2, -1, 2**31 - 1])),
        n=pick(st.sampled_from([0, 1]), counts),
        best_of=pick(st.sampled_from([0, 1]), counts),
        use_beam_search=pick(st.just(False), st.just(True)),
        logprobs=pick(st.just(False), st.just(True)),
        top_logprobs=pick(st.just(0), counts),  # valid with logprobs and plain decoding up to 20
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
        sampling.min_p = pick(st.floats(0, 1, width=32), st.one_of(not_finite, st.sampled_from([-1.0, 1.5, 3e38])))
        if draw(st.booleans()):
            sampling.seed = draw(st.integers(0, 2**64 - 1))
        if draw(st.booleans()):
            sampling.repetition_penalty = pick(
                st.one_of(st.sampled_from([1e-45, 0.5, 1.0, 1.3, 3e38]), finite.filter(lambda x: x > 0)),
                st.one_of(not_finite, st.sampled_from([0.0, -1.0])),
            )
        plain = request.decoding == gateway_pb2.DECODING_MODE_PLAIN  # penalties: with plain decoding only
        penalties = st.one_of(st.just(0.0), st.floats(-2, 2, width=32)) if plain else st.just(0.0)
        sampling.presence_penalty = pick(penalties, st.one_of(not_finite, finite.filter(lambda x: abs(x) > 2)))
        sampling.frequency_penalty = pick(penalties, st.one_of(not_finite, finite.filter(lambda x: abs(x) > 2)))
    draw_input(draw, request)
    floors = {"decoding_length": 1, "level": 3, "window": 1, "guess_set_size": 1}
    for name, floor in floors.items():
        if draw(st.integers(0, 3)) == 0:
            ceiling = getattr(SERVER.draft, name)
            setattr(request.draft, name, pick(st.integers(floor, ceiling), st.sampled_from([0, ceiling + 1, 2**32 - 1])))
    return request


def draw_input(draw, request):
    """The prompt as it is, as a raw completion, or as the last user message of a conversation
    (a system message or not, earlier turns drawn); now and then a hostile mix: both prompt and messages, raw with
    messages, a role that does not exist, an empty user message, roles out of order."""
    mode = draw(st.sampled_from(["prompt", "messages", "raw", "prompt", "messages", "hostile"]))
    if mode == "raw":
        request.raw = True
    if mode not in ("messages", "hostile"):
        return
    if draw(st.booleans()):
        request.messages.add(role=gateway_pb2.ROLE_SYSTEM, content=draw(texts))
    for question, answer in draw(st.lists(st.tuples(texts.filter(bool), texts), max_size=2)):
        request.messages.add(role=gateway_pb2.ROLE_USER, content=question)
        request.messages.add(role=gateway_pb2.ROLE_ASSISTANT, content=answer)
    request.messages.add(role=gateway_pb2.ROLE_USER, content=request.prompt)
    request.prompt = ""
    if mode == "hostile":
        message = request.messages[draw(st.integers(0, len(request.messages) - 1))]
        change = draw(st.sampled_from(["prompt", "raw", "role", "empty", "order"]))
        if change == "prompt":
            request.prompt = "Hello"
        elif change == "raw":
            request.raw = True
        elif change == "role":
            message.role = draw(st.sampled_from([0, 5, 2**31 - 1]))  # no role (4 is ROLE_TOOL: test_tool_calling.py)
        elif change == "order":  # a system message after the first, or a conversation ending with a reply
            message.role = draw(st.sampled_from([gateway_pb2.ROLE_SYSTEM, gateway_pb2.ROLE_ASSISTANT]))
        else:
            message.role, message.content = gateway_pb2.ROLE_USER, ""


def invalid_input_fields(request: gateway_pb2.GenerateRequest) -> set[str]:
    """The input rules (gateway/chat.py): exactly one of prompt and a well-formed conversation."""
    messages = request.messages
    if request.prompt and messages:
        return {"messages"}
    if not messages:
        return {"prompt"} if not request.prompt or len(request.prompt) > MAX_PROMPT_CHARS else set()
    bad = {f"messages[{i}].role" for i, m in enumerate(messages) if m.role not in (1, 2, 3, 4)}
    if bad:  # refused while the request is converted, before any other rule
        return bad
    if request.raw:
        bad.add("raw")
    bad |= {f"messages[{i}].role" for i, m in enumerate(messages) if m.role == gateway_pb2.ROLE_SYSTEM and i}
    bad |= {f"messages[{i}].content" for i, m in enumerate(messages) if m.role == gateway_pb2.ROLE_USER and not m.content}
    if messages[-1].role != gateway_pb2.ROLE_USER:
        bad.add(f"messages[{len(messages) - 1}].role")
    return bad


def prompt_tokens(tokenizer, request: gateway_pb2.GenerateRequest) -> int:
    """The prompt's tokens as the gateway counts them; 0 when its input is refused first."""
    if invalid_input_fields(request):
        return 0
    return len(input_tokens(tokenizer, request.prompt, tuple(messages_from_proto(request.messages)), request.raw))


def invalid_fields(request: gateway_pb2.GenerateRequest, prompt_tokens: int, max_seq_len: int,
                   streamed: bool = False) -> set[str]:
    """The fields the documented rules refuse (empty: the request must succeed)."""
    bad = set()
    if request.decoding not in (0, 1):
        bad.add("decoding")
    plain = request.decoding == gateway_pb2.DECODING_MODE_PLAIN  # logprobs, beams: plain decoding only (MindIE)
    if request.best_of > 1 or request.n > 1 and not (plain and streamed and request.n <= 16):  # n: streamed
        bad |= {name for name in ("n", "best_of") if getattr(request, name) > 1}
    if request.use_beam_search:  # and without what would rank beams otherwise (rules.py)
        params = request.sampling
        bad |= {"use_beam_search"} if not plain else {name for name, on in (
            ("stop", request.stop), ("logprobs", request.logprobs), ("sampling.presence_penalty",
             params.presence_penalty), ("sampling.frequency_penalty", params.frequency_penalty),
            ("sampling.repetition_penalty", params.HasField("repetition_penalty") and params.repetition_penalty != 1))
            if on}
    if request.logprobs and not plain:
        bad.add("logprobs")
    if request.top_logprobs and (not plain or not request.logprobs or request.top_logprobs > MAX_LOGPROBS):
        bad.add("top_logprobs")
    params = request.sampling
    for name in ("presence_penalty", "frequency_penalty"):  # in [-2, 2], non-zero with plain decoding only
        if not -2 <= getattr(params, name) <= 2 or (getattr(params, name) != 0 and not plain):  # NaN included
            bad.add(f"sampling.{name}")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)) or 0 < params.temperature < MIN_TEMPERATURE:
        bad.add("sampling.temperature")
    if not 0 <= params.top_p <= 1:
        bad.add("sampling.top_p")
    if not 0 <= params.min_p <= 1:
        bad.add("sampling.min_p")
    if params.HasField("repetition_penalty") and not (
        params.repetition_penalty > 0 and math.isfinite(params.repetition_penalty)
    ):
        bad.add("sampling.repetition_penalty")
    if not all(request.stop) or len(request.stop) > MAX_STOP_STRINGS or any(
        len(stop) > MAX_STOP_CHARS for stop in request.stop
    ):
        bad.add("stop")
    if request.session_id and not SESSION_ID.fullmatch(request.session_id):
        bad.add("session_id")
    if invalid_input_fields(request):
        bad |= invalid_input_fields(request)
    elif prompt_tokens > SERVER.max_input_tokens:
        bad.add("messages" if request.messages else "prompt")
    elif prompt_tokens + request.max_new_tokens > max_seq_len:
        bad.add("max_new_tokens")
    if request.decoding != gateway_pb2.DECODING_MODE_PLAIN:
        floors = {"decoding_length": 1, "level": 3, "window": 1, "guess_set_size": 1}
        for name, floor in floors.items():
            if request.draft.HasField(name) and not floor <= getattr(request.draft, name) <= getattr(SERVER.draft, name):
                bad.add(f"draft.{name}")
    return bad


def check_answer(request, reply_or_chunks, streamed: bool, whole: bool = True):
    assert not (streamed and whole) or {chunk.index for chunk in reply_or_chunks} == set(range(max(1, request.n)))
    if streamed and whole and request.n > 1:  # n sequences: each one whole
        for index in range(request.n):
            check_answer(request, [chunk for chunk in reply_or_chunks if chunk.index == index], True, whole=False)
        return
    if streamed:
        chunks = reply_or_chunks
        assert chunks and all(not c.finish_reason for c in chunks[:-1])
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks for t in c.token_ids]
        finish = chunks[-1].finish_reason
        logprobs = [lp for c in chunks for lp in c.logprobs]
    else:
        text, tokens, finish = reply_or_chunks.text, list(reply_or_chunks.token_ids), reply_or_chunks.finish_reason
        logprobs = list(reply_or_chunks.logprobs)
    assert len(logprobs) == (len(tokens) if request.logprobs else 0)
    assert all(len(lp.top_token_ids) == request.top_logprobs and lp.logprob <= 0 for lp in logprobs)
    assert 1 <= len(tokens) <= request.max_new_tokens
    assert finish in ("length", "stop", "eos")
    assert finish != "length" or len(tokens) == request.max_new_tokens
    assert not any(stop in text for stop in request.stop)


def test_public_api_fuzz(stack, engine):
    """Each hypothesis request: INVALID_ARGUMENT naming an invalid field, or a correct answer
    (greedy ones equal plain decoding); a bystander session is untouched; all still serve."""
    max_seq_len = engine.config.max_seq_len
    outcomes = Counter()

    @FUZZ  # with wholly valid requests always among the cases (the draws' share of them varies)
    @given(request=generate_requests(), streamed=st.booleans())
    @example(request=gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=2), streamed=False)
    @example(request=gateway_pb2.GenerateRequest(prompt="Hello", max_new_tokens=3), streamed=True)
    @example(request=gateway_pb2.GenerateRequest(prompt="Count: one", max_new_tokens=1, decoding=1), streamed=False)
    @example(request=gateway_pb2.GenerateRequest(prompt="Count: one two", max_new_tokens=2, n=1), streamed=True)
    @example(request=gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=3, stop=["zz"]), streamed=False)
    @example(request=gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=2, decoding=1, n=2), streamed=True)
    def fuzz(request, streamed):
        expected = invalid_fields(request, prompt_tokens(engine.tokenizer, request), max_seq_len, streamed)
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

INVALID_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\xc0\xaf"]
invalid_utf8 = st.builds(lambda head, bad, tail: head + bad + tail,
                         st.text(max_size=8).map(str.encode), st.sampled_from(INVALID_UTF8), st.binary(max_size=8))
valid_utf8 = st.text(max_size=8).map(str.encode)


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
        ("gateway", "Gateway/Generate", varint(1 << 3 | 7), "prompt"),  # wire type 7
        ("gateway", "Gateway/Generate", length_delimited(12, b"\x08"), "draft.decoding_length"),
        ("gateway", "Gateway/Generate", length_delimited(13, length_delimited(2, b"\xff")), "messages[0].content"),
    ],
)
def test_unparseable_messages_name_the_field(stack, service, method, message, field_name):
    assert_unparseable_is_invalid(stack, service, method, message, field_name)


def test_explain_names_nested_and_repeated_fields():
    descriptor = gateway_pb2.GenerateRequest.DESCRIPTOR
    message = length_delimited(10, b"ok") + length_delimited(10, b"\xff")
    assert explain(descriptor, message).startswith("stop[1]: not valid UTF-8")
    assert explain(descriptor, b"").startswith("request:")  # nothing wrong found: the type is named

