"""The drafting-parameter table (runtime/draft_params.py) against everything that names the
parameters: the proto's DraftConfig and DraftOverrides, MindIE's plugin_params keys, the gateway's
rules and config, the drafter's checks, and the tree-node limit every service reads.

Pure: no model, no servers.
"""

from __future__ import annotations

import dataclasses
import doctest
import json
import subprocess
import sys

import pytest
from google.protobuf.descriptor import FieldDescriptor

import pardec.runtime.draft_params
from pardec.drafter import lookahead_store, trie
from pardec.drafter.core import draft_params
from pardec.gateway import mindie_keys
from pardec.gateway.generation import Request
from pardec.gateway.rules import CONFIG, RULES, Facts, broken_rule
from pardec.runtime.draft_params import (
    BY_NAME,
    DEFAULTS,
    MAX_NEW_TOKENS,
    MAX_TREE_NODES,
    MINDIE_PLUGIN_PARAMS,
    OVERRIDABLE,
    PARAMS,
    PLUGIN_TYPES,
    DraftOverrides,
    DraftParams,
    LookaheadParams,
    lookahead_nodes,
)
from pardec.runtime.errors import ConfigError, InvalidArgument
from pardec.v1 import drafter_pb2, gateway_pb2
from pardec.verifier.config import VerifierConfig

PROTO_TYPES = {int: FieldDescriptor.TYPE_UINT32, bool: FieldDescriptor.TYPE_BOOL}


def test_docstring_examples():
    assert doctest.testmod(pardec.runtime.draft_params).failed == 0


def test_proto_draft_config_has_exactly_the_table_and_plugin_type():
    fields = drafter_pb2.DraftConfig.DESCRIPTOR.fields
    assert [f.name for f in fields] == ["plugin_type", *(p.name for p in PARAMS)]
    assert fields[0].type == FieldDescriptor.TYPE_STRING
    for field in fields[1:]:
        assert field.type == PROTO_TYPES[BY_NAME[field.name].type], field.name


def test_proto_draft_overrides_has_exactly_the_overridable_rows():
    fields = gateway_pb2.DraftOverrides.DESCRIPTOR.fields
    assert [f.name for f in fields] == [p.name for p in OVERRIDABLE]
    for field in fields:
        assert field.has_presence, f"{field.name}: an absent override must keep the server's value"
        assert field.type == PROTO_TYPES[BY_NAME[field.name].type], field.name
    # GenerateRequest.draft carries them.
    assert gateway_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["draft"].message_type.name == "DraftOverrides"


def test_python_classes_have_the_protos_fields_and_the_tables_defaults():
    assert [f.name for f in dataclasses.fields(DraftParams)] == [
        f.name for f in drafter_pb2.DraftConfig.DESCRIPTOR.fields
    ]
    assert dataclasses.asdict(DraftParams()) == {"plugin_type": PLUGIN_TYPES[0], **DEFAULTS}
    assert [f.name for f in dataclasses.fields(DraftOverrides)] == [
        f.name for f in gateway_pb2.DraftOverrides.DESCRIPTOR.fields
    ]
    assert set(dataclasses.asdict(DraftOverrides()).values()) == {None}
    assert dataclasses.asdict(LookaheadParams()) == {n: DEFAULTS[n] for n in ("level", "window", "guess_set_size")}
    assert Request("x").draft == DraftOverrides()


def test_mindie_plugin_params_keys_are_the_tables_and_vice_versa():
    table_keys = {"plugin_type"} | {p.mindie_key for p in PARAMS}
    # MindIE's other plugins' keys, known so that the rules refuse the plugin instead of a typo warning.
    other_plugins = {"num_speculative_tokens"}
    assert mindie_keys.PLUGIN_PARAMS == table_keys | other_plugins
    # A DraftParams as a dict is read as plugin_params (Facts), so each name is MindIE's key.
    assert all(p.mindie_key == p.name for p in PARAMS)
    assert set(PLUGIN_TYPES) == {"memory_decoding", "la"}


def test_each_row_has_one_rule_with_the_tables_text_and_range():
    for param in PARAMS:
        rows = [r for r in RULES if r.stage == CONFIG and r.key == f"{MINDIE_PLUGIN_PARAMS}.{param.mindie_key}"]
        assert len(rows) == 1, param.name
        assert (rows[0].rule, rows[0].source) == (param.rule, param.source)
        assert Facts(plugin_params={"plugin_type": param.plugin}).param(param.name) == param.default
        if param.type is bool:
            assert broken_rule(CONFIG, Facts(plugin_params={"plugin_type": param.plugin, param.name: 1}))
            continue
        for value, holds in ((param.low, True), (param.high, True), (param.low - 1, False), (param.high + 1, False)):
            facts = Facts(plugin_params={"plugin_type": param.plugin, param.name: value})
            message = broken_rule(CONFIG, facts)
            assert (message is None) == holds, (param.name, value, message)
            if not holds:
                assert message.startswith(f"{MINDIE_PLUGIN_PARAMS}.{param.mindie_key} = {value}:")
        # An integer binds only while its plugin is on.
        other = next(t for t in PLUGIN_TYPES if t != param.plugin)
        assert broken_rule(CONFIG, Facts(plugin_params={"plugin_type": other, param.name: param.high + 1})) is None


def test_draft_params_refuse_what_the_rules_refuse_in_the_same_words():
    for param in PARAMS:
        bad = "yes" if param.type is bool else param.high + 1
        values = {"plugin_type": param.plugin, param.name: bad}
        expected = broken_rule(CONFIG, Facts(plugin_params=values))
        with pytest.raises(ConfigError) as caught:
            DraftParams(**values)
        assert str(caught.value) == expected
    with pytest.raises(ConfigError) as caught:
        DraftParams(plugin_type="nope")
    assert str(caught.value) == broken_rule(CONFIG, Facts(plugin_params=json.dumps({"plugin_type": "nope"})))
    assert DraftParams("memory_decoding", level=99).level == 99  # lookahead's rows bind only under la


def test_tokens_per_step_agrees_with_the_rules():
    for params in (DraftParams(), DraftParams(decoding_length=3), DraftParams("la"), DraftParams("la", 1, False, 5, 7, 7)):
        assert params.tokens_per_step == Facts(plugin_params=dataclasses.asdict(params)).tokens_per_step
    assert DraftParams("la", level=5, window=7, guess_set_size=7).lookahead.max_tree_nodes == 56


def test_the_drafter_checks_a_draft_config_by_the_table():
    assert dataclasses.asdict(draft_params()) == dataclasses.asdict(DraftParams())
    for param in PARAMS:
        if param.type is not int:
            continue
        assert getattr(draft_params(**{param.name: param.high}), param.name) == param.high
        with pytest.raises(InvalidArgument, match=rf"config.{param.name}: {param.high + 1} is outside"):
            draft_params(**{param.name: param.high + 1})
        if param.plugin == "la":
            with pytest.raises(ValueError, match=param.name):
                LookaheadParams(**{param.name: param.low - 1})
    with pytest.raises(InvalidArgument, match="plugin_type"):
        draft_params(plugin_type="mtp")


def test_one_tree_node_limit():
    largest = lookahead_nodes(BY_NAME["level"].high, BY_NAME["window"].high, BY_NAME["guess_set_size"].high)
    assert largest <= MAX_TREE_NODES, "MindIE's largest lookahead tree must fit"
    assert BY_NAME["decoding_length"].high <= MAX_TREE_NODES
    assert VerifierConfig().max_tree_nodes == MAX_TREE_NODES
    assert MAX_NEW_TOKENS == MAX_TREE_NODES + 1
    for module, extra in ((trie, ()), (lookahead_store, ([],))):
        module.propose_args([], *extra, MAX_TREE_NODES, 4)
        with pytest.raises(ValueError, match="max_nodes"):
            module.propose_args([], *extra, MAX_TREE_NODES + 1, 4)


# Importing these must not load a module that reads a Lua script: the gateway's client side and
# a throwaway Redis server have no use for the drafter's scripts.
_PROBE = """
import builtins, pathlib, sys
read = []
real_read_text, real_open = pathlib.Path.read_text, builtins.open
def read_text(self, *a, **k):
    read.append(str(self))
    return real_read_text(self, *a, **k)
def opened(file, *a, **k):
    read.append(str(file))
    return real_open(file, *a, **k)
pathlib.Path.read_text, builtins.open = read_text, opened
import pardec.runtime.draft_params
assert not {"redis", "torch"} & set(sys.modules), "the table imports neither redis nor torch"
import pardec.gateway.clients, pardec.drafter.redis_server, pardec.drafter.config
import pardec.drafter.trie, pardec.drafter.lookahead_store
print([path for path in read if path.endswith(".lua")])
"""


def test_what_the_gateway_imports_from_the_drafter_loads_no_script():
    output = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
