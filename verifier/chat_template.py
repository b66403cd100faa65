"""The environment chat templates render in, as transformers renders them: sandboxed (templates
are model data, or an operator's file), with loop controls, a ``tojson`` that writes plain JSON
(with json.dumps's ensure_ascii, indent, separators and sort_keys), ``raise_exception`` for the
conversations a template refuses, ``strftime_now`` for templates that write today's date (Llama
3.1-3.3's), and ``{% generation %}`` blocks (transformers marks the assistant's tokens with them;
here they render their content)."""

from __future__ import annotations

import datetime
import json

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Not jinja's built-in, which HTML-escapes; chat templates expect plain JSON, as transformers renders it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``: its content, as if the tags were not there."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in, sandboxed: templates are model data."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols", _GenerationBlocks])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
