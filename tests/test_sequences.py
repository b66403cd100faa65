"""OpenAI's ``n`` (gateway/choices.py): n sequences of one request, side by side, with plain
decoding (MindIE: parallel decoding returns one sequence); each sequence its own seed, whole
and streamed, over HTTP and gRPC; a stream closed early releases every sequence's sessions."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import openai
import pytest

from pardec.gateway.choices import generate_sequences, sequence_requests, stream_sequences
from pardec.gateway.deadlines import Cancelled, Deadline
from pardec.gateway.generation import Request
from pardec.gateway.outputs import Chunk
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import gateway_pb2
from pardec.verifier.api import Sampling
from tests.openai_front import model_of

ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
PLAIN = {"parallel_decoding": False}


def test_each_sequence_is_a_request_of_its_own_with_its_own_seed():
    three = sequence_requests(Request(prompt="hi", n=3, sampling=Sampling(temperature=1.0, seed=2**64 - 2)))
    assert [r.sampling.seed for r in three] == [2**64 - 2, 2**64 - 1, 0] and {r.n for r in three} == {3}
    assert [r.sampling.seed for r in sequence_requests(Request(prompt="hi", n=2))] == [None, None]
    one = Request(prompt="hi", n=1)
    assert sequence_requests(one) == [one] and sequence_requests(Request(prompt="hi")) == [Request(prompt="hi")]


def test_n_sequences_whole_and_streamed_are_the_same_sampled_sequences(front, client):
    model = model_of(front)
    asked = {"model": model, "messages": ASK, "n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 16,
             "extra_body": PLAIN}
    whole = client.chat.completions.create(**asked)
    texts = [choice.message.content for choice in whole.choices]
    assert [choice.index for choice in whole.choices] == [0, 1, 2] and len(set(texts)) > 1  # seeds 11, 12, 13
    assert client.chat.completions.create(**asked).choices[1].message.content == texts[1]  # reproducible
    assert whole.usage.completion_tokens > 16 and whole.usage.prompt_tokens < whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts
    assert len({chunk.id for chunk in chunks}) == 1
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Greedy sequences are all plain decoding's one; completions take n too.
    greedy = client.completions.create(model=model, prompt="The sea is", n=2, temperature=0, max_tokens=8,
                                       extra_body=PLAIN)
    alone = client.completions.create(model=model, prompt="The sea is", temperature=0, max_tokens=8)
    assert [c.text for c in greedy.choices] == [alone.choices[0].text] * 2


def test_the_sequences_share_the_first_ones_prefill(front):
    """The others start once the first has its first token, so the prompt's cached blocks serve
    them: computed once, not n times (a scope of its own: nothing was cached before)."""
    prompt = " ".join(f"Line {i} of a long note about the sea and its tides." for i in range(8))
    request = Request(prompt=prompt, n=3, plain=True, max_new_tokens=4, cache_scope=f"sequences-{uuid.uuid4().hex}",
                      sampling=Sampling(temperature=1.0, seed=3))
    first, *others = generate_sequences(front.generator, request, Deadline())
    assert first.stats.prompt_tokens > 64 and first.stats.cached_prompt_tokens == 0
    for other in others:  # all but the last, partial block of the prompt
        assert other.stats.cached_prompt_tokens >= other.stats.prompt_tokens - 64, other.stats


@pytest.mark.parametrize("fields, message", [
    ({"n": 2}, "n = 2: must be 0 or 1 with parallel decoding"),
    ({"n": 17, "extra_body": PLAIN}, "n = 17: at most 16 sequences"),
    ({"n": 2**31, "extra_body": PLAIN}, "n = 2147483648: at most 16 sequences"),  # refused before n copies exist
])
def test_n_is_refused_where_the_rules_say(front, client, fields, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_of(front), messages=ASK, max_tokens=4, **fields)
    assert refused.value.body["param"] == "n" and message in refused.value.body["message"]
    # streamed: refused before a writer a sequence exists (2**70 of them held the HTTP API's loop for good)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_of(front), messages=ASK, max_tokens=4, stream=True,
                                       **{**fields, "n": fields["n"] ** 3 if fields["n"] > 16 else fields["n"]})
    assert refused.value.body["param"] == "n"


def test_a_stream_of_n_closed_early_releases_every_sequence(front, client, engine):
    stream = client.chat.completions.create(model=model_of(front), messages=ASK, n=3, temperature=1.0,
                                            max_tokens=200, stream=True, extra_body=PLAIN)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while engine.sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.sessions == 0


def test_a_huge_n_over_grpc_is_refused_at_once(stack):
    """n is a uint32 on the wire: 2**32 - 1 sequences are refused by their number, not made."""
    with pytest.raises(grpc.RpcError) as refused:
        list(stack.gateway.GenerateStream(gateway_pb2.GenerateRequest(prompt="Hi", n=2**32 - 1, max_new_tokens=2),
                                          timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n = 4294967295: at most 16 sequences" in refused.value.details()


def test_grpc_streams_n_sequences_numbered_and_generate_refuses_them(stack):
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.Message(role=gateway_pb2.ROLE_USER, content=ASK[0]["content"])], max_new_tokens=12,
        n=2, decoding=gateway_pb2.DECODING_MODE_PLAIN)
    request.sampling.temperature, request.sampling.seed = 1.0, 5
    chunks = list(stack.gateway.GenerateStream(request, timeout=120))
    texts = ["".join(c.text for c in chunks if c.index == i) for i in (0, 1)]
    assert all(texts) and sorted(c.index for c in chunks if c.finish_reason) == [0, 1]
    one = gateway_pb2.GenerateRequest()
    one.CopyFrom(request)
    one.n, one.sampling.seed = 1, 6  # the second sequence alone: seed + 1
    assert stack.gateway.Generate(one, timeout=120).text == texts[1]
    with pytest.raises(grpc.RpcError) as refused:
        stack.gateway.Generate(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("n: Generate returns one sequence")


class _Counting:
    """A generator stand-in (in process, as choices.py calls the real one): which sequences start,
    which end, sequence 0 failing before its first token or ending after one."""

    def __init__(self, first: str):
        self.first, self.started, self.closed, self.lock = first, [], [], threading.Lock()

    def stream(self, request, deadline):
        index = request.sampling.seed
        with self.lock:
            self.started.append(index)
        try:
            if index == 0 and self.first == "fails":
                raise InvalidArgument("sequence 0 is refused")
            if index == 0 and self.first == "one token":
                deadline.cancel()  # the client leaves as the first sequence's only token comes
                yield Chunk("x", [1], "stop")
                return
            yield Chunk("x", [1])
            deadline.check()
            yield Chunk("y", [2], "stop")
        finally:
            with self.lock:
                self.closed.append(index)


def test_the_others_do_not_start_once_the_request_has_ended():
    fails = _Counting("fails")
    with pytest.raises(InvalidArgument, match="sequence 0 is refused"):
        list(stream_sequences(fails, Request(prompt="p", n=3, sampling=Sampling(seed=0)), Deadline()))
    time.sleep(0.2)
    assert fails.started == [0] == fails.closed
    # The client gone as the first sequence (of one token) ended: the others never start, and the
    # consumer hears it rather than waiting for them.
    ended = _Counting("one token")
    stream = stream_sequences(ended, Request(prompt="p", n=3, sampling=Sampling(seed=0)), Deadline())
    assert next(stream)[0] == 0
    with pytest.raises(Cancelled):
        list(stream)
    assert ended.started == [0]


def test_a_batch_of_prompts_is_a_choice_each_as_each_alone(front, client):
    """vLLM's completions batch (lm-evaluation-harness sends one): a prompt's choice is its own
    request's answer, parallel decoding included; streamed the same; usage counts every prompt."""
    model, prompts = model_of(front), ["The sea is", "def add(a, b):", "Paris is the capital of"]
    alone = [client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0) for prompt in prompts]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0)
    assert [choice.text for choice in batch.choices] == [reply.choices[0].text for reply in alone]
    assert [choice.index for choice in batch.choices] == [0, 1, 2]
    assert batch.usage.prompt_tokens == sum(reply.usage.prompt_tokens for reply in alone)
    assert batch.usage.completion_tokens == sum(reply.usage.completion_tokens for reply in alone)
    chunks = list(client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(3)] == [choice.text for choice in batch.choices]
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens
    # n each (plain decoding), echoed, and prompts as token ids.
    echoed = client.completions.create(model=model, prompt=prompts[:2], max_tokens=4, temperature=0, n=2, echo=True,
                                       extra_body=PLAIN)
    assert [choice.index for choice in echoed.choices] == [0, 1, 2, 3]
    assert [choice.text.startswith(prompts[i // 2]) for i, choice in enumerate(echoed.choices)] == [True] * 4
    ids = [front.generator.model.tokenizer.encode_raw(prompt) for prompt in prompts[:2]]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert [choice.text for choice in by_ids.choices] == [choice.text for choice in batch.choices[:2]]


@pytest.mark.parametrize("prompt, message", [
    (["fine", [1.5]], "prompt[1]: "),
    (["x"] * 17, "at most 16 sequences a request"),
    (["fine", "word " * 3000], "prompt[1]: "),  # found too long as it runs: still named
    ([[1, 10**9], [3]], "prompt[0][1]: "),  # the prompt, then its token
])
def test_a_bad_batch_is_refused_naming_its_prompt(front, client, prompt, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model_of(front), prompt=prompt, max_tokens=4)
    assert message in refused.value.body["message"], refused.value.body
    if message.startswith("prompt"):  # the param names it too
        assert refused.value.body["param"] == message[:-2]
