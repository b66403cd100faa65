"""Predicted outputs (OpenAI's `prediction`; gateway/prediction.py): the pointer that follows a
prediction on literal arrays (hits, an edit, an insertion, a deletion, the end), its chain merged
into a drafter's tree and lookahead's rows given back, and end to end over HTTP, gRPC and the
light client: a greedy answer is plain decoding's token for token whatever the prediction, a
right prediction is drafted from, and the usage says which of its tokens appeared."""

from __future__ import annotations

import doctest

import grpc
import pytest

from pardec.client import Client
from pardec.gateway import openai_messages, prediction as prediction_module
from pardec.gateway.openai_api import chat_request
from pardec.gateway.openai_replies import sequences_stats
from pardec.gateway.outputs import Stats
from pardec.gateway.prediction import WINDOW, Prediction
from pardec.gateway.server import start_gateway
from pardec.runtime.draft_params import DraftParams
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import gateway_pb2
from tests import openai_front
from tests.openai_front import model_of

# An answer that copies a passage of its prompt: the prediction below is that answer.
EDIT = ("Copy this code exactly, changing nothing:\n\ndef area(width, height):\n    result = width * height\n"
        "    return result\n")


def test_the_pointer_follows_edits_insertions_and_deletions():
    assert doctest.testmod(prediction_module).failed == 0 and doctest.testmod(openai_messages).failed == 0
    predicted = [10, 11, 12, 13, 14, 15, 16, 17]
    # Right from the start: the chain is the rest, each node r^k with r = (hits + 2) / (trials + 3).
    exact = Prediction(predicted)
    exact.commit([10, 11, 12])
    tokens, parents, scores = exact.chain(3)
    assert (tokens, parents) == ([13, 14, 15], [-1, 0, 1]) and scores[0] == pytest.approx(5 / 6)
    assert scores == pytest.approx([(5 / 6) ** k for k in (1, 2, 3)])
    # An insertion: 99, 98 written after 12, then the answer goes on with 13, 14; aligned again by
    # its last 2 tokens [13, 14], first occurrence at or after where it was lost.
    inserted = Prediction(predicted)
    inserted.commit([10, 11, 12, 99, 98])
    assert inserted.chain(4) == ([], [], [])  # lost
    inserted.commit([13, 14])
    assert inserted.chain(2)[0] == [15, 16] and (inserted.accepted, inserted.rejected) == (5, 3)
    # A deletion: 13..14 never written; 15 right after 12 misses, then [15, 16] aligns at 17.
    deleted = Prediction(predicted)
    deleted.commit([10, 11, 12, 15, 16])
    assert deleted.chain(8)[0] == [17] and (deleted.accepted, deleted.rejected) == (5, 3)
    # A substitution of one token: aligned again 2 tokens after it.
    swapped = Prediction(predicted)
    swapped.commit([10, 11, 50, 13, 14])
    assert swapped.chain(1)[0] == [15] and swapped.accepted == 4
    # Past the prediction's end: nothing to draft, and the answer's extra tokens count no miss.
    ended = Prediction([1, 2])
    ended.commit([1, 2, 3, 4])
    assert ended.chain(4) == ([], [], []) and (ended.accepted, ended.rejected) == (2, 0)
    # A repeated stretch: aligned at the occurrence at or after where the pointer was lost, else the last before.
    repeated = Prediction([1, 2, 3, 7, 1, 2, 3, 8])
    repeated.commit([1, 2, 3, 9, 1, 2, 3])  # lost at index 3: [1, 2] aligns on the copy after it
    assert repeated.chain(1)[0] == [8]
    back = Prediction([5, 6, 1, 2, 9])
    back.commit([5, 6, 1, 2, 9, 0, 1, 2])  # lost at the end: the only [1, 2] lies before it
    assert back.chain(1)[0] == [9]
    # The record halves at WINDOW trials, so that a change of regime shows soon.
    long = Prediction(list(range(WINDOW * 2)))
    long.commit(list(range(WINDOW)))
    assert long.chain(1)[2] == pytest.approx([(WINDOW // 2 + 2) / (WINDOW // 2 + 3)])
    assert Prediction([]).chain(4) == ([], [], [])
    # Each answer token marks one prediction token at most: aligning again on tokens that were
    # hits does not count them twice (the answer [1, 2, 3] holds 3 of the prediction's 5).
    for tokens, answer, accepted in (([1, 2, 1, 2, 3], [1, 2, 3], 3), ([3, 1, 3, 4, 3], [3, 4], 2),
                                     ([1, 2, 9, 1, 2, 3], [1, 2, 3], 3)):
        counted = Prediction(tokens)
        counted.commit(answer)
        assert (counted.accepted, counted.rejected) == (accepted, len(tokens) - accepted)
    # However a step's tokens are cut, the pointer, its record and its counts are the same.
    whole, pieces = Prediction(list(range(200))), Prediction(list(range(200)))
    whole.commit(list(range(70)) + [999, 70, 71])
    for piece in (range(64), range(64, 70), [999], [70, 71]):
        pieces.commit(list(piece))
    assert whole.chain(3) == pieces.chain(3) and whole.accepted == pieces.accepted


def test_the_chain_joins_the_drafters_tree_and_lookahead_gets_its_rows_back():
    def flat(tokens: int) -> float:  # every step costs the same: every likely node pays
        return 10.0

    follower = Prediction([7, 8, 9])
    # The drafter's tree: 5 (0.5), 7 (0.4), and 8 under 7 (0.3). The chain 7, 8, 9 (2/3, 4/9, 8/27)
    # shares the path [7, 8]: a node is its path, its score the higher one.
    tokens, parents = follower.tree(([5, 7, 8], [-1, -1, 1], [0.5, 0.4, 0.3]), max_depth=3, max_nodes=8,
                                    step_ms=flat, min_gain=1.0)
    assert (tokens, parents) == ([7, 5, 8, 9], [-1, -1, 0, 2])
    # The verifier's argmax after the root and after each node, in the merged order; the drafter
    # (lookahead) reads them by its own indexes: its nodes 5, 7, 8 are rows 2, 1, 3 of the merged tree.
    assert follower.drafter_rows([100, 101, 102, 103, 104]) == [100, 102, 101, 103]
    # A budget of 2 nodes keeps 7 and 5; the drafter's rows stop at its first node not verified (8).
    follower.tree(([5, 7, 8], [-1, -1, 1], [0.5, 0.4, 0.3]), 3, 2, flat, 1.0)
    assert follower.drafter_rows([100, 101, 102]) == [100, 102, 101]
    # No chain (a depth of 0, or lost): the drafter's tree as it is, its rows as they are.
    assert follower.tree(([5], [-1], [0.5]), 0, 8, flat, 1.0) == ([5], [-1])
    assert follower.drafter_rows([100, 101]) == [100, 101]
    assert follower.tree(([], [], []), 3, 0, flat, 1.0) == ([], [])  # no room left in the session
    # Where a node costs as much as a step, nothing but the plain step pays.
    assert follower.tree(([], [], []), 3, 8, lambda n: 10.0 * n, 1.0) == ([], [])


def test_the_counts_of_a_requests_sequences_are_summed_alike_streamed_or_not():
    # Two prompts of n = 2 sequences: prompt tokens from each prompt's first, predictions from all.
    each = {index: Stats(prompt_tokens=10 + index, prediction_tokens=8, accepted_prediction_tokens=index)
            for index in range(4)}
    stats = sequences_stats(each, n=2)
    assert (stats.prompt_tokens, stats.prediction_tokens, stats.accepted_prediction_tokens) == (22, 32, 6)


def test_the_field_is_read_and_refused_as_openai_spells_it():
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    parts = {"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert chat_request({**body, "prediction": parts}, "", "m").prediction == "ab"
    assert chat_request({**body, "prediction": None}, "", "m").prediction == ""
    for value, named in (("text", "prediction: must be"), ({"content": "x"}, "prediction: must be"),
                         ({"type": "content", "content": 3}, "prediction.content: must be a string"),
                         ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content[0]: only text")):
        with pytest.raises(InvalidArgument, match=named.replace("[", r"\[").replace("]", r"\]")):
            chat_request({**body, "prediction": value}, "", "m")


@pytest.fixture(scope="module")
def lookahead_front(stack):
    running = start_gateway(openai_front.gateway_config(stack, draft=DraftParams("la", level=4, window=5, guess_set_size=5)),
                            "127.0.0.1:0", http_address="127.0.0.1:0")
    yield running
    running.stop()


def _usage_of(reply) -> dict:
    return reply.usage.model_dump()


def test_a_prediction_is_drafted_from_and_changes_no_token(front, client, lookahead_front):
    model = model_of(front)
    asked = {"model": model, "messages": [{"role": "user", "content": EDIT}], "temperature": 0, "max_tokens": 48}
    plain = client.chat.completions.create(**asked, extra_body={"parallel_decoding": False})
    free = plain.choices[0].message.content
    assert "result" in free, free
    assert "completion_tokens_details" not in (_usage_of(plain) or {}) or not (
        _usage_of(plain)["completion_tokens_details"] or {}).get("accepted_prediction_tokens")
    right = client.chat.completions.create(**asked, extra_body={"prediction": {"type": "content", "content": free}})
    assert right.choices[0].message.content == free  # lossless
    usage = _usage_of(right)
    details, pardec = usage["completion_tokens_details"], right.usage.model_extra["pardec"]
    predicted = len(front.generator.model.tokenizer.encode_text(free))
    assert details["accepted_prediction_tokens"] >= predicted - 2 and details["rejected_prediction_tokens"] <= 2
    assert pardec["accepted_draft_tokens"] > 0 and pardec["steps"] < usage["completion_tokens"] / 2, pardec
    # A prediction with an edit in it, one that is wrong throughout, and plain decoding with one:
    # the same tokens every time; the usage counts what of each prediction appeared.
    edited = free.replace("result", "product", 1)
    for prediction, decoding in ((edited, True), ("Nothing like the answer at all. " * 4, True), (free, False)):
        reply = client.chat.completions.create(**asked, extra_body={
            "prediction": {"type": "content", "content": prediction}, "parallel_decoding": decoding})
        assert reply.choices[0].message.content == free, prediction
        counts = _usage_of(reply)["completion_tokens_details"]
        total = len(front.generator.model.tokenizer.encode_text(prediction))
        assert counts["accepted_prediction_tokens"] + counts["rejected_prediction_tokens"] == total
        if prediction == edited:
            assert 0 < counts["rejected_prediction_tokens"] < 6
    # Lookahead reads the verifier's argmax by its own nodes' indexes: still plain decoding's tokens.
    import openai

    with openai.OpenAI(base_url=f"http://{lookahead_front.http_address}/v1", api_key="unused", max_retries=0,
                       timeout=300) as lookahead:
        for extra in ({}, {"prediction": {"type": "content", "content": edited}}):
            answer = lookahead.chat.completions.create(**asked, extra_body=extra)
            assert answer.choices[0].message.content == free, extra
    assert answer.usage.model_extra["pardec"]["decoding_method"] == "la"
    # Streamed, with the usage at the end; and the completions API takes a prediction too.
    stream = client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True},
                                            extra_body={"prediction": {"type": "content", "content": free}})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == free
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == details["accepted_prediction_tokens"]
    completion = client.completions.create(model=model, prompt=EDIT, temperature=0, max_tokens=24,
                                           extra_body={"prediction": {"type": "content", "content": EDIT}})
    assert completion.usage.completion_tokens_details.accepted_prediction_tokens >= 0


def test_grpc_and_the_light_client_carry_it(front, stack):
    free = stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt=EDIT, max_new_tokens=40)).text
    reply = stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt=EDIT, max_new_tokens=40, prediction=free))
    assert reply.text == free and reply.stats.accepted_prediction_tokens > 0
    assert reply.stats.rejected_prediction_tokens <= 2
    with Client(front.address, timeout=120) as light:
        answer = light.generate(EDIT, max_new_tokens=40, prediction=free)
    assert answer.text == free and answer.stats.accepted_prediction_tokens == reply.stats.accepted_prediction_tokens
    # A prediction longer than any answer could be is refused, naming the field and the bound.
    too_long = "word " * (front.generator.model.max_seq_len + 10)
    with pytest.raises(grpc.RpcError) as refused:
        stack.gateway.Generate(gateway_pb2.GenerateRequest(prompt="hi", prediction=too_long))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("prediction: ") and "maxSeqLen" in refused.value.details()
