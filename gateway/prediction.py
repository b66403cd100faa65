"""Predicted outputs (OpenAI's `prediction`): the client sends text the answer will mostly be, a
file it asks to edit, and parallel decoding drafts from it. The verifier keeps only what the
model itself produces, so a wrong prediction costs time, never a token.

A prediction is followed as the answer is written. A pointer holds the prediction's index of
the token the answer would write next if it goes on as predicted. Each committed token is a
trial of the pointer: a hit moves it one on and marks that token of the prediction as appeared;
a miss (an edit) loses it. While lost, the pointer looks for the answer's last ANCHOR tokens in
the prediction (then its last 2), and sits behind the first occurrence at or after where it was
lost (an edit goes on further down the text), else behind the last one before; of those tokens,
the ones written since it was lost appeared there (each answer token marks one prediction token
at most, so the counts below are a common subsequence's). The draft is the
chain of the prediction's tokens from the pointer, node k (k = 1, 2, ...) scored r^k, r = (hits
+ 2) / (trials + 3): how often the pointer was right so far, which halves its record at WINDOW
trials to follow a change.

Worked example. Prediction [1, 2, 3, 4, 5, 6]; the answer writes 1, 2 (hits), 9 (a miss: lost
at index 2), then 4, 5: the last 2 tokens [4, 5] occur in the prediction ending at index 4, so
the pointer sits at 5, and the chain is [6], scored 2/3 (2 hits in 3 trials, and the prior's 2
in 3). Tokens 1, 2, 4 and 5 appeared: 4 accepted prediction tokens, 2 rejected:

    >>> prediction = Prediction([1, 2, 3, 4, 5, 6])
    >>> prediction.commit([1, 2, 9, 4, 5])
    >>> prediction.chain(8), prediction.accepted, prediction.rejected
    (([6], [-1], [0.6666666666666666]), 4, 2)

Those two counts are OpenAI's `accepted_prediction_tokens` and `rejected_prediction_tokens`:
the prediction's tokens that did, and did not, appear in the answer, as the pointer aligned them.

Each step's tree is the drafter's (sized by the session, gateway/drafting.py) and the chain,
merged as runtime/trees.py merges trees (a node is its path, its score the higher one) and cut
to its best prefix for the step's cost. Lookahead reads the verifier's argmax by its own tree's
node indexes, so `drafter_rows` gives it back the rows of its nodes, in its order.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

from pardec.gateway.tree_sizing import best_prefix
from pardec.runtime.trees import ScoredTree, merge_trees, paths_of

# Tokens of the answer's tail that must recur in the prediction to align with it again; 2 when
# the longer tail is nowhere (right after a deletion, the tail straddles it for a token).
ANCHOR = 3
ANCHORS = (ANCHOR, 2)
# The pointer's record starts at 2 hits in 3 trials and halves at WINDOW trials.
PRIOR = (2, 3)
WINDOW = 64


class Prediction:
    def __init__(self, tokens: Sequence[int]):
        self.tokens = list(tokens)
        self._at = 0 if self.tokens else -1  # the answer starts where the prediction does
        self._lost_at = 0  # where the pointer was lost: it aligns again at or after it first
        self._unmatched = 0  # the answer's tokens since then (each appears at most once)
        self._hits = self._trials = 0
        self._appeared = bytearray(len(self.tokens))
        self._accepted = 0  # how many of _appeared are set: read every step, so kept, not summed
        self._tail: deque[int] = deque(maxlen=ANCHOR)
        # Each n-gram of the prediction (n in ANCHORS) -> the indexes right after it, ascending.
        self._after: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for n in ANCHORS:
            for end in range(n, len(self.tokens) + 1):
                self._after[tuple(self.tokens[end - n : end])].append(end)
        # The last tree's node indexes of the drafter's own nodes (lookahead's rows), in its order.
        self._own_rows: list[int | None] = []

    @property
    def accepted(self) -> int:
        """The prediction's tokens that appeared in the answer so far."""
        return self._accepted

    @property
    def rejected(self) -> int:
        return len(self.tokens) - self.accepted

    def commit(self, tokens: Sequence[int]) -> None:
        """The answer's next tokens, in order."""
        for token in tokens:
            self._tail.append(token)
            if 0 <= self._at < len(self.tokens):
                self._trials += 1
                if self._trials >= WINDOW:
                    self._hits, self._trials = self._hits // 2, self._trials // 2
                if self.tokens[self._at] == token:
                    self._accepted += 1 - self._appeared[self._at]
                    self._appeared[self._at] = 1
                    self._at, self._hits = self._at + 1, self._hits + 1
                    continue
                self._lost_at, self._unmatched = self._at, 0
            elif self._at == len(self.tokens):
                self._lost_at, self._unmatched = self._at, 0  # the answer goes on past the prediction's end
            self._at = -1
            self._unmatched += 1
            self._align()

    def _align(self) -> None:
        tail = tuple(self._tail)
        for n in ANCHORS:
            if len(tail) < n:
                continue
            ends = self._after.get(tail[-n:])
            if not ends:
                continue
            at = bisect_left(ends, self._lost_at)
            self._at = ends[at] if at < len(ends) else ends[-1]
            # The tail's tokens written since the pointer was lost appeared here; those before
            # were hits, counted where they hit.
            marked = min(n, self._unmatched)
            self._accepted += marked - sum(self._appeared[self._at - marked : self._at])
            self._appeared[self._at - marked : self._at] = b"\x01" * marked
            return

    def chain(self, max_depth: int) -> ScoredTree:
        """The prediction from the pointer, at most ``max_depth`` tokens (none while lost)."""
        if self._at < 0 or max_depth <= 0:
            return [], [], []
        tokens = self.tokens[self._at : self._at + max_depth]
        rate = (self._hits + PRIOR[0]) / (self._trials + PRIOR[1])
        return tokens, list(range(-1, len(tokens) - 1)), [rate ** (k + 1) for k in range(len(tokens))]

    def tree(
        self, drafted: ScoredTree, max_depth: int, max_nodes: int, step_ms: Callable[[int], float], min_gain: float
    ) -> tuple[list[int], list[int]]:
        """This step's tree: the drafter's (tokens, parents, estimates), already sized, and the
        chain, merged and cut to at most ``max_nodes`` of the best prefix for ``step_ms``."""
        chain = self.chain(min(max_depth, max_nodes))  # deeper than the budget could never be verified
        if not chain[0] or max_nodes <= 0:
            self._own_rows = list(range(len(drafted[0])))
            return drafted[0], drafted[1]
        tokens, parents, scores = merge_trees(drafted, chain, max_nodes, keep_order=False)
        n, _ = best_prefix(scores, step_ms, min_gain)
        tokens, parents = tokens[:n], parents[:n]
        index = {path: at for at, path in enumerate(paths_of(tokens, parents))}
        self._own_rows = [index.get(path) for path in paths_of(drafted[0], drafted[1])]
        return tokens, parents

    def drafter_rows(self, node_argmax: Sequence[int]) -> list[int]:
        """The verifier's argmax after the root and after each node of the last tree, given back
        for the drafter's own nodes in its order, up to the first one the step did not verify."""
        if not node_argmax:
            return []
        rows = [node_argmax[0]]
        for at in self._own_rows:
            if at is None or at + 1 >= len(node_argmax):
                break
            rows.append(node_argmax[at + 1])
        return rows
