"""A reasoning model's thinking bounded (verifier/engine/thinking_budget.py; vLLM's
thinking_token_budget, Anthropic's budget_tokens, gRPC's SamplingParams.thinking_budget): the rule
on literal token arrays, its masks on a literal tree, and end to end on a verifier serving a
thinking template, where the thinking stops at its budget with </think> and parallel decoding
gives plain decoding's tokens."""

from __future__ import annotations

import dataclasses
import doctest
import json

import openai
import pytest

from pardec.client import Client
from pardec.gateway.answers import AnswerFormat
from pardec.gateway.chat import ASSISTANT, USER, Message
from pardec.gateway.generation import Request
from pardec.gateway.openai_api import chat_request
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2
from pardec.verifier.api import Sampling, ThinkingBudget
from pardec.verifier.engine import thinking_budget
from pardec.verifier.engine.acceptance import tree_layout
from pardec.verifier.engine.path_rules import RuledMatcher
from pardec.verifier.engine.thinking_budget import ThinkingBounds
from tests.openai_front import serving_template, with_template
from tests.test_reasoning import HYBRID, SHOTS, SUM, THINKING

STOP = 0  # the toy vocabulary's end of sequence; every other id is one byte


def _spell(text: str) -> list[int]:
    return [ord(char) for char in text]


def _token_bytes(token: int) -> bytes:
    return b"</think>" if token == 300 else bytes([token])  # 300: the tag as one token, where a test says so


def _bounds(budget: int, opened: bool, closing_token: int | None = None) -> ThinkingBounds:
    return ThinkingBounds(budget, opened, _token_bytes, _spell, closing_token)


def _forced_after(bounds: ThinkingBounds, text_or_ids) -> int | None:
    state = bounds.start()
    for token in (_spell(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids):
        state = bounds.step(state, token)
    return bounds.forced(state)


def test_the_rule_on_literal_tokens():
    assert doctest.testmod(thinking_budget).failed == 0
    opened = _bounds(3, opened=True)
    assert _forced_after(opened, "") is None and _forced_after(opened, "ab") is None
    assert _forced_after(opened, "abc") == ord("<")  # three tokens of thinking: the whole tag is due
    assert _forced_after(opened, "abc</th") == ord("i")  # on course: the rest of it, one token at a time
    assert _forced_after(opened, "abc</think>") is None  # closed: free again, for good
    assert _forced_after(opened, "abc</think>" + "x" * 20) is None
    assert _forced_after(opened, "a</") == ord("<")  # the model had begun the tag: the whole tag still, as vLLM
    assert _forced_after(opened, "</think>" + "x" * 9) is None  # closed within its budget: never forced
    assert _forced_after(_bounds(0, opened=True), "") == ord("<")  # a budget of 0: the tag at once
    block = _bounds(2, opened=False)
    assert _forced_after(block, "ab") is None and _forced_after(block, "hello") is None  # no thinking: free
    assert _forced_after(block, "<think>") is None and _forced_after(block, "<think>xy") == ord("<")
    assert _forced_after(block, [*_spell("<think>x"), STOP]) == ord("<")  # past the end (ignore_eos): counted
    assert _forced_after(block, "\n <think>xy") == ord("<")  # the layout's whitespace before the tag
    controlled = _bounds(1, opened=True, closing_token=300)  # a vocabulary whose </think> is one token
    assert _forced_after(controlled, "a") == 300 and _forced_after(controlled, [*_spell("a"), 300, 120]) is None


def test_the_masks_on_a_literal_tree():
    # Budget 1, opened: after one token the path must write "<". Tree under the root "a":
    # "<" (row 1) then "/" (row 2); "x" (row 3, forbidden: its parent row must write "<").
    matcher = RuledMatcher([_bounds(1, opened=True)], vocab_size=128)
    matcher.advance([ord("a")])  # the root: the session's last token
    layout = tree_layout(ord("a"), _spell("</x"), [-1, 0, -1], 128)
    cut = matcher.mask_tree(_spell("</x"), layout)
    assert cut.kept == [0, 1, 2] and cut.tokens == _spell("</")  # "x" is never computed
    assert [row.nonzero().flatten().tolist() for row in cut.allowed] == [[ord("<")], [ord("/")], [ord("t")]]
    matcher.advance(_spell("</think>"))
    assert matcher.mask_tree([], tree_layout(0, [], [], 128)) is None  # closed: free again, no mask made


def test_a_budget_travels_and_is_opened_where_the_template_opens_the_block(engine):
    sampling = Sampling(thinking_budget=ThinkingBudget(7, opened=True))
    assert Sampling.from_proto(sampling.to_proto()) == sampling
    with pytest.raises(InvalidArgument, match="sampling.thinking_budget.tokens"):
        ThinkingBudget(-1)
    with pytest.raises(InvalidArgument, match="thinking_token_budget: must be in"):
        chat_request({"messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": -2}, "", "m")
    asked = chat_request({"messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": 5}, "", "m")
    assert asked.sampling.thinking_budget == ThinkingBudget(5)
    for template, opened in ((THINKING, True), (HYBRID, False)):
        answers = AnswerFormat(with_template(engine.tokenizer, template))
        assert answers.constrained(asked).thinking_budget == ThinkingBudget(5, opened)
    budget = Sampling(thinking_budget=ThinkingBudget(4))
    raw = Request(prompt="Q: 2+2?\n<think>\n", raw=True, sampling=budget)
    answers = AnswerFormat(engine.tokenizer)
    assert answers.constrained(raw).thinking_budget.opened  # the prompt opened it
    # A prompt left inside its block, however it comes: text, token ids, a continued message.
    begun = "Q: 2+2?\n<think>\nLet me add"
    assert answers.constrained(dataclasses.replace(raw, prompt=begun)).thinking_budget.opened
    assert not answers.constrained(dataclasses.replace(raw, prompt=begun + "</think>\n")).thinking_budget.opened
    ids = Request(prompt_token_ids=tuple(engine.tokenizer.encode_text(begun)), sampling=budget)
    assert answers.constrained(ids).thinking_budget.opened
    continued = Request(messages=(Message(USER, "2+2?"), Message(ASSISTANT, "<think>\nHm")), sampling=budget,
                        continue_final_message=True)
    assert answers.constrained(continued).thinking_budget.opened
    assert common_pb2.SamplingParams(thinking_budget=common_pb2.ThinkingBudget(tokens=3)).HasField("thinking_budget")


def test_the_thinking_stops_at_its_budget_lossless_whole_and_streamed(stack, engine):
    closing = len(engine.tokenizer.encode_text("</think>"))
    with serving_template(stack, engine, THINKING) as front:
        client = openai.OpenAI(base_url=f"http://{front.http_address}/v1", api_key="none", max_retries=0)
        model = front.generator.model.model_name
        free = client.chat.completions.create(model=model, messages=SHOTS, temperature=0, max_tokens=40)
        thought = free.usage.completion_tokens_details.reasoning_tokens
        assert thought > closing + 3, free  # the model's own thinking is longer than the budget below
        replies = [client.chat.completions.create(
            model=model, messages=SHOTS, temperature=0, max_tokens=40,
            extra_body={"thinking_token_budget": 3, "parallel_decoding": on}) for on in (True, False)]
        bounded = replies[0]
        assert bounded.usage.completion_tokens_details.reasoning_tokens == 3 + closing  # three, then </think>
        thinking = bounded.choices[0].message.model_extra["reasoning_content"]
        assert free.choices[0].message.model_extra["reasoning_content"].startswith(thinking.rstrip())
        assert bounded.choices[0].message.content  # it answers after the forced tag
        # Lossless: parallel decoding under a budget gives plain decoding's tokens.
        assert [(r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content)
                for r in replies[1:]] == [(thinking, bounded.choices[0].message.content)]
        chunks = list(client.chat.completions.create(model=model, messages=SHOTS, temperature=0, max_tokens=40,
                                                     stream=True, extra_body={"thinking_token_budget": 3}))
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thinking
        assert "".join(d.content or "" for d in deltas) == bounded.choices[0].message.content
        # With a structured output after the thinking: both hold, the tag first, then the schema.
        shaped = [client.chat.completions.create(
            model=model, messages=SHOTS, temperature=0, max_tokens=40, response_format=SUM,
            extra_body={"thinking_token_budget": 3, "parallel_decoding": on}).choices[0].message for on in (True, False)]
        assert shaped[0].model_extra["reasoning_content"] == thinking and "answer" in json.loads(shaped[0].content)
        assert (shaped[1].model_extra["reasoning_content"], shaped[1].content) == (thinking, shaped[0].content)
        # A raw prompt that opens the block is bounded from its first token.
        prompt = with_template(engine.tokenizer, THINKING).render_chat(SHOTS, None, None)
        texts = [client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=24,
                                           extra_body={"thinking_token_budget": 2, "parallel_decoding": on}).
                 choices[0].text for on in (True, False)]
        assert texts[0] == texts[1] and "</think>" in texts[0]
        assert len(engine.tokenizer.encode_text(texts[0][:texts[0].index("</think>")])) <= 2 + 1
        with Client(front.address, timeout=120) as light:  # gRPC, through the light client
            reply = light.chat(SHOTS, max_new_tokens=40, thinking_budget=3)
            assert (reply.reasoning_content, reply.text) == (thinking, bounded.choices[0].message.content)
