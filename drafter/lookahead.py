"""lookahead ("la"): draft trees from a Jacobi window and an n-gram pool, as pure functions.

After hao-ai-lab's LookaheadDecoding and MindIE's `la` plugin (level N, window W, guess set
size G). This module is the reference: lookahead.lua runs the same steps inside Redis (one
round trip per step) and the tests check the two against each other.

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

Tree order: the candidates (most recent first), then the window cells level by level; a node
is dropped when it would exceed max_nodes or max_depth, and so are its descendants. The
verifier returns the argmax after the root and after every node; the rows of the deepest
level's cells are kept so that the next step can read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A cell that did not make it into the tree has no verifier output.
EXCLUDED = 0xFFFF
# MindIE's ranges for level, window and guess_set_size.
LEVEL_RANGE, WINDOW_RANGE, GUESS_SET_RANGE = (3, 16), (1, 16), (1, 16)


@dataclass(frozen=True)
class LookaheadParams:
    level: int = 4
    window: int = 5
    guess_set_size: int = 5

    def __post_init__(self) -> None:
        for name, (low, high) in (
            ("level", LEVEL_RANGE), ("window", WINDOW_RANGE), ("guess_set_size", GUESS_SET_RANGE)
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")

    @property
    def max_tree_nodes(self) -> int:
        """MindIE's speculationGamma bound, (N-1) * (W+G); a tree never needs more."""
        return (self.level - 1) * (self.window + self.guess_set_size)


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


def outputs_of(rows: list[int] | None, nodes: int, argmax: list[int]) -> list[int] | None:
    """The verifier's argmax at each deepest-level cell of the previous tree (`rows`: the
    cell's row in `argmax`; row 0 is the root), or None unless every cell has one and
    `argmax` covers the tree's `nodes` nodes (it may run longer: nodes from a shared memory
    can follow the window's, see drafter/sessions.py).

    >>> outputs_of([0, 2, 3], 3, [40, 41, 42, 43])
    [40, 42, 43]
    >>> outputs_of([0, 2, EXCLUDED], 3, [40, 41, 42, 43]), outputs_of([0, 1], 3, [40])
    (None, None)
    """
    if rows is None or len(argmax) < nodes + 1 or EXCLUDED in rows:
        return None
    return [argmax[row] for row in rows]


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # Row in the verifier's argmax (node index + 1; the root is 0) of each deepest-level cell.
    deepest_rows: list[int] = field(default_factory=list)


def layout_tree(
    levels: list[list[int]], candidates: list[tuple[int, ...]], max_nodes: int, max_depth: int
) -> Tree:
    """The step's tree: candidate chains, then the window cells (levels[0][0] is the root),
    merging nodes with the same parent and token.

    >>> tree = layout_tree([[9, 1, 2], [4, 5, 6]], [(1, 7), (3, 4)], max_nodes=16, max_depth=8)
    >>> tree.tokens, tree.parents       # (0, 1) merges with the first candidate's 1
    ([1, 7, 3, 4, 2, 4, 5, 6], [-1, 0, -1, 2, 0, -1, 0, 4])
    >>> tree.deepest_rows               # (1, 0), (1, 1) and (1, 2) are nodes 5, 6 and 7
    [6, 7, 8]
    >>> layout_tree([[9, 1, 2], [4, 5, 6]], [(1, 7)], max_nodes=3, max_depth=1).deepest_rows
    [2, 65535, 65535]
    """
    tree = Tree()
    child_at: dict[tuple[int, int], int] = {}

    def add(parent: int, token: int) -> int | None:
        at = child_at.get((parent, token))
        if at is None and len(tree.tokens) < max_nodes:
            at = child_at[parent, token] = len(tree.tokens)
            tree.tokens.append(token)
            tree.parents.append(parent)
        return at

    for candidate in candidates:
        parent = -1
        for token in candidate[:max_depth]:
            parent = add(parent, token)
            if parent is None:
                break
    cells: list[list[int | None]] = []  # node index of each cell; -1 is the root
    for level, row in enumerate(levels):
        cells.append([])
        for column, token in enumerate(row):
            if level == 0 and column == 0:
                cells[0].append(-1)
                continue
            parent = cells[level - 1][column] if level else cells[0][column - 1]
            fits = parent is not None and level + column <= max_depth
            cells[level].append(add(parent, token) if fits else None)
    tree.deepest_rows = [EXCLUDED if at is None else at + 1 for at in cells[-1]]
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
        self.nodes = 0

    def start(self, prompt: list[int], memory: list[int] = ()) -> None:
        """`memory`: earlier output (a conversation's previous answers), learned first."""
        self.levels = [initial_level(prompt, self.params.window)]
        self.pool, self.tail, self.deepest_rows, self.nodes = {}, [], None, 0
        self._learn(list(memory))
        self.tail = []  # the memory does not run on into the prompt
        self._learn(prompt)

    def propose(self, new_tokens: list[int], argmax: list[int], max_nodes: int, max_depth: int) -> Tree:
        outputs = outputs_of(self.deepest_rows, self.nodes, argmax)
        self.levels, harvest = advance_window(self.levels, outputs, self.params.level)
        for key, ngram in harvest:
            add_to_pool(self.pool, key, ngram, self.params.guess_set_size)
        self._learn(new_tokens)
        if not self.tail:  # nothing committed yet: no root to hang a tree under
            self.deepest_rows, self.nodes = None, 0
            return Tree()
        root = self.tail[-1]
        self.levels[0][0] = root
        tree = layout_tree(self.levels, self.pool.get(root, []), max_nodes, max_depth)
        self.deepest_rows, self.nodes = tree.deepest_rows, len(tree.tokens)
        return tree

    def _learn(self, tokens: list[int]) -> None:
        sequence = self.tail + list(tokens)
        for key, ngram in sequence_ngrams(sequence, self.params.level):
            add_to_pool(self.pool, key, ngram, self.params.guess_set_size)
        self.tail = sequence[-(self.params.level - 1) :]
