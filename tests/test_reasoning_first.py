"""A structured output after a reasoning model's thinking (verifier/structured_output.py
thinking_first, gateway/answers.py AnswerFormat.constrained): the language holds the text after
the <think> block, which is free text up to its first </think>; read on literal texts over the
bundled vocabulary, with the tags as text and as control tokens, and the gateway's choice of where
the thinking stands. End to end (a served thinking template): tests/test_reasoning.py."""

from __future__ import annotations

import dataclasses
import json

import llguidance
import pytest

from pardec.gateway.answers import AnswerFormat
from pardec.gateway.chat import template_variables
from pardec.gateway.generation import Request
from pardec.gateway.tools import Tool, ToolUse
from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2
from pardec.verifier.api import Sampling
from pardec.verifier.structured_output import StructuredOutput, thinking_first
from tests.steps import language_reads
from tests.openai_front import with_template
from tests.test_reasoning import HYBRID, OFF, THINKING

ANSWER = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]})


@pytest.mark.parametrize("text, opened, block", [
    ('<think>\nTwo and two.\n</think>\n\n{"answer": 4}', "whole", "whole"),  # opened: "<think>" is thought
    ('Two and two.\n</think>\n\n{"answer": 4}', "whole", "refused"),
    ('</think>{"answer": 4}', "whole", "refused"),  # an empty thought
    ('{"answer": 4}', "prefix", "whole"),  # opened: this is thinking still; block: no block at all
    ('\n{"answer": 4}', "prefix", "refused"),  # without a block, the answer from the first token
    ('\n <think>\nTwo.\n</think>\n{"answer": 4}', "whole", "whole"),  # whitespace before the block: the layout's
    ('<think>\nmaybe </thi nk> or {"answer": 3}', "prefix", "prefix"),  # all thinking yet
    ('<think>\na </think> b </think>\n{"answer": 4}', "refused", "refused"),  # the first </think> ends it
    ('<think>\nTwo.\n</think>\n\n{"answer": "four"}', "refused", "refused"),  # the answer still its schema's
])
def test_the_language_holds_the_text_after_the_first_closing_tag(engine, text, opened, block):
    assert language_reads(engine, StructuredOutput("json_schema", ANSWER, "open"), text) == opened
    assert language_reads(engine, StructuredOutput("json_schema", ANSWER, "block"), text) == block
    assert language_reads(engine, StructuredOutput("json_schema", ANSWER), '{"answer": 4}') == "whole"


def test_every_kind_of_language_and_tool_calls_follow_the_thinking(engine):
    for kind, spec, word in (("regex", r"\d+", "42"), ("choice", ("yes", "no"), "no"),
                             ("grammar", 'start: "a" B\nB: /b+/', "abb"), ("json_object", "", "{}")):
        assert language_reads(engine, StructuredOutput(kind, spec, "block"), f"<think>\nhm\n</think>\n{word}") == "whole"
    calls = AnswerFormat(with_template(engine.tokenizer, HYBRID)).constrained(
        Request(messages=(), tools=ToolUse((Tool("get_time"),), choice="required")))
    assert calls.structured_output.reasoning == "block"
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert language_reads(engine, calls.structured_output, f"<think>\nThe user wants the time.\n</think>\n\n{call}") == "whole"


def test_tags_that_are_control_tokens_close_the_thinking_as_tokens(engine):
    """A vocabulary whose tags are control tokens: the thinking is the text between them (here
    SmolLM2's <|im_start|> and <|im_end|> stand for them), and their spellings in text are text."""
    start, end = (engine.tokenizer.encode(tag)[0] for tag in ("<|im_start|>", "<|im_end|>"))
    text = engine.tokenizer.encode_text
    language = StructuredOutput("choice", ("yes", "no")).grammar()

    def reads(opened, tokens):
        grammar = thinking_first(language, opened, special_tags=True, tags=("<|im_start|>", "<|im_end|>"))
        matcher = llguidance.LLMatcher(engine.grammars._llg_tokenizer(), grammar, log_level=0)
        return all(matcher.consume_token(token) for token in tokens) and matcher.is_accepting()

    assert reads(False, [start, *text("a <|im_end|> b"), end, *text("\n\nyes")])
    assert reads(False, text("yes")) and reads(False, [start, end, *text("no")])
    assert reads(False, [*text("\n "), start, *text("a"), end, *text("yes")])  # whitespace first: the layout's
    assert not reads(False, text("<|im_start|>a<|im_end|>yes"))  # spelled as text: not the tags
    assert reads(True, [*text("hmm"), end, *text("yes")]) and not reads(True, text("yes"))


def test_the_gateway_puts_the_language_after_the_thinking_where_the_template_thinks(engine):
    json_answer = Sampling(structured_output=StructuredOutput("json_schema", ANSWER))

    def reasoning(template, **fields):
        request = Request(messages=(), sampling=fields.pop("sampling", json_answer), **fields)
        language = AnswerFormat(with_template(engine.tokenizer, template)).constrained(request).structured_output
        return language.reasoning

    assert reasoning(THINKING) == "open" and reasoning(HYBRID) == "block"  # opened by the turn opening, or not
    assert reasoning(THINKING, chat_template_kwargs=template_variables(OFF)) == "block"
    assert reasoning(engine.tokenizer.chat_template) == "none"  # SmolLM2 does not think
    assert reasoning(THINKING, prompt_token_ids=(1, 2)) == "none"  # no template, no thinking set apart
    # A language that writes </think> itself holds the whole answer, thinking included.
    spelled = Sampling(structured_output=StructuredOutput("regex", "[a-z ]+</think>[a-z]+"))
    assert reasoning(THINKING, sampling=spelled) == "none"
    assert AnswerFormat(with_template(engine.tokenizer, THINKING)).constrained(Request(messages=())).structured_output is None


def test_where_the_thinking_stands_travels_on_the_wire_and_is_checked():
    for reasoning in ("none", "block", "open"):
        for language in (StructuredOutput("choice", ("a",), reasoning), StructuredOutput("json_object", "", reasoning)):
            assert StructuredOutput.from_proto(language.to_proto()) == language
    with pytest.raises(InvalidArgument, match=r"^sampling.structured_output.reasoning: 7 is not a Reasoning"):
        StructuredOutput.from_proto(common_pb2.StructuredOutput(regex="a", reasoning=7))
    with pytest.raises(InvalidArgument, match=r"^sampling.structured_output.reasoning: must be one of"):
        dataclasses.replace(StructuredOutput("regex", "a"), reasoning="later")
