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

    def __post_init__(self) -> None:
        field = f"sampling.structured_output.{self.kind}"
        if self.kind not in KINDS:
            raise InvalidArgument(f"sampling.structured_output: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
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

    def grammar(self) -> str:
        """The llguidance grammar of this language (what LLMatcher compiles)."""
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
        if kind == "choice":
            return cls(kind, tuple(message.choice.values))
        return cls(kind, "" if kind == "json_object" else getattr(message, kind))

    def to_proto(self) -> common_pb2.StructuredOutput:
        if self.kind == "choice":
            return common_pb2.StructuredOutput(choice=common_pb2.Choices(values=self.spec))
        if self.kind == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        return common_pb2.StructuredOutput(**{self.kind: self.spec})
