"""Turns committed tokens into text, decides where generation ends, and what may be streamed.

A streamed chunk can never be taken back, so text is held back while it could still change:
a trailing U+FFFD (an incomplete UTF-8 sequence that the next token may complete) and the
longest tail that is the start of a stop string (the next tokens may complete the stop string,
and the answer ends before it). Token ids are never held back: every stop-string cut falls
inside the step that completes the stop string, so earlier steps' tokens are final.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

log = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"
# Tokens before the last stable point that are decoded again with each step's new ones, so that
# the decoder sees the context it would see in the whole text (a leading space, a merge).
LOOKBACK = 6


@dataclass(frozen=True)
class Piece:
    """What one step adds to the stream."""

    text: str
    token_ids: list[int]
    done: bool


class SpecialTokensKept:
    """``tokenizer`` whose text keeps the control tokens the model writes (vLLM's
    skip_special_tokens false): what a request asking for them is decoded with, the offsets of its
    log-probabilities included."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def __getattr__(self, name: str):
        if name == "tokenizer" or name.startswith("__"):  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def text_tokenizer(tokenizer, keep_special: bool):
    """What a request's text is decoded with."""
    return SpecialTokensKept(tokenizer) if keep_special else tokenizer


class StreamDecoder:
    def __init__(
        self, tokenizer, eos_token_ids: frozenset[int], stop: Sequence[str], max_new: int,
        stop_token_ids: frozenset[int] = frozenset(), include_stop: bool = False, min_tokens: int = 0,
    ):
        """Ends at one of ``eos_token_ids`` ("eos": the model's, none for a request that ignores
        them), ``stop_token_ids`` or a ``stop`` string ("stop": the request's) or after ``max_new``
        tokens ("length"). A stop string, or a stop or end-of-sequence token's text, ends the text
        before it, or after it with ``include_stop``. A stop string counts only where it ends past the text of
        the first ``min_tokens`` - 1 tokens (the verifier holds the stop tokens back until then)."""
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self._stop_token_ids = stop_token_ids
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._max_new = max_new
        self._min_tokens = min_tokens
        self._stop_floor: int | None = None if min_tokens > 1 else 0  # where stop strings may end after
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason = ""  # "length" | "stop" | "eos" once done
        self._sent_tokens = 0
        self._sent_text = ""
        # decode(tokens[:_stable]) is _stable_text and ends in a whole character: later steps
        # decode only what follows it (and LOOKBACK tokens before), not the whole answer again.
        self._stable, self._stable_text = 0, ""

    def add(self, new_tokens: Sequence[int]) -> Piece:
        """Appends a step's tokens; returns what may be streamed now (everything, once done)."""
        base = len(self.tokens)
        stop_token = False
        for token in new_tokens:
            self.tokens.append(token)
            if token in self._eos_token_ids:  # its text, where kept (control tokens kept), is left out too
                self.finish_reason, stop_token = "eos", True
                break
            if token in self._stop_token_ids:
                self.finish_reason, stop_token = "stop", True
                break
            if len(self.tokens) >= self._max_new:
                self.finish_reason = "length"
                break
        self.text = self._decoded()
        if stop_token and not self._include_stop:  # the ending token's text is not the answer's, nor a stop string's
            self.text = self._tokenizer.decode(self.tokens[:-1])
        if self._stop_floor is None and len(self.tokens) >= self._min_tokens:
            self._stop_floor = len(self._tokenizer.decode(self.tokens[: self._min_tokens - 1]))
        if self._stop and self._stop_floor is not None and any(self._find(self.text, s) >= 0 for s in self._stop):
            self._cut_at_stop(base)
        done = bool(self.finish_reason)
        token_ids = self.tokens[self._sent_tokens:]
        self._sent_tokens = len(self.tokens)
        return Piece(self._take_text(done), token_ids, done)

    def _decoded(self) -> str:
        """decode(self.tokens), decoding again only the tokens since the last stable point and
        LOOKBACK before it: what those decode to alone must be a prefix of what they decode to
        with the new ones, else (a decoder that rewrites across the boundary) the whole text is
        decoded, as before."""
        start = max(0, self._stable - LOOKBACK)
        window = self._tokenizer.decode(self.tokens[start:])
        before = self._tokenizer.decode(self.tokens[start : self._stable])
        if window.startswith(before) and not before.endswith(_INCOMPLETE):
            text = self._stable_text + window[len(before) :]
        else:
            text = self._tokenizer.decode(self.tokens)
        if not text.endswith(_INCOMPLETE):
            self._stable, self._stable_text = len(self.tokens), text
        return text

    def _cut_at_stop(self, base: int) -> None:
        # The first prefix of this step's tokens whose text holds a stop string ends it.
        for end in range(base + 1, len(self.tokens) + 1):
            text = self._tokenizer.decode(self.tokens[:end])
            hits = [(self._find(text, s), -len(s)) for s in self._stop if self._find(text, s) >= 0]
            if hits:
                at, longest = min(hits)  # the first stop string in the text, the longest there
                self.tokens = self.tokens[:end]
                self.text = text[: at - longest if self._include_stop else at]
                self.finish_reason = "stop"
                return

    def _find(self, text: str, stop: str) -> int:
        """Where ``stop`` first occurs in ``text`` ending past the stop floor; -1 if nowhere. Not
        in a trailing partial character (U+FFFD until its next token): how a step splits the
        tokens must not decide whether a stop string holding U+FFFD matches."""
        return text.rstrip(_INCOMPLETE).find(stop, max(0, (self._stop_floor or 0) - len(stop) + 1))

    def _take_text(self, done: bool) -> str:
        text, sent = self.text, self._sent_text
        if not text.startswith(sent):
            # Decoding more tokens rewrote text already sent (a tokenizer whose decode is not
            # prefix-stable beyond a trailing partial character); the stream cannot take it back.
            log.warning("decoded text changed under %d streamed characters; continuing after them", len(sent))
            text = sent + text[len(sent):]
        end = len(text) if done else self._stable_end(text)
        if end <= len(sent):
            return ""
        self._sent_text = text[:end]
        return text[len(sent):end]

    def _stable_end(self, text: str) -> int:
        end = len(text)
        while end > len(self._sent_text) and text[end - 1] == _INCOMPLETE:
            end -= 1
        hold = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, end), hold, -1):
                if text.endswith(stop[:size], 0, end):
                    hold = size
                    break
        return end - hold
