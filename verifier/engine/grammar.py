"""Structured output in a step: a session's language as a token matcher, and the tokens each row
of a tree may choose under it.

A row's allowed tokens depend only on the tokens on its own path (what the session generated,
then the tree's ancestors of the row), never on the rest of the tree or batch, so the masks keep
acceptance lossless: a tree's accepted path gets the tokens plain decoding would, one at a time.
A node whose path leaves the language can never be accepted (its token is masked in its parent's
row), so it is cut from the tree before the forward (MaskedTree): drafts the language rules out
cost no compute.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from pardec.runtime.errors import InvalidArgument
from pardec.verifier.engine.acceptance import StepLayout, tree_layout
from pardec.verifier.model.tokenizer import ChatTokenizer
from pardec.verifier.structured_output import UNTHINK, StructuredOutput


class _Vocabulary:
    """The tokenizer as llguidance reads one: each id's bytes, the control tokens, and an encoder."""

    def __init__(self, tokenizer: ChatTokenizer):
        size = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(token) for token in range(size)]
        self.special_token_ids = sorted(tokenizer.control_ids)
        self.eos_token_id = tokenizer.stop_token_ids[0]
        self.bos_token_id = None
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode_text(text)


class Grammars:
    """Compiles a session's StructuredOutput into an llguidance matcher over the model's
    vocabulary. The vocabulary as llguidance reads it (every token's bytes) is built on the first
    structured request, once: a server that never gets one never pays for it."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's rows of logits (may exceed the tokenizer's)
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._vocabulary is None:
                # A grammar may end only where the model's own generation ends: on its stop tokens.
                self._vocabulary = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer)), n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.stop_token_ids),
                )
            return self._vocabulary

    def matcher(self, output: StructuredOutput, generated: Sequence[int] = ()) -> LanguageMatcher:
        """A matcher at the start of ``output``'s language, past ``generated`` (the tokens a
        resumed session generated elsewhere under it); INVALID_ARGUMENT naming the field when
        the language does not compile over this vocabulary or those tokens leave it."""
        # A vocabulary whose </think> is a control token cannot spell it as text.
        special_tags = any(self._tokenizer.token_bytes(token) == UNTHINK.encode() for token in self._tokenizer.control_ids)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), output.grammar(special_tags), log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"sampling.structured_output.{output.kind}: {matcher.get_error().strip()}")
        language = LanguageMatcher(matcher, frozenset(self._tokenizer.stop_token_ids), self.vocab_size)
        try:
            language.advance(generated)
        except RuntimeError:
            raise InvalidArgument("generated_tokens: the tokens generated before leave sampling.structured_output") from None
        return language


@dataclass(frozen=True)
class MaskedTree:
    """A draft tree as a structured output (and the rules of path_rules.py) lets it be computed:
    only the nodes it may accept, each row with its mask and the tokens bad words ban there
    (acceptance.constrain). ``kept`` are the sent tree's rows kept (0, the root, first), so the
    answer speaks of the tree as it was sent.

    >>> cut = MaskedTree([0, 2], [7], tree_layout(0, [7], [-1], 10), torch.ones(2, 10, dtype=torch.bool))
    >>> cut.sent_nodes([1]), cut.sent_argmax([4, 5], sent_tokens=[3, 7])
    ([1], [4, 3, 5])
    """

    kept: list[int]
    tokens: list[int]  # the kept nodes' tokens
    layout: StepLayout
    allowed: torch.Tensor | None  # bool [kept rows, vocab]; None: every token
    banned: tuple[tuple[int, ...], ...] | None = None  # per kept row; None: none

    def sent_nodes(self, rows: Sequence[int]) -> list[int]:
        """The sent tree's node indices of these rows of the cut tree."""
        return [self.kept[row] - 1 for row in rows]

    def sent_argmax(self, argmax: Sequence[int], sent_tokens: Sequence[int]) -> list[int]:
        """node_argmax over the sent tree: a node never computed reads as its own token."""
        full = [0, *sent_tokens]
        for row, value in zip(self.kept, argmax):
            full[row] = value
        return full


class LanguageMatcher:
    """A session's place in its language: the llguidance matcher past every token it committed.
    Once a stop token is committed the output is whole and ``ended``: from then on (a request
    that ignores end-of-sequence) its rows allow only stop tokens, so the text stays the word."""

    def __init__(self, matcher: llguidance.LLMatcher, stops: frozenset[int], vocab_size: int):
        self._matcher = matcher
        self._stops = stops
        self._stops_only = np.zeros(vocab_size, dtype=bool)
        self._stops_only[sorted(stops)] = True
        self.ended = False

    def advance(self, tokens: Sequence[int]) -> None:
        """Moves past the tokens the session committed (each chosen under its row's mask)."""
        for token in tokens:
            if self.ended:
                return
            self.ended = token in self._stops
            # A stop token is never given to the matcher, whose rollback does not count it.
            if not self.ended and not self._matcher.consume_token(token):
                raise RuntimeError(f"structured output: a committed token was refused: {self._matcher.get_error()}")

    def allowed_rows(self, layout: StepLayout) -> torch.Tensor:
        """Which tokens each row may choose, bool [rows, vocab]: row 0's from the session's
        place (its tokens so far, the root included), a node's from there past its own path.
        Rows unreachable under the language (a path through a token its parent's row forbids)
        allow every token: they are never accepted."""
        return torch.from_numpy(self.walk(layout)[0])

    def mask_tree(self, tokens: Sequence[int], layout: StepLayout) -> MaskedTree:
        """The tree cut to the nodes the language may accept, with their rows' masks: a node
        its parent's row forbids (and what hangs under it) is never computed."""
        return cut_tree(tokens, layout, len(self._stops_only), *self.walk(layout))

    def walk(self, layout: StepLayout) -> tuple[np.ndarray, dict[int, int]]:
        """Every row's allowed tokens, and the reachable rows' parent rows (row 0's: -1). The
        matcher is walked down the tree depth first and rolled back: it ends where it began."""
        rows, vocab_size = len(layout.children), len(self._stops_only)
        allowed = np.ones((rows, vocab_size), dtype=bool)
        allowed[0] = self._allowed(self.ended)
        parent_of = {0: -1}
        # (row, its token, its parent row, tokens the matcher held at the parent, parent ended).
        stack = [(child, token, 0, 0, self.ended) for token, child in reversed(layout.children[0].items())
                 if allowed[0, token]]
        consumed = 0
        try:
            while stack:
                row, token, parent, at_parent, ended = stack.pop()
                self._rollback(consumed - at_parent)
                consumed, ended = at_parent, ended or token in self._stops
                if not ended:
                    if not self._matcher.consume_token(token):
                        raise RuntimeError(f"structured output: an allowed token was refused: {self._matcher.get_error()}")
                    consumed += 1
                allowed[row], parent_of[row] = self._allowed(ended), parent
                stack += [(child, token, row, consumed, ended) for token, child in reversed(layout.children[row].items())
                          if allowed[row, token]]
        finally:
            self._rollback(consumed)
        return allowed, parent_of

    def _rollback(self, tokens: int) -> None:
        if tokens and not self._matcher.rollback(tokens):
            raise RuntimeError(f"structured output: could not roll back {tokens} tokens: {self._matcher.get_error()}")

    def _allowed(self, ended: bool) -> np.ndarray:
        if ended:
            return self._stops_only
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: len(self._stops_only)].astype(bool)


def cut_tree(tokens: Sequence[int], layout: StepLayout, vocab_size: int, allowed: np.ndarray | None,
             parent_of: dict[int, int], banned: dict[int, list[int]] | None = None) -> MaskedTree:
    """The tree cut to its reachable rows (``parent_of``'s: each one's parent row), with their
    masks (None: every token) and their banned tokens (by sent row)."""
    kept = sorted(parent_of)  # a parent's row is smaller than its children's, so order holds
    bans = None if banned is None else tuple(tuple(banned.get(row, ())) for row in kept)
    if len(kept) == len(layout.children):
        return MaskedTree(kept, list(tokens), layout, None if allowed is None else torch.from_numpy(allowed), bans)
    index = {row: position for position, row in enumerate(kept)}
    kept_tokens = [tokens[row - 1] for row in kept[1:]]
    parents = [index[parent_of[row]] - 1 for row in kept[1:]]
    return MaskedTree(kept, kept_tokens, tree_layout(0, kept_tokens, parents, vocab_size),
                      None if allowed is None else torch.from_numpy(allowed[kept]), bans)
