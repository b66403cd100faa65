"""Structured output (verifier/structured_output.py, verifier/engine/grammar.py): the output held
to a JSON Schema, a regular expression, a choice or a grammar. Each row of a tree is masked by
its own path only, so parallel decoding under a language stays token-for-token plain decoding's;
checked on the masks of a literal tree, through the gateway over gRPC and over HTTP."""

from __future__ import annotations

import json
import re

import grpc
import openai
import pydantic
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2, gateway_pb2
from pardec.verifier.api import Sampling
from pardec.verifier.engine.acceptance import constrain, tree_layout
from pardec.verifier.structured_output import StructuredOutput
from tests.fuzzing import FUZZ
from tests.openai_front import model_of

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# The prompt spells the answer out: memory decoding drafts from it, so trees are accepted.
PROMPT = 'Reply with JSON only. Alice is 31 years old. {"name": "Alice", "age": 31}'


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode_text(text)


def test_each_row_allows_what_its_own_path_allows(engine):
    vocab = engine.model.args.vocab_size
    matcher = engine.grammars.matcher(StructuredOutput("choice", ("yes", "no")))
    yes, no, comma = (_ids(engine, text) for text in ("yes", "no", ","))
    assert len(yes) == len(no) == len(comma) == 1
    # Root row; node 0 "yes", node 1 "no" (children of the root); node 2 "," under "yes".
    layout = tree_layout(0, [yes[0], no[0], comma[0]], [-1, -1, 0], vocab)
    before = matcher.allowed_rows(layout)
    stops = sorted(engine.tokenizer.stop_token_ids)
    assert yes[0] in before[0].nonzero().squeeze(1).tolist() and before[0, comma[0]].item() is False
    assert before[1].nonzero().squeeze(1).tolist() == stops == before[2].nonzero().squeeze(1).tolist()
    assert before[3].all()  # "," after "yes" leaves the language: never accepted, left unmasked
    # The walk rolled the matcher back: the same masks again; then the session moves on.
    assert torch.equal(matcher.allowed_rows(layout), before)
    matcher.advance(yes)
    alone = tree_layout(0, [], [], vocab)
    assert matcher.allowed_rows(alone)[0].nonzero().squeeze(1).tolist() == stops
    # Past a stop token the output is whole: only stop tokens from then on (ignore_eos).
    matcher.advance([stops[0], yes[0]])
    assert matcher.ended and matcher.allowed_rows(alone)[0].nonzero().squeeze(1).tolist() == stops


def test_the_language_wins_over_rules_that_leave_a_row_nothing():
    rules = Sampling(min_tokens=4, stop_token_ids=(0,), logit_bias=((1, 5.0),))
    allowed = torch.tensor([[True, False, False], [False, True, True]])
    out = constrain(torch.zeros(2, 3), torch.tensor([0, 1]), 0, rules, allowed)
    assert out.tolist() == [[0.0, float("-inf"), float("-inf")], [float("-inf"), 5.0, 0.0]]


@pytest.mark.parametrize("kind, spec, field", [
    ("regex", "(a", "sampling.structured_output.regex"),
    ("json_schema", "[1, 2]", "sampling.structured_output.json_schema"),
    ("json_schema", '{"type": "objectt"}', "sampling.structured_output.json_schema"),
    ("choice", ("a", ""), "sampling.structured_output.choice"),
    ("grammar", "start: undefined_rule", "sampling.structured_output.grammar"),
])
def test_a_bad_language_is_refused_naming_its_field(kind, spec, field):
    with pytest.raises(InvalidArgument, match=re.escape(field)):
        StructuredOutput(kind, spec)


def _generate(stack, language: common_pb2.StructuredOutput, plain: bool, prompt: str = PROMPT, **sampling):
    request = gateway_pb2.GenerateRequest(
        prompt=prompt, max_new_tokens=48, sampling=common_pb2.SamplingParams(structured_output=language, **sampling),
        decoding=gateway_pb2.DECODING_MODE_PLAIN if plain else gateway_pb2.DECODING_MODE_DEFAULT)
    return stack.gateway.Generate(request, timeout=120)


LANGUAGES = [
    (common_pb2.StructuredOutput(json_schema=json.dumps(PERSON)),
     lambda text: set(json.loads(text)) == {"name", "age"} and isinstance(json.loads(text)["age"], int)),
    (common_pb2.StructuredOutput(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    (common_pb2.StructuredOutput(regex=r"[A-Z][a-z]+ is [0-9]{1,3}\."),
     lambda text: re.fullmatch(r"[A-Z][a-z]+ is [0-9]{1,3}\.", text) is not None),
    (common_pb2.StructuredOutput(choice=common_pb2.Choices(values=["Alice", "Bob", "31"])),
     lambda text: text in ("Alice", "Bob", "31")),
    (common_pb2.StructuredOutput(grammar='start: "age=" NUMBER\nNUMBER: /[0-9]+/'),
     lambda text: re.fullmatch(r"age=[0-9]+", text) is not None),
]


@pytest.mark.parametrize("language, holds", LANGUAGES, ids=["json_schema", "json_object", "regex", "choice", "grammar"])
def test_parallel_decoding_under_a_language_is_plain_decoding(stack, language, holds):
    plain = _generate(stack, language, plain=True)
    assert plain.finish_reason == "eos" and holds(plain.text), plain.text
    parallel = _generate(stack, language, plain=False)
    assert list(parallel.token_ids) == list(plain.token_ids)
    sampled = _generate(stack, language, plain=False, temperature=1.0, seed=7)
    assert sampled.finish_reason != "eos" or holds(sampled.text), sampled.text


def test_a_json_schema_answer_is_drafted_and_accepted(stack):
    answer = _generate(stack, LANGUAGES[0][0], plain=False)
    assert answer.stats.accepted_draft_tokens > 0 and answer.stats.steps < len(answer.token_ids), answer.stats


def test_a_bad_language_over_grpc_is_invalid_argument(stack):
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stack, common_pb2.StructuredOutput(regex="(unclosed"), plain=False)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("sampling.structured_output.regex"), refused.value.details()



def test_structured_output_over_http(front, client):
    model, messages = model_of(front), [{"role": "user", "content": PROMPT}]

    class Person(pydantic.BaseModel):
        name: str
        age: int

    # The OpenAI SDK's own structured-output call: a strict json_schema made from the class.
    parsed = client.chat.completions.parse(model=model, messages=messages, response_format=Person, temperature=0)
    assert parsed.choices[0].message.parsed == Person(name="Alice", age=31)
    plain = client.chat.completions.parse(model=model, messages=messages, response_format=Person, temperature=0,
                                          extra_body={"parallel_decoding": False})
    assert plain.choices[0].message.content == parsed.choices[0].message.content

    streamed = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=48,
                                              response_format={"type": "json_object"}, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert isinstance(json.loads(text), dict)

    chosen = client.completions.create(model=model, prompt="Alice is 31. Her name is", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["Alice", "Bob"]})
    assert chosen.choices[0].text in ("Alice", "Bob")
    number = client.completions.create(model=model, prompt="Alice is 31. Her age:", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"regex": " ?[0-9]+"}})
    assert re.fullmatch(" ?[0-9]+", number.choices[0].text)

    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=model, messages=messages, extra_body={"guided_regex": "(a"})
    assert refused.value.status_code == 400 and refused.value.body["param"] == "guided_regex"


NASTY = [
    ("json_schema", "[" * 100_000 + "]" * 100_000),  # over the size bound
    ("json_schema", '{"a": ' * 5_000 + "1" + "}" * 5_000),  # deeper than json.loads recurses
    ("json_schema", '{"anyOf": [' * 100 + "{}" + "]}" * 100),  # deeper than llguidance's schema reader goes
    ("grammar", "start: " + "(" * 20_000 + '"a"' + ")" * 20_000),
    ("regex", "(" * 20_000 + "a" + ")" * 20_000),
    ("json_schema", '{"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}'),
    ("json_schema", '{"type": "string", "pattern": "(?<=a)b"}'),
    ("regex", "a{1000000}"),
    ("regex", "(a|b)*" * 2000),
    ("grammar", "start: start"),
    ("grammar", "%import common.NUMBER\nstart: NUMBER"),
    ("choice", ("\x00", "\ud800")),
]


@pytest.mark.parametrize("kind, spec", NASTY)
def test_a_hostile_language_is_refused_or_compiles_never_crashes(engine, kind, spec):
    _compiles_or_is_refused(engine, kind, spec)


@FUZZ
@given(kind=st.sampled_from(["json_schema", "regex", "grammar", "choice"]),
       text=st.text(alphabet=st.characters(blacklist_categories=["Cs"]) | st.sampled_from(list('{}[]":,()|*+?\\/')),
                    max_size=60))
def test_any_language_text_is_refused_or_compiles(engine, kind, text):
    _compiles_or_is_refused(engine, kind, (text,) if kind == "choice" else text)


def _compiles_or_is_refused(engine, kind, spec):
    try:
        language = StructuredOutput(kind, spec)
    except InvalidArgument as error:
        assert str(error).startswith("sampling.structured_output"), error
        return
    try:
        matcher = engine.grammars.matcher(language)
    except InvalidArgument as error:
        assert str(error).startswith("sampling.structured_output"), error
        return
    matcher.allowed_rows(tree_layout(0, [], [], engine.model.args.vocab_size))


def test_nodes_the_language_rules_out_are_cut_before_the_forward(engine):
    vocab = engine.model.args.vocab_size
    matcher = engine.grammars.matcher(StructuredOutput("choice", ("yes", "no")))
    yes, no, comma = (_ids(engine, text)[0] for text in ("yes", "no", ","))
    # Node 0 "," (ruled out) with a child "yes" under it; node 2 "no"; node 3 "," under "no" (ruled out).
    sent = [comma, yes, no, comma]
    cut = matcher.mask_tree(sent, tree_layout(0, sent, [-1, 0, -1, 2], vocab))
    assert cut.kept == [0, 3] and cut.tokens == [no]
    assert cut.allowed.shape == (2, vocab) and cut.layout.children == ({no: 1}, {})
    assert cut.sent_nodes([1]) == [2] and cut.sent_argmax([7, 8], sent) == [7, comma, yes, 8, comma]
