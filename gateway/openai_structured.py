"""The structured output an OpenAI-style body asks for, in each spelling clients send.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object (json, regex, choice, grammar, json_object) and its older top-level ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``: at most one of them per request, each
becoming one StructuredOutput, whose errors name the field as the client spelled it.
"""

from __future__ import annotations

import json
from typing import Any

from pardec.runtime.errors import InvalidArgument
from pardec.verifier.structured_output import StructuredOutput

# vLLM's top-level fields and the keys of its structured_outputs object, by kind.
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
FIELDS = frozenset({"response_format", "structured_outputs", *_GUIDED})


def structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The body's structured output (None: free text); InvalidArgument naming the field.

    >>> structured_output({"response_format": {"type": "json_object"}})
    StructuredOutput(kind='json_object', spec='')
    >>> structured_output({"guided_choice": ["yes", "no"]})
    StructuredOutput(kind='choice', spec=('yes', 'no'))
    >>> structured_output({"guided_regex": "a+", "structured_outputs": {"regex": "b"}})
    Traceback (most recent call last):
    ...
    pardec.runtime.errors.InvalidArgument: structured_outputs: only one of guided_regex, structured_outputs may be set
    """
    asked = [(name, _read(name, body[name])) for name in sorted(FIELDS) if body.get(name) is not None]
    asked = [(field, output) for field, output in asked if output is not None]
    if len(asked) > 1:
        names = ", ".join(sorted(name.split(".")[0] for name, _ in asked))
        raise InvalidArgument(f"{asked[-1][0].split('.')[0]}: only one of {names} may be set")
    return asked[0][1] if asked else None


def _read(name: str, value: Any) -> StructuredOutput | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise InvalidArgument("structured_outputs: must be an object")
        set_keys = [key for key in _STRUCTURED_KEYS if value.get(key) not in (None, False)]
        if len(set_keys) != 1:
            raise InvalidArgument(f"structured_outputs: must set exactly one of {', '.join(_STRUCTURED_KEYS)}")
        key = set_keys[0]
        return _output(f"structured_outputs.{key}", _STRUCTURED_KEYS[key], value[key])
    return _output(name, _GUIDED[name], value)


def _response_format(value: Any) -> StructuredOutput | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        described = value.get("json_schema")
        if not isinstance(described, dict) or not isinstance(described.get("schema"), dict):
            raise InvalidArgument("response_format.json_schema.schema: required, a JSON Schema object")
        return _output("response_format.json_schema.schema", "json_schema", described["schema"])
    raise InvalidArgument('response_format: must be {"type": "text"}, {"type": "json_object"} or '
                          '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')


def _output(field: str, kind: str, value: Any) -> StructuredOutput:
    if kind == "json_schema" and isinstance(value, dict):
        value = json.dumps(value)
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(choice, str) for choice in value):
            raise InvalidArgument(f"{field}: must be an array of strings")
        value = tuple(value)
    elif kind == "json_object":
        return StructuredOutput("json_object")
    elif not isinstance(value, str):
        raise InvalidArgument(f"{field}: must be a string")
    try:
        return StructuredOutput(kind, value)
    except InvalidArgument as error:
        rule = str(error).split(": ", 1)[-1]
        raise InvalidArgument(f"{field}: {rule}") from None
