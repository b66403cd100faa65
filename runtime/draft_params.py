"""MindIE's drafting parameters (its config.json ``plugin_params``) as one table, and the size
limits of one draft tree.

``PARAMS`` holds one row per parameter: its name (the same in ``DraftParams``, in the proto's
``DraftConfig`` and, when a request may lower it, ``DraftOverrides``), its type, MindIE's default
and range, its key in MindIE's plugin_params and the plugin that reads it. Everything else reads
the rows: the gateway's rules table (gateway/rules.py) checks config.json by them, the gateway's
config and a request's overrides take their defaults and floors from them, and the drafter checks
a StartSession's DraftConfig by them (drafter/core.py). tests/test_draft_params.py holds the
proto messages and MindIE's key lists to this table.

Pure data and checks: no Redis, no Lua, no torch, so that the gateway, the drafter and the
verifier may all import it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pardec.runtime.errors import ConfigError

MEMORY_DECODING, LOOKAHEAD = "memory_decoding", "la"
# MindIE's plugin_type values for parallel decoding.
PLUGIN_TYPES = (MEMORY_DECODING, LOOKAHEAD)
# Where MindIE's config.json keeps the parameters; messages name a parameter by this path.
MINDIE_PLUGIN_PARAMS = "ModelDeployConfig.ModelConfig[0].plugin_params"
MINDIE_PLUGIN_TYPE_KEY = "plugin_type"


@dataclass(frozen=True)
class Param:
    name: str  # DraftParams' field, and the proto DraftConfig's (and DraftOverrides' when overridable)
    type: type  # int or bool
    default: int | bool  # MindIE's; also what a DraftConfig field left at 0 means
    plugin: str  # the plugin_type that reads it
    mindie_key: str  # its key in MindIE's plugin_params
    low: int | None = None  # an int's range, both ends included
    high: int | None = None
    # A request may lower it (GenerateRequest.draft, proto DraftOverrides) down to ``low``.
    overridable: bool = False
    label: str = ""  # the name MindIE's tables give it, for messages
    source: str = ""  # where MindIE defines it

    @property
    def rule(self) -> str:
        """What a value must be, as the rules table and DraftParams say it."""
        if self.type is bool:
            return f"must be true or false (default {json.dumps(self.default)})"
        label = f"{self.label} " if self.label else ""
        return f"{label}must be an integer in [{self.low}, {self.high}] (default {self.default})"

    def accepts(self, value: Any, plugin_types: Sequence[str]) -> bool:
        """Whether ``value`` is valid; an integer binds only while its plugin is on, a boolean
        always (MindIE reads dynamic_algo whatever the plugin)."""
        if self.type is bool:
            return isinstance(value, bool)
        return self.plugin not in plugin_types or _int_in(value, self.low, self.high)


PARAMS: tuple[Param, ...] = (
    Param("decoding_length", int, 16, MEMORY_DECODING, "decoding_length", 1, 16, overridable=True,
          source="MindIE Table 2"),
    Param("dynamic_algo", bool, False, MEMORY_DECODING, "dynamic_algo", source="MindIE Table 2"),
    Param("level", int, 4, LOOKAHEAD, "level", 3, 16, overridable=True, label="lookahead N", source="MindIE Table 5"),
    Param("window", int, 5, LOOKAHEAD, "window", 1, 16, overridable=True, label="lookahead W",
          source="MindIE Table 5"),
    Param("guess_set_size", int, 5, LOOKAHEAD, "guess_set_size", 1, 16, overridable=True, label="lookahead G",
          source="MindIE Table 5"),
)  # fmt: skip
BY_NAME = {param.name: param for param in PARAMS}
DEFAULTS = {param.name: param.default for param in PARAMS}
# What a request may lower, in the proto DraftOverrides' order.
OVERRIDABLE = tuple(param for param in PARAMS if param.overridable)

# The most nodes one draft tree may carry: a Propose's max_nodes, the stores' bound, and the
# verifier's default max_tree_nodes. MindIE's largest lookahead tree, (16-1) * (16+16) = 480
# nodes, fits.
MAX_TREE_NODES = 512
# The most new tokens one Propose records: one step's accepted path and its bonus token.
MAX_NEW_TOKENS = MAX_TREE_NODES + 1


def lookahead_nodes(level: int, window: int, guess_set_size: int) -> int:
    """Nodes of lookahead's largest tree, (N-1) * (W+G): MindIE's bound for speculationGamma."""
    return (level - 1) * (window + guess_set_size)


@dataclass(frozen=True)
class LookaheadParams:
    """lookahead's N, W and G, every one checked by its row (whatever the plugin)."""

    level: int = DEFAULTS["level"]
    window: int = DEFAULTS["window"]
    guess_set_size: int = DEFAULTS["guess_set_size"]

    def __post_init__(self) -> None:
        for name in ("level", "window", "guess_set_size"):
            value, param = getattr(self, name), BY_NAME[name]
            if not isinstance(value, int) or not param.low <= value <= param.high:
                raise ValueError(f"{name} must be an int in [{param.low}, {param.high}], got {value!r}")

    @property
    def max_tree_nodes(self) -> int:
        """MindIE's speculationGamma bound, (N-1) * (W+G); a tree never needs more."""
        return lookahead_nodes(self.level, self.window, self.guess_set_size)


@dataclass(frozen=True)
class DraftParams:
    """MindIE's plugin_params: the parallel-decoding algorithm and its parameters (the proto's
    DraftConfig). Checked on construction by the rows, with the rules table's messages: a
    parameter binds only while its plugin is on."""

    plugin_type: str = MEMORY_DECODING
    # memory_decoding: most candidate nodes per step; with dynamic_algo, the adaptive length's bound.
    decoding_length: int = DEFAULTS["decoding_length"]
    # memory_decoding: adaptive candidate length.
    dynamic_algo: bool = DEFAULTS["dynamic_algo"]
    # la (lookahead): N, W, G.
    level: int = DEFAULTS["level"]
    window: int = DEFAULTS["window"]
    guess_set_size: int = DEFAULTS["guess_set_size"]

    def __post_init__(self) -> None:
        problem = params_problem(self.plugin_type, lambda name: getattr(self, name))
        if problem is not None:
            raise ConfigError(problem)

    @property
    def lookahead(self) -> LookaheadParams:
        return LookaheadParams(self.level, self.window, self.guess_set_size)

    @property
    def tokens_per_step(self) -> int:
        """Draft tokens one step may carry: MindIE's lower bound for speculationGamma."""
        if self.plugin_type == LOOKAHEAD:
            return lookahead_nodes(self.level, self.window, self.guess_set_size)
        return self.decoding_length


@dataclass(frozen=True)
class DraftOverrides:
    """Per-request caps on the server's DraftParams (GenerateRequest.draft, the proto's
    DraftOverrides): the overridable rows; None keeps the server's value."""

    decoding_length: int | None = None
    level: int | None = None
    window: int | None = None
    guess_set_size: int | None = None


def params_problem(plugin_type: Any, value_of) -> str | None:
    """The message of the first parameter that breaks its row, as the rules table words it, or
    None; ``value_of(name)`` reads a parameter."""
    if plugin_type not in PLUGIN_TYPES:
        shown = plugin_type if isinstance(plugin_type, str) else repr(plugin_type)
        return (f"{MINDIE_PLUGIN_PARAMS}.{MINDIE_PLUGIN_TYPE_KEY} = {show(shown)}: "
                f"must be {' or '.join(PLUGIN_TYPES)} [MindIE Tables 2 and 5]")
    for param in PARAMS:
        value = value_of(param.name)
        if not param.accepts(value, (plugin_type,)):
            return f"{MINDIE_PLUGIN_PARAMS}.{param.mindie_key} = {show(value)}: {param.rule} [{param.source}]"
    return None


def split_new_tokens(tokens: Sequence[int], limit: int = MAX_NEW_TOKENS) -> tuple[list[Sequence[int]], Sequence[int]]:
    """More new tokens than one Propose takes (a session that ran plain for long): the chunks to
    record first, in Proposes without a tree, and the rest, which goes with the tree's Propose.

    >>> split_new_tokens([1, 2, 3, 4, 5], limit=2)
    ([[1, 2], [3, 4]], [5])
    >>> split_new_tokens([1, 2], limit=2)
    ([], [1, 2])
    """
    heads = []
    while len(tokens) > limit:
        heads.append(tokens[:limit])
        tokens = tokens[limit:]
    return heads, tokens


def show(value: Any) -> str:
    """A value as a message quotes it: JSON for strings, booleans and null, else repr."""
    return json.dumps(value) if isinstance(value, (str, bool, type(None))) else repr(value)


def _int_in(value: Any, low: int | None, high: int | None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
