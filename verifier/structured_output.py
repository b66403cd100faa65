"""A structured output: the formal language a session's output is held to (pardec.v1.StructuredOutput).

Torch-free, like api.py: the gateway validates a request's language where it enters, and the
verifier compiles the same value into a token matcher (engine/grammar.py). Every kind becomes
one llguidance grammar (llguidance is the Rust engine vLLM's and llama.cpp's structured outputs
use): a regular expression, a JSON Schema, a Lark grammar; a choice is a grammar of its literals.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from pardec.runtime.errors import InvalidArgument
from pardec.v1 import common_pb2

# The kinds, as the message's oneof names them.
KINDS = ("json_schema", "regex", "choice", "grammar", "json_object")
# Where a reasoning model's thinking stands before the language, as pardec.v1.Reasoning's values
# (REASONING_NONE, _BLOCK, _OPEN) name them.
REASONING = ("none", "block", "open")
# A reasoning model's thinking block (Qwen3's, DeepSeek-R1's).
THINK, UNTHINK = "<think>", "</think>"
# A schema, expression or grammar is model input the verifier compiles: bound its size.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """One language: ``kind`` is one of KINDS; ``spec`` the schema's JSON text, the expression
    or the grammar, the choices for "choice" and nothing for "json_object". Validated on
    construction (syntax, schema keywords), so a bad one is refused naming its field.

    >>> StructuredOutput("choice", ("yes", "no")).grammar()
    'start: "yes" | "no"'
    >>> StructuredOutput("regex", "(")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pardec.runtime.errors.InvalidArgument: sampling.structured_output.regex: ...unclosed group...
    """

    kind: str
    spec: str | tuple[str, ...] = ""
    reasoning: str = "none"  # one of REASONING: the language holds the text after a <think> block

    def __post_init__(self) -> None:
        field = f"sampling.structured_output.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidArgument(f"sampling.structured_output: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.reasoning not in REASONING:
            raise InvalidArgument(f"sampling.structured_output.reasoning: must be one of {', '.join(REASONING)}, "
                                  f"got {self.reasoning!r}")
        if self.kind == "choice":
            if not 0 < len(self.spec) <= MAX_CHOICES or not all(self.spec):
                raise InvalidArgument(f"{field}: must hold 1 to {MAX_CHOICES} strings, none empty")
        elif self.kind != "json_object" and not self.spec:
            raise InvalidArgument(f"{field}: must not be empty")
        if sum(map(len, self.spec if self.kind == "choice" else [self.spec])) > MAX_SPEC_CHARS:
            raise InvalidArgument(f"{field}: at most {MAX_SPEC_CHARS} characters")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as error:
                raise InvalidArgument(f"{field}: not JSON text ({error})") from None
            except RecursionError:
                raise InvalidArgument(f"{field}: nested too deeply") from None
            if not isinstance(schema, dict):
                raise InvalidArgument(f"{field}: a schema must be a JSON object, got {type(schema).__name__}")
        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error:
            raise InvalidArgument(f"{field}: {error.strip()}")

    def grammar(self, special_tags: bool = False) -> str:
        """The llguidance grammar of this language (what LLMatcher compiles), after the thinking
        block where ``reasoning`` says (``special_tags``: the vocabulary's <think> and </think>
        are control tokens, not text)."""
        language = self._language()
        if self.reasoning == "none":
            return language
        return thinking_first(language, self.reasoning == "open", special_tags)

    def _language(self) -> str:
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.spec)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        # JSON's string escapes are Lark's: each choice becomes one literal, whatever it holds.
        lark = "start: " + " | ".join(map(json.dumps, self.spec)) if self.kind == "choice" else self.spec
        return llguidance.LLMatcher.grammar_from_lark(lark)

    @classmethod
    def from_proto(cls, message: common_pb2.StructuredOutput) -> StructuredOutput | None:
        """The message's language; None when it names none (free text)."""
        kind = message.WhichOneof("language")
        if kind is None or (kind == "json_object" and not message.json_object):
            return None
        if message.reasoning not in range(len(REASONING)):  # proto3 enums accept any number
            raise InvalidArgument(f"sampling.structured_output.reasoning: {message.reasoning} is not a Reasoning")
        reasoning = REASONING[message.reasoning]
        if kind == "choice":
            return cls(kind, tuple(message.choice.values), reasoning)
        return cls(kind, "" if kind == "json_object" else getattr(message, kind), reasoning)

    def to_proto(self) -> common_pb2.StructuredOutput:
        reasoning = REASONING.index(self.reasoning)
        if self.kind == "choice":
            return common_pb2.StructuredOutput(choice=common_pb2.Choices(values=self.spec), reasoning=reasoning)
        if self.kind == "json_object":
            return common_pb2.StructuredOutput(json_object=True, reasoning=reasoning)
        return common_pb2.StructuredOutput(**{self.kind: self.spec}, reasoning=reasoning)


def regex_literal(text: str) -> str:
    """``text`` as a piece of a Lark /regex/ that matches it literally.

    >>> print(regex_literal("</think>"), regex_literal("<|im_end|>"), regex_literal("<tool_call>\\n"))
    <\\/think> <\\|im_end\\|> <tool_call>\\n
    """
    return "".join("\\" + char if char in "\\.+*?()|[]{}^$/-" else "\\n" if char == "\n" else char for char in text)


def thinking_first(language: str, opened: bool, special_tags: bool = False, tags: tuple[str, str] = (THINK, UNTHINK)) -> str:
    """An llguidance grammar of the text a reasoning model writes before and around a word of
    ``language`` (an llguidance grammar): a thinking block first, then whitespace, then the word.
    ``opened``: the output starts inside the block (its prompt opened it); else the block is
    optional, whitespace before it the layout's (as the gateway's reader takes it). The thinking
    is any text up to the first closing tag: as text tags, one lexeme
    that ends there (a regex and the negation of any text past a closing tag); as control tokens
    (``special_tags``), text between the two tokens, which text cannot spell.

    The word's grammar is nested, so its own lexer reads it as it would alone:

    >>> print(json.loads(thinking_first('start: "yes"', opened=False))["grammars"][0]["lark_grammar"])
    start: (THOUGHT BLANK)? @answer
    THOUGHT: /[ \\t\\r\\n]*<think>(?s:.*)<\\/think>/ & ~/(?s:.*<\\/think>.+)/
    BLANK: /[ \\t\\r\\n]*/
    """
    opening, closing = tags
    if special_tags:
        thought = f"{'' if opened else 'BLANK ' + opening + ' '}THOUGHT? {closing}"
        lexeme = "THOUGHT: /(?s:.+)/"
    else:
        thought = "THOUGHT"
        head, tail = ("" if opened else "[ \\t\\r\\n]*" + regex_literal(opening)), regex_literal(closing)
        lexeme = f"THOUGHT: /{head}(?s:.*){tail}/ & ~/(?s:.*{tail}.+)/"
    inner = (json.loads(language)["grammars"] if language.lstrip().startswith("{")
             else [{"lark_grammar": language}])
    if len(inner) != 1:
        raise InvalidArgument(f"sampling.structured_output: a grammar of {len(inner)} grammars cannot follow thinking")
    name = inner[0].get("name") or "answer"
    start = f"{thought} BLANK @{name}" if opened else f"({thought} BLANK)? @{name}"
    wrapper = f"start: {start}\n{lexeme}\nBLANK: /[ \\t\\r\\n]*/"
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, {**inner[0], "name": name}]})
