"""lookahead ("la"): draft trees from a Jacobi window and an n-gram pool, as pure functions.

After hao-ai-lab's LookaheadDecoding and MindIE's `la` plugin (level N, window W, guess set
size G). This module is the reference, kept with the tests: drafter/lookahead.lua runs the same
steps inside Redis (one round trip per step) and the tests check the two against each other.

The window holds up to N-1 levels of W tokens; level l column j sits at depth l + j under the
root, and the root itself is level 0 column 0. In the tree, the parent of (l >= 1, j) is
(l - 1, j) and the parent of (0, j) is (0, j - 1), so each column read downwards is a chain the
model continued one token per step. Starting from one level drawn from the prompt, every step
makes the model's argmax at the deepest level's nodes the next level (Jacobi iteration); once
N-1 levels are filled, every step first harvests W n-grams - column j's tokens from level 0
down plus the new output - and then drops level 0, so level 1 becomes level 0 with the new root
as its column 0.

The pool maps a token to at most G continuations of N-1 tokens, most recently seen first; a new
one pushes out the least recently seen. It learns the n-grams of earlier output handed in at
start (a conversation's answers) and of the prompt, then each step the window's harvest and the
n-grams of the committed text. Candidates are the pool's continuations of the root, each a
chain under the root; shared prefixes are merged into one branch, so that the verifier (which
follows the first child carrying its token) can reach every candidate.

Every node carries a score, a prior estimate of the probability that it ends up on the
accepted path (the gateway rescales it per session from what is actually accepted, and picks
how many nodes to verify from it, gateway/tree_sizing.py). The pool keeps no counts, only
recency, so a candidate weighs 2^-rank (most recent: rank 0): a node's share is the weight of
the candidates through it over the weight of all, and its score CANDIDATE_HIT * share *
CONTINUE^(depth-1). A window cell scores WINDOW_HIT * CONTINUE^(depth-1): the window explores,
its cells hit less often than n-grams that really occurred. A node that is both keeps the
higher score. A child never scores above its parent, so sorting by (score descending, depth,
discovery) lists every parent before its children and makes every prefix of the list a valid
tree, best first; max_nodes keeps the first max_nodes, max_depth drops deeper nodes.

Truncation and the window. The Jacobi window advances only when the verifier returned the
argmax at every cell of its deepest level, i.e. when all of them were in the verified prefix
(a row past the end of the argmax counts as absent); otherwise it stays as it is and the pool
keeps learning from the committed text alone. So a short tree never feeds the window guesses
it did not verify. Window cells score lowest and sort last: under load the gateway cuts the
exploration first and keeps the n-grams that actually occurred.
The verifier returns the argmax after the root and after every node; the rows of the deepest
level's cells are kept so that the next step can read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pardec.runtime.draft_params import LookaheadParams

# Priors of the node scores (see above). CANDIDATE_HIT: the pool's candidates together hold the
# next token; CONTINUE: a chain whose previous token matched goes on matching; WINDOW_HIT: a
# Jacobi cell holds its position's token. Their scale matters little (the gateway calibrates
# it per session); their order does: n-grams seen before rank above the window's guesses.
CANDIDATE_HIT, CONTINUE, WINDOW_HIT = 0.6, 0.8, 0.1
# A cell that did not make it into the tree has no verifier output.
EXCLUDED = 0xFFFF


def initial_level(prompt: list[int], window: int) -> list[int]:
    """Level 0 before the first step: column 0 is the root (a placeholder 0 until it is known),
    the others are prompt tokens spread evenly over the prompt, or 0 without a prompt.

    >>> initial_level([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 5)
    [0, 12, 14, 16, 18]
    >>> initial_level([7], 3), initial_level([], 2)
    ([0, 7, 7], [0, 0])
    """
    if not prompt:
        return [0] * window
    return [0] + [prompt[column * len(prompt) // window] for column in range(1, window)]


def sequence_ngrams(tokens: list[int], level: int) -> list[tuple[int, tuple[int, ...]]]:
    """Every n-gram of `tokens` as (first token, the level-1 tokens after it), in order.

    >>> sequence_ngrams([1, 2, 3, 4], 3)
    [(1, (2, 3)), (2, (3, 4))]
    """
    size = level - 1
    return [(tokens[i], tuple(tokens[i + 1 : i + 1 + size])) for i in range(len(tokens) - size)]


def add_to_pool(pool: dict[int, list[tuple[int, ...]]], key: int, ngram: tuple[int, ...], guess_set_size: int) -> None:
    """Records that `ngram` followed `key` just now: it moves to the front, and the least
    recently seen continuation beyond guess_set_size is dropped.

    >>> pool = {5: [(1, 2), (3, 4)]}
    >>> add_to_pool(pool, 5, (3, 4), 2); pool
    {5: [(3, 4), (1, 2)]}
    >>> add_to_pool(pool, 5, (8, 9), 2); pool
    {5: [(8, 9), (3, 4)]}
    """
    entry = pool.setdefault(key, [])
    if ngram in entry:
        entry.remove(ngram)
    entry.insert(0, ngram)
    del entry[guess_set_size:]


def advance_window(
    levels: list[list[int]], outputs: list[int] | None, level: int
) -> tuple[list[list[int]], list[tuple[int, tuple[int, ...]]]]:
    """One Jacobi step: the outputs at the deepest level's columns become a new level. A full
    window (level-1 levels) first yields one n-gram per column - (level 0 token, (levels 1.. ,
    output)) - and drops its level 0. Without outputs for every column the window stays as is.

    >>> advance_window([[9, 1, 2]], [4, 5, 6], level=3)          # warm-up: a second level
    ([[9, 1, 2], [4, 5, 6]], [])
    >>> advance_window([[9, 1, 2], [4, 5, 6]], [7, 8, 3], level=3)
    ([[4, 5, 6], [7, 8, 3]], [(9, (4, 7)), (1, (5, 8)), (2, (6, 3))])
    >>> advance_window([[9, 1, 2]], None, level=3)
    ([[9, 1, 2]], [])
    """
    if outputs is None:
        return [list(row) for row in levels], []
    ngrams = []
    if len(levels) == level - 1:
        for column, output in enumerate(outputs):
            ngrams.append((levels[0][column], (*(row[column] for row in levels[1:]), output)))
        levels = levels[1:]
    return [*(list(row) for row in levels), list(outputs)], ngrams


def outputs_of(rows: list[int] | None, argmax: list[int]) -> list[int] | None:
    """The verifier's argmax at each deepest-level cell of the previous tree (`rows`: the
    cell's row in `argmax`; row 0 is the root), or None unless every cell has one: a cell cut
    from the tree, by the drafter's budget or by the gateway verifying a shorter prefix (its
    row lies past the end of `argmax`), stops the window for that step.

    >>> outputs_of([0, 2, 3], [40, 41, 42, 43])
    [40, 42, 43]
    >>> outputs_of([0, 2, EXCLUDED], [40, 41, 42, 43]), outputs_of([0, 2], [40, 41])
    (None, None)
    """
    if rows is None or any(row >= len(argmax) for row in rows):  # EXCLUDED is past any argmax
        return None
    return [argmax[row] for row in rows]


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # Estimated probability that each node ends up on the accepted path; non-increasing.
    scores: list[float] = field(default_factory=list)
    # Row in the verifier's argmax (node index + 1; the root is 0) of each deepest-level cell.
    deepest_rows: list[int] = field(default_factory=list)


def decay(depth: int) -> float:
    """CONTINUE^(depth-1), by repeated multiplication so that lookahead.lua gets the same bits."""
    factor = 1.0
    for _ in range(depth - 1):
        factor = factor * CONTINUE
    return factor


def layout_tree(
    levels: list[list[int]], candidates: list[tuple[int, ...]], max_nodes: int, max_depth: int
) -> Tree:
    """The step's tree: candidate chains and the window cells (levels[0][0] is the root),
    nodes with the same parent and token merged, sorted best first and cut to the budget.

    >>> tree = layout_tree([[9, 1, 2], [4, 5, 6]], [(1, 7), (3, 4)], max_nodes=16, max_depth=8)
    >>> tree.tokens, tree.parents       # (0, 1) merges with the first candidate's 1
    ([1, 7, 3, 4, 4, 2, 5, 6], [-1, 0, -1, 2, -1, 0, 0, 5])
    >>> [round(score, 3) for score in tree.scores]
    [0.4, 0.32, 0.2, 0.16, 0.1, 0.08, 0.08, 0.064]
    >>> tree.deepest_rows               # (1, 0), (1, 1) and (1, 2) are nodes 4, 6 and 7
    [5, 7, 8]
    >>> layout_tree([[9, 1, 2], [4, 5, 6]], [(1, 7)], max_nodes=3, max_depth=1).deepest_rows
    [2, 65535, 65535]
    """
    # Every node first, in discovery order: (parent, token, depth, score); parents are indexes.
    nodes: list[list] = []
    child_at: dict[tuple[int, int], int] = {}

    def add(parent: int, token: int, depth: int, score: float) -> int:
        at = child_at.get((parent, token))
        if at is None:
            at = child_at[parent, token] = len(nodes)
            nodes.append([parent, token, depth, score])
        else:
            nodes[at][3] = max(nodes[at][3], score)
        return at

    weights = [0.5**rank for rank in range(len(candidates))]
    total = sum(weights)
    for candidate in candidates:
        parent = -1
        for depth in range(1, min(len(candidate), max_depth) + 1):
            prefix = candidate[:depth]
            share = sum(w for w, other in zip(weights, candidates) if other[:depth] == prefix)
            parent = add(parent, candidate[depth - 1], depth, CANDIDATE_HIT * (share / total) * decay(depth))
    cells: list[list[int | None]] = []  # discovery index of each cell; -1 is the root
    for level, row in enumerate(levels):
        cells.append([])
        for column, token in enumerate(row):
            if level == 0 and column == 0:
                cells[0].append(-1)
                continue
            parent = cells[level - 1][column] if level else cells[0][column - 1]
            depth = level + column
            fits = parent is not None and depth <= max_depth
            cells[level].append(add(parent, token, depth, WINDOW_HIT * decay(depth)) if fits else None)

    order = sorted(range(len(nodes)), key=lambda at: (-nodes[at][3], nodes[at][2], at))[:max_nodes]
    index = {at: new for new, at in enumerate(order)}
    tree = Tree()
    for at in order:
        parent, token, _, score = nodes[at]
        tree.tokens.append(token)
        tree.parents.append(-1 if parent == -1 else index[parent])
        tree.scores.append(score)
    tree.deepest_rows = [
        0 if at == -1 else index[at] + 1 if at in index else EXCLUDED for at in cells[-1]
    ]
    return tree


class LookaheadSession:
    """One session kept in Python memory: the behaviour lookahead.lua reproduces in Redis.

    >>> session = LookaheadSession(LookaheadParams(level=3, window=2, guess_set_size=2))
    >>> session.start([5, 6, 7, 5, 6, 8])
    >>> session.pool[5], session.levels
    ([(6, 8), (6, 7)], [[0, 5]])
    >>> tree = session.propose([5], argmax=[], max_nodes=8, max_depth=8)
    >>> tree.tokens, tree.parents       # root 5: its two n-grams, then the window cell (0, 1)
    ([6, 8, 7, 5], [-1, 0, 0, -1])
    >>> tree = session.propose([6, 8], argmax=[6, 8, 1, 2, 3], max_nodes=8, max_depth=8)
    >>> session.levels                  # (0, 0) -> 6 and (0, 1) -> 3 became level 1
    [[8, 5], [6, 3]]
    """

    def __init__(self, params: LookaheadParams):
        self.params = params
        self.levels: list[list[int]] = []
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.tail: list[int] = []  # the last level-1 committed tokens: n-grams span calls
        self.deepest_rows: list[int] | None = None  # of the previous tree

    def start(self, prompt: list[int], memory: list[int] = ()) -> None:
        """`memory`: earlier output (a conversation's previous answers), learned first."""
        self.levels = [initial_level(prompt, self.params.window)]
        self.pool, self.tail, self.deepest_rows = {}, [], None
        self._learn(list(memory))
        self.tail = []  # the memory does not run on into the prompt
        self._learn(prompt)

    def propose(self, new_tokens: list[int], argmax: list[int], max_nodes: int, max_depth: int) -> Tree:
        outputs = outputs_of(self.deepest_rows, argmax)
        self.levels, harvest = advance_window(self.levels, outputs, self.params.level)
        for key, ngram in harvest:
            add_to_pool(self.pool, key, ngram, self.params.guess_set_size)
        self._learn(new_tokens)
        if not self.tail:  # nothing committed yet: no root to hang a tree under
            self.deepest_rows = None
            return Tree()
        root = self.tail[-1]
        self.levels[0][0] = root
        tree = layout_tree(self.levels, self.pool.get(root, []), max_nodes, max_depth)
        self.deepest_rows = tree.deepest_rows
        return tree

    def _learn(self, tokens: list[int]) -> None:
        sequence = self.tail + list(tokens)
        for key, ngram in sequence_ngrams(sequence, self.params.level):
            add_to_pool(self.pool, key, ngram, self.params.guess_set_size)
        self.tail = sequence[-(self.params.level - 1) :]
