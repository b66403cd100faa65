"""A tool's schema as its calls are held to it (gateway/tools.py: Tool.call_schema): references
into itself rebased, arguments always an object."""

from __future__ import annotations

import json

from pardec.gateway.call_layouts import HERMES, structured_output
from pardec.gateway.tools import Tool, ToolUse
from tests.steps import language_reads


def test_a_tools_schema_that_refers_to_itself_holds_its_calls(engine):
    """`$ref`s into the tool's own schema ("#/$defs/...", pydantic's; "#", a recursive one) point
    into it where it sits in the call's schema: a required call takes such a tool (it was refused,
    its pointer missing) and "#" means the arguments, not the call around them."""
    tree = {"type": "object", "properties": {"label": {"type": "string"}, "at": {"$ref": "#/$defs/Place"},
                                             "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["label"], "additionalProperties": False,
            "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    language = structured_output(ToolUse((Tool("tree", parameters=json.dumps(tree)),), choice="required"), HERMES)

    def call(arguments: dict) -> str:
        return f'<tool_call>\n{json.dumps({"name": "tree", "arguments": arguments})}\n</tool_call>'

    nested = {"label": "a", "at": {"city": "Paris"}, "children": [{"label": "b", "children": []}]}
    assert language_reads(engine, language, call(nested)) == "whole"
    assert language_reads(engine, language, call({"label": "a", "at": {"town": "Paris"}})) == "refused"
    assert language_reads(engine, language, call({"label": "a", "children": [
        {"name": "tree", "arguments": {"label": "b"}}]})) == "refused"
    anything = structured_output(ToolUse((Tool("f", parameters="{}"),), choice="required"), HERMES)
    assert language_reads(engine, anything, '<tool_call>\n{"name": "f", "arguments": "now"}\n</tool_call>') == "refused"
    assert language_reads(engine, anything, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>') == "whole"


def test_refs_hold_among_several_tools_and_under_any_property_name(engine):
    """Offered with another tool, a call's schema sits in an anyOf: its `$ref`s point there; a
    property named like a keyword ("default") is a schema still, its `$ref` rebased too."""
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    where = {"type": "object", "properties": {"default": {"$ref": "#/$defs/Place"}}, "required": ["default"],
             "$defs": {"Place": place}}
    tools = ToolUse((Tool("where", parameters=json.dumps(where)), Tool("other")), choice="required")
    language = structured_output(tools, HERMES)

    def call(arguments: dict) -> str:
        return f'<tool_call>\n{json.dumps({"name": "where", "arguments": arguments})}\n</tool_call>'

    assert language_reads(engine, language, call({"default": {"city": "Paris"}})) == "whole"
    assert language_reads(engine, language, call({"default": {"town": "Paris"}})) == "refused"
