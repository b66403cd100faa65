"""Token sequences an output never holds (Sampling.bad_words; vLLM's bad_words): wherever the
output so far ends with all of a sequence but its last token, that token is masked, so the
sequence is never completed; a one-token sequence is never generated. Only the output is read,
not the prompt, as vLLM reads it. A ban yields to every other rule: where it would leave a row no
token (allowed_token_ids, a structured output, a forced tag), the row stands as those leave it.
A row's bans come from its own path (path_rules.py), so drafting under bad words gives plain
decoding's tokens. A worked example:

    >>> rule = BannedSequences([(5,), (1, 2), (7, 1, 3)])
    >>> state = rule.start()
    >>> for token in (7, 1):
    ...     state = rule.step(state, token)
    >>> sorted(rule.banned(state))  # 5 always; 2 after 1; 3 after 7, 1
    [2, 3, 5]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pardec.runtime.errors import InvalidArgument
from pardec.verifier.api import MAX_BAD_WORD_TOKENS

MAX_WORDS = 64  # a request's words (each two spellings at most: Sampling's MAX_BAD_WORDS sequences)
MAX_WORD_CHARS = 100


def word_sequences(encode: Callable[[str], list[int]], words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences that write ``words`` (a request's bad_words): each word as written
    and, where it does not start with a space, after one, as it reads inside a text (a BPE
    vocabulary spells "Paris" and " Paris" apart). InvalidArgument names ``bad_words[i]``.

    >>> word_sequences(lambda text: [ord(c) for c in text], ["ab", " c"])
    ((97, 98), (32, 97, 98), (32, 99))
    """
    if len(words) > MAX_WORDS:
        raise InvalidArgument(f"bad_words: at most {MAX_WORDS} words, got {len(words)}")
    sequences: dict[tuple[int, ...], None] = {}
    for index, word in enumerate(words):
        if not 0 < len(word) <= MAX_WORD_CHARS:
            raise InvalidArgument(f"bad_words[{index}]: must be 1 to {MAX_WORD_CHARS} characters, got {len(word)}")
        for spelling in (word,) if word[0].isspace() else (word, " " + word):
            tokens = tuple(encode(spelling))
            if len(tokens) > MAX_BAD_WORD_TOKENS:
                raise InvalidArgument(f"bad_words[{index}]: {spelling[:40]!r} is {len(tokens)} tokens; at most "
                                      f"{MAX_BAD_WORD_TOKENS}")
            if tokens:
                sequences[tokens] = None
    return tuple(sequences)


class BannedSequences:
    """The rule over token ids; its state is the output's last tokens (as many as the longest
    sequence's head)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self._last: dict[tuple[int, ...], list[int]] = {}  # a sequence's head -> the tokens that would end it
        for sequence in sequences:
            self._last.setdefault(tuple(sequence[:-1]), []).append(sequence[-1])
        self._heads = sorted({len(head) for head in self._last})
        self._kept = self._heads[-1] if self._heads else 0

    def start(self) -> tuple[int, ...]:
        return ()

    def step(self, state: tuple[int, ...], token: int) -> tuple[int, ...]:
        return (*state, token)[-self._kept:] if self._kept else ()

    def banned(self, state: tuple[int, ...]) -> list[int]:
        """The tokens a path in ``state`` may not choose next."""
        tokens: dict[int, None] = {}  # each once: a ban yields by counting what it leaves
        for size in self._heads:
            if size <= len(state):
                tokens.update(dict.fromkeys(self._last.get(state[len(state) - size:], ())))
        return list(tokens)

