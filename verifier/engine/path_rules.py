"""Rules an output obeys token by token, beside its structured output's language (grammar.py): a
thinking budget (thinking_budget.py), banned token sequences (bad_words.py). Each rule is pure: a
path's state, stepped token by token, and how that state narrows the tokens a row may choose. A
row's state comes from its own path alone (the session's output, then the row's ancestors in the
tree), so its mask does too, and acceptance stays lossless, as under a language.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from pardec.verifier.engine.acceptance import StepLayout
from pardec.verifier.engine.grammar import LanguageMatcher, MaskedTree, cut_tree


class PathRule(Protocol):
    """One rule over the output's tokens."""

    def start(self) -> Any:
        """The state of an output with no token yet."""

    def step(self, state: Any, token: int) -> Any:
        """The state after ``token``; ``state`` is left as it was (a tree's rows share it)."""

    def narrows(self, state: Any) -> bool:
        """Whether a row in ``state`` is narrowed at all (most are not: no mask is built for them)."""

    def narrow(self, state: Any, allowed: np.ndarray) -> None:
        """Narrows ``allowed`` (bool [V]: a row's tokens, the language's) in place, never to none."""


class RuledMatcher:
    """A session's masks under its rules, applied in order, after its structured output's
    language (grammar.LanguageMatcher) where it has one: the calls the engine makes of a matcher."""

    def __init__(self, rules: Sequence[PathRule], vocab_size: int, language: LanguageMatcher | None = None,
                 generated: Sequence[int] = ()):
        self._rules, self._vocab_size, self._language = tuple(rules), vocab_size, language
        self.states = tuple(rule.start() for rule in self._rules)
        for token in generated:  # a resumed session's tokens (the language has moved past them)
            self.states = self._step(self.states, token)

    def _step(self, states: tuple, token: int) -> tuple:
        return tuple(rule.step(state, token) for rule, state in zip(self._rules, states))

    def advance(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.states = self._step(self.states, token)
        if self._language is not None:
            self._language.advance(tokens)

    def allowed_rows(self, layout: StepLayout) -> torch.Tensor | None:
        allowed = self.walk(layout)[0]
        return None if allowed is None else torch.from_numpy(allowed)

    def mask_tree(self, tokens: Sequence[int], layout: StepLayout) -> MaskedTree | None:
        allowed, parent_of = self.walk(layout)
        return None if allowed is None else cut_tree(tokens, layout, allowed, parent_of)

    def walk(self, layout: StepLayout) -> tuple[np.ndarray | None, dict[int, int]]:
        """Every row's allowed tokens (the language's, narrowed by each rule in turn) and the
        reachable rows' parents: a node its parent's row forbids is not reachable. No mask (None)
        where nothing narrows any row: the whole tree, as free as without rules."""
        allowed = None if self._language is None else self._language.walk(layout)[0]
        states, parent_of, stack = {0: self.states}, {0: -1}, [0]
        while stack:
            row = stack.pop()
            if allowed is None and any(rule.narrows(state) for rule, state in zip(self._rules, states[row])):
                allowed = np.ones((len(layout.children), self._vocab_size), dtype=bool)  # the rows before: free
            if allowed is not None:
                for rule, state in zip(self._rules, states[row]):
                    rule.narrow(state, allowed[row])
            for token, child in layout.children[row].items():
                if allowed is None or allowed[row, token]:
                    states[child], parent_of[child] = self._step(states[row], token), row
                    stack.append(child)
        return allowed, parent_of
