"""A reasoning model's thinking bounded (Sampling.thinking_budget): once the thinking holds its
budget of tokens, the output is held to the rest of the closing tag (</think>), as vLLM's
thinking_token_budget and llama.cpp's reasoning budget force it; then it is free again.

Whether a path thinks, and for how long, is read from its own tokens' bytes (the tags are found
however they were tokenized), so the token a row is held to depends only on the row's path: with
the masks of path_rules.py, acceptance stays lossless, and drafting under a budget gives plain
decoding's tokens. The whole tag is forced, as the tokenizer encodes it (a vocabulary whose
</think> is one control token forces that token), as vLLM forces it: where the model had begun
the tag when its budget ran out, the beginning stays text of the thinking. The output's end does
not end the rule (with ignore_eos the output goes on past it), and the whitespace before an
opening tag is the layout's, as the gateway's reader takes it. A worked example, with one byte a
token:

    >>> spell = lambda text: [ord(c) for c in text]
    >>> bounds = ThinkingBounds(budget=2, opened=False, token_bytes=lambda t: bytes([t]), encode=spell)
    >>> state = bounds.start()
    >>> for token in spell("\\n<think>ab"):
    ...     state = bounds.step(state, token)
    >>> chr(bounds.forced(state))  # two tokens of thinking: the tag is due
    '<'
    >>> for token in spell("</think>"):
    ...     state = bounds.step(state, token)
    >>> bounds.forced(state) is None  # closed: free again
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pardec.verifier.api import ThinkingBudget
from pardec.verifier.structured_output import THINK, UNTHINK

_OPENING, _CLOSING = THINK.encode(), UNTHINK.encode()
_LAYOUT = b" \t\n\r"  # whitespace before an opening tag (the gateway reader's)
_BEFORE, _THINKING, _DONE = 0, 1, 2


@dataclass(frozen=True)
class _State:
    """Where one path stands."""

    phase: int  # _BEFORE (the output may still open a block), _THINKING or _DONE
    count: int = 0  # tokens of thinking so far
    tail: bytes = b""  # _BEFORE: the output's bytes; _THINKING: its last ones, to find the closing tag in
    forced: tuple[int, ...] = ()  # once the budget is spent: the tag's tokens still to write


class ThinkingBounds:
    """The budget's rule over token ids (a path_rules.PathRule), pure: a path's state (`start`,
    `step`) and the token it must choose next, if any (`forced`)."""

    def __init__(self, budget: int, opened: bool, token_bytes: Callable[[int], bytes],
                 encode: Callable[[str], list[int]], closing_token: int | None = None):
        self.budget, self.opened = budget, opened
        self._bytes = token_bytes
        self._whole = (closing_token,) if closing_token is not None else tuple(encode(UNTHINK))

    @classmethod
    def of(cls, budget: ThinkingBudget, tokenizer) -> ThinkingBounds:
        """The rule of ``budget`` over ``tokenizer``'s vocabulary (a ChatTokenizer)."""
        closing = [token for token in sorted(tokenizer.control_ids) if tokenizer.token_bytes(token) == _CLOSING]
        return cls(budget.tokens, budget.opened, tokenizer.token_bytes, tokenizer.encode_text,
                   closing[0] if closing else None)

    def start(self) -> _State:
        return self._counted(_State(_THINKING)) if self.opened else _State(_BEFORE)

    def step(self, state: _State, token: int) -> _State:
        if state.phase == _DONE:
            return state
        seen = state.tail + self._bytes(token)
        if state.phase == _BEFORE:
            seen = seen.lstrip(_LAYOUT)
            if seen.startswith(_OPENING):
                return self._thinking(_State(_THINKING), None, seen[len(_OPENING):])
            return _State(_BEFORE, tail=seen) if _OPENING.startswith(seen) else _State(_DONE)
        return self._thinking(state, token, seen)

    def forced(self, state: _State) -> int | None:
        """The token a path in ``state`` must choose next (None: any)."""
        return state.forced[0] if state.phase == _THINKING and state.forced else None

    def narrows(self, state: _State) -> bool:
        return self.forced(state) is not None

    def narrow(self, state: _State, allowed: np.ndarray) -> None:
        """Holds the row to its forced token, unless what it is given forbids that token (a
        language that spells the tag itself holds the thinking)."""
        forced = self.forced(state)
        if forced is not None and forced < len(allowed) and allowed[forced]:
            allowed[:] = False
            allowed[forced] = True

    def _thinking(self, state: _State, token: int | None, seen: bytes) -> _State:
        """``state`` past ``token`` (None: the one that opened the block, not counted), ``seen``
        the bytes of thinking to look in."""
        if _CLOSING in seen:
            return _State(_DONE)
        on_course = bool(state.forced) and token == state.forced[0]
        if on_course and len(state.forced) == 1:  # the tag is written, however its bytes fell
            return _State(_DONE)
        forced = state.forced[1:] if on_course else ()  # else the whole tag is forced again
        return self._counted(_State(_THINKING, state.count + (token is not None), seen[-(len(_CLOSING) - 1):], forced))

    def _counted(self, state: _State) -> _State:
        """``state`` with the tag to force, where its budget is spent."""
        if state.count < self.budget or state.forced:
            return state
        return _State(_THINKING, state.count, state.tail, self._whole)
