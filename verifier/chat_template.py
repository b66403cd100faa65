"""The environment chat templates render in, as transformers renders them: sandboxed (templates
are model data, or an operator's file), with loop controls, a ``tojson`` that writes plain JSON,
and ``raise_exception`` for the conversations a template refuses."""

from __future__ import annotations

import json

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, indent=None):
    # Not jinja's built-in, which HTML-escapes; chat templates expect plain JSON, as transformers renders it.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in, sandboxed: templates are model data."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    return environment
