"""Bad words (vLLM's bad_words; verifier/engine/bad_words.py, path_rules.py): the rule on literal
token arrays, its bans on a literal tree (yielding to every other rule; no mask where nothing is banned), the words' spellings, the
limits named, and end to end over HTTP, gRPC and the light client: the answer never holds a
banned word, and parallel decoding, whose drafts hold it, gives plain decoding's tokens."""

from __future__ import annotations

import doctest
import re
from math import inf

import grpc
import pytest
import torch

from pardec.client import Client
from pardec.gateway.answers import AnswerFormat
from pardec.gateway.generation import Request
from pardec.gateway.openai_api import chat_request
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2, gateway_pb2
from pardec.verifier.api import MAX_BAD_WORDS, Sampling
from pardec.verifier.engine import bad_words, path_rules
from pardec.verifier.engine.acceptance import constrain, tree_layout
from pardec.verifier.engine.bad_words import BannedSequences, word_sequences
from pardec.verifier.engine.path_rules import RuledMatcher
from pardec.verifier.engine.thinking_budget import ThinkingBounds
from tests.openai_front import model_of

# An answer that repeats its prompt: the drafts (the prompt's n-grams) hold the word banned below.
ECHO = "Repeat this sentence twice: The capital of France is Paris, and Paris is lovely."


def _rows(allowed) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in allowed]


def test_the_rule_and_its_bans_on_a_literal_tree():
    assert doctest.testmod(bad_words).failed == 0 and doctest.testmod(path_rules).failed == 0
    matcher = RuledMatcher([], vocab_size=5, bans=BannedSequences([(3,), (1, 2)]))
    matcher.advance([1])  # the root: the session's last token, 1
    # Under the root: 2 (row 1, banned after 1: never computed), 1 (row 2), then 2 under it (row 3, banned too).
    layout = tree_layout(1, [2, 1, 2], [-1, -1, 1], 5)
    cut = matcher.mask_tree([2, 1, 2], layout)
    assert (cut.kept, cut.tokens, cut.allowed, cut.banned) == ([0, 2], [1], None, ((3, 2), (3, 2)))
    assert constrain(torch.zeros(2, 5), cut.layout.depths, 0, Sampling(), cut.allowed, cut.banned).tolist() == [
        [0.0, 0.0, -inf, -inf, 0.0]] * 2
    # Where no row is banned or masked, no mask is made at all: the tree is computed whole, as without rules.
    free = RuledMatcher([], vocab_size=5, bans=BannedSequences([(1, 2)]))
    assert free.mask_tree([3], tree_layout(0, [3], [-1], 5)) is None
    # A ban yields to every other rule: a forced thinking tag, allowed_token_ids, min_tokens.
    bounds = ThinkingBounds(budget=0, opened=True, token_bytes=lambda t: b"<" if t == 4 else b"x",
                            encode=lambda text: [4], closing_token=4)
    forced = RuledMatcher([bounds], vocab_size=5, bans=BannedSequences([(4,)])).mask_tree([], tree_layout(0, [], [], 5))
    assert _rows(forced.allowed) == [[4]] and forced.banned == ((4,),)
    assert constrain(torch.zeros(1, 5), torch.tensor([0]), 0, Sampling(), forced.allowed, forced.banned).argmax() == 4
    only = Sampling(allowed_token_ids=(3, 5), min_tokens=1, stop_token_ids=(5,))  # 5 held back: 3 is all there is
    assert constrain(torch.zeros(1, 6), torch.tensor([0]), 0, only, None, [[3]]).tolist() == [[-inf] * 3 + [0.0] + [-inf] * 2]


def test_words_are_spelled_as_the_vocabulary_writes_them_and_bounded(engine):
    encode = engine.tokenizer.encode_text
    assert word_sequences(encode, ["Paris"]) == (tuple(encode("Paris")), tuple(encode(" Paris")))
    for words, message in ((["x"] * 65, "bad_words: at most 64 words"), (["", "a"], "bad_words[0]: must be 1 to 100"),
                           (["a", "ʬ" * 40], "bad_words[1]: 'ʬʬʬ")):
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            word_sequences(encode, words)
    sampling = Sampling(bad_words=((1, 2), (3,)))
    assert Sampling.from_proto(sampling.to_proto()) == sampling
    for words, message in ((((1,),) * (MAX_BAD_WORDS + 1), "sampling.bad_words: at most 128"),
                           (((),), r"sampling.bad_words\[0\]: must hold 1 to 32")):
        with pytest.raises(InvalidArgument, match=message):
            Sampling(bad_words=words)
    for wrong in ("Paris", "", 0, {}, [1]):
        with pytest.raises(InvalidArgument, match="bad_words: must be an array of strings"):
            chat_request({"messages": [{"role": "user", "content": "hi"}], "bad_words": wrong}, "", "m")
    asked = chat_request({"messages": [{"role": "user", "content": "hi"}], "bad_words": ["Paris"]}, "", "m")
    answers = AnswerFormat(engine.tokenizer)
    constrained = answers.constrained(asked)
    assert constrained.bad_words == word_sequences(encode, ["Paris"])
    again = answers.constrained(Request(prompt="hi", sampling=constrained, bad_words=("Paris",)))
    assert again.bad_words == constrained.bad_words  # constrained twice, each spelling once


def test_a_banned_word_is_never_generated_lossless(front, client, stack):
    model = model_of(front)
    asked = {"model": model, "messages": [{"role": "user", "content": ECHO}], "temperature": 0, "max_tokens": 40}
    free = client.chat.completions.create(**asked).choices[0].message.content
    assert "Paris" in free, free
    replies = [client.chat.completions.create(**asked, extra_body={"bad_words": ["Paris"], "parallel_decoding": on})
               for on in (True, False)]
    text = replies[0].choices[0].message.content
    assert "Paris" not in text and text != free
    assert replies[1].choices[0].message.content == text  # lossless
    assert replies[0].usage.model_extra["pardec"]["draft_tokens"] > 0  # drafts were verified under the ban
    streamed = client.chat.completions.create(**asked, stream=True, extra_body={"bad_words": ["Paris"]})
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == text
    raw = client.completions.create(model=model, prompt=ECHO + "\n", temperature=0, max_tokens=24,
                                    extra_body={"bad_words": ["Paris", "France"]}).choices[0].text
    assert "Paris" not in raw and "France" not in raw
    with Client(front.address, timeout=120) as light:  # gRPC, through the light client
        assert light.generate(ECHO, max_new_tokens=40, bad_words="Paris").text == text  # one string: one word
    # gRPC clients may send token ids too: banning " Paris" alone leaves "Paris" free.
    spaced = word_sequences(front.generator.model.tokenizer.encode_text, [" Paris"])
    reply = stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt=ECHO, max_new_tokens=40, sampling=common_pb2.SamplingParams(
        bad_words=[common_pb2.TokenSequence(token_ids=tokens) for tokens in spaced])))
    assert " Paris" not in reply.text
    with pytest.raises(grpc.RpcError) as refused:
        stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt="hi", bad_words=["x" * 101]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bad_words[0]: must be 1 to 100 characters" in refused.value.details()
