"""Draft trees as every part of pardec passes them: `tokens` and `parents` (each node's parent's
index, -1 for a child of the root; a parent comes before its children), and with a drafter's
`scores` (path probabilities, comparable across trees) a `ScoredTree`. A node *is* its path, the
tokens from the root down to it, which is how two trees of the same root are merged."""

from __future__ import annotations

from collections.abc import Sequence

ScoredTree = tuple[list[int], list[int], list[float]]


def paths_of(tokens: Sequence[int], parents: Sequence[int]) -> list[tuple[int, ...]]:
    """Each node's path from the root.

    >>> paths_of([5, 6, 7], [-1, 0, -1])
    [(5,), (5, 6), (7,)]
    """
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


def merge_trees(own: ScoredTree, found: ScoredTree, max_nodes: int, keep_order: bool) -> ScoredTree:
    """The union of two trees (a node is its path; its score the higher one) cut to max_nodes,
    best first. keep_order: `own` stays as it is, index for index (lookahead reads the
    verifier's argmax by those indexes), `found` only fills what is left of the budget, and
    each score is capped by the one before it, so that they stay non-increasing.

    >>> own, found = ([1, 2, 3], [-1, 0, -1], [0.5, 0.25, 0.5]), ([1, 9], [-1, 0], [1.0, 1.0])
    >>> merge_trees(own, found, 4, keep_order=False)
    ([1, 9, 3, 2], [-1, 0, -1, 0], [1.0, 1.0, 0.5, 0.25])
    >>> merge_trees(own, found, 4, keep_order=True)
    ([1, 2, 3, 9], [-1, 0, -1, 0], [1.0, 0.25, 0.25, 0.25])
    """
    paths = [paths_of(tokens, parents) for tokens, parents, _ in (own, found)]
    scores: dict[tuple[int, ...], float] = {}
    order: dict[tuple[int, ...], int] = {}
    for tree_paths, (_, _, tree_scores) in zip(paths, (own, found)):
        for path, score in zip(tree_paths, tree_scores):
            scores[path] = max(score, scores.get(path, 0.0))
            order.setdefault(path, len(order))
    if keep_order:
        extra = [path for path in paths[1] if path not in set(paths[0])]
        ranked = paths[0] + extra[: max(0, max_nodes - len(paths[0]))]
    else:
        ranked = sorted(scores, key=lambda path: (-scores[path], len(path), order[path]))[:max_nodes]
    tokens, parents, ranked_scores = tree_of_paths(ranked, scores)
    for at in range(1, len(ranked_scores)):
        ranked_scores[at] = min(ranked_scores[at], ranked_scores[at - 1])
    return tokens, parents, ranked_scores


def tree_of_paths(paths: list[tuple[int, ...]], scores: dict) -> ScoredTree:
    """The tree whose nodes are `paths` (each after its own prefix), each scored `scores[path]`."""
    index = {path: i for i, path in enumerate(paths)}
    return (
        [path[-1] for path in paths],
        [index[path[:-1]] if len(path) > 1 else -1 for path in paths],
        [scores[path] for path in paths],
    )
