"""Rules an output obeys token by token, beside its structured output's language (grammar.py): a
thinking budget (thinking_budget.py) narrows a row's mask; bad words (bad_words.py) ban tokens in
a row, a ban yielding where it would leave the row nothing (acceptance.constrain applies them,
after every other rule). Each is pure: a path's state, stepped token by token. A row's state comes
from its own path alone (the session's output, then the row's ancestors in the tree), so its mask
and bans do too, and acceptance stays lossless, as under a language. A node its parent's row
masks or bans is cut from the tree: never accepted as a draft (where a ban yields, the token is
the step's bonus token instead: the same tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from pardec.verifier.engine.acceptance import StepLayout
from pardec.verifier.engine.bad_words import BannedSequences
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
    language (grammar.LanguageMatcher) where it has one, and its bans: the calls the engine makes
    of a matcher."""

    def __init__(self, rules: Sequence[PathRule], vocab_size: int, language: LanguageMatcher | None = None,
                 generated: Sequence[int] = (), bans: BannedSequences | None = None):
        self._rules, self._vocab_size, self._language, self._bans = tuple(rules), vocab_size, language, bans
        self._followed = (*self._rules, *([bans] if bans is not None else []))  # whose state follows a path
        self.states = tuple(rule.start() for rule in self._followed)
        for token in generated:  # a resumed session's tokens (the language has moved past them)
            self.states = self._step(self.states, token)

    def _step(self, states: tuple, token: int) -> tuple:
        return tuple(rule.step(state, token) for rule, state in zip(self._followed, states))

    def advance(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.states = self._step(self.states, token)
        if self._language is not None:
            self._language.advance(tokens)

    def mask_tree(self, tokens: Sequence[int], layout: StepLayout) -> MaskedTree | None:
        """The tree cut to the nodes its rows let be accepted, with their masks and bans; None
        where no row is masked or banned: the whole tree, as free as without rules."""
        allowed, parent_of, banned = self.walk(layout)
        if allowed is None and not banned:
            return None
        return cut_tree(tokens, layout, self._vocab_size, allowed, parent_of, banned or None)

    def walk(self, layout: StepLayout) -> tuple[np.ndarray | None, dict[int, int], dict[int, list[int]]]:
        """Every row's allowed tokens (the language's, narrowed by each rule in turn; None: no
        row narrowed), the reachable rows' parents, and the tokens banned in each reachable row."""
        allowed = None if self._language is None else self._language.walk(layout)[0]
        states, parent_of, banned, stack = {0: self.states}, {0: -1}, {}, [0]
        while stack:
            row = stack.pop()
            here = states[row]
            if allowed is None and any(rule.narrows(state) for rule, state in zip(self._rules, here)):
                allowed = np.ones((len(layout.children), self._vocab_size), dtype=bool)  # the rows before: free
            if allowed is not None:
                for rule, state in zip(self._rules, here):
                    rule.narrow(state, allowed[row])
            barred = self._bans.banned(here[-1]) if self._bans is not None else []
            if barred:
                banned[row] = barred
            for token, child in layout.children[row].items():
                if (allowed is None or allowed[row, token]) and token not in barred:
                    states[child], parent_of[child] = self._step(here, token), row
                    stack.append(child)
        return allowed, parent_of, banned
