"""Drafting one step ahead: the drafter works on the next step's tree while the verifier runs
this one, so that a served step does not wait for a drafter's round trip after each forward.

The next step's root is the model's own token, unknown until this step's forward returns, so
no call can draft exactly for it in advance. But a drafted tree holds many outcomes at once: a
tree rooted where this step is rooted, deeper than what this step verifies, contains the next
step's tree wherever it contains the tokens this step commits (the accepted path and the
model's bonus token). So while the verifier runs, the session asks the drafter for a deep tree
rooted at this step's root (recording the tokens committed before, as any call does); once the
step's tokens are in, `descend` cuts from it the part below them, re-rooted, and the next step
verifies that part without asking anything first. When the tokens leave the tree (the text
went where the drafter saw no continuation), the next step asks as it always did.

Only the committed tokens are ever recorded, in order: a call drafts from what the drafter's
session holds and reads nothing the model has not produced. The descended tree's estimates are
conditioned on having reached its new root (divided by that node's own estimate), as the
drafter would estimate them from there.

On a CPU that also runs the verifier the ahead call takes cores from the forward it overlaps,
so `overlap_drafting` is on where the verifier runs elsewhere (an accelerator) and off on CPU
unless asked for (GatewayConfig.overlap_drafting).
"""

from __future__ import annotations

from typing import Sequence

OVERLAP_CHOICES = ("auto", "on", "off")


def descend(
    tokens: Sequence[int], parents: Sequence[int], probabilities: Sequence[float], path: Sequence[int]
) -> tuple[list[int], list[int], list[float]] | None:
    """The part of a best-first tree below the node that `path` reaches from the root, as a tree
    of its own rooted there (parents renumbered, estimates divided by the node's, at most 1);
    None when the path leaves the tree. An empty path leaves the tree as it is.

    >>> # root -> 5 -> 6 -> {7, 8}; root -> 9
    >>> descend([5, 9, 6, 7, 8], [-1, -1, 0, 2, 2], [0.8, 0.1, 0.5, 0.25, 0.125], [5, 6])
    ([7, 8], [-1, -1], [0.5, 0.25])
    >>> descend([5, 9, 6, 7, 8], [-1, -1, 0, 2, 2], [0.8, 0.1, 0.5, 0.25, 0.125], [5])
    ([6, 7, 8], [-1, 0, 0], [0.625, 0.3125, 0.15625])
    >>> descend([5, 9, 6], [-1, -1, 0], [0.8, 0.1, 0.6], [9, 4]) is None
    True
    """
    node = -1
    for token in path:
        node = next((i for i in range(len(tokens)) if parents[i] == node and tokens[i] == token), -2)
        if node == -2:
            return None
    if node < 0:
        return list(tokens), list(parents), list(probabilities)
    reached = probabilities[node]
    index_of = {node: -1}  # old index -> new index; the reached node becomes the root
    kept_tokens: list[int] = []
    kept_parents: list[int] = []
    kept_probabilities: list[float] = []
    for i in range(node + 1, len(tokens)):
        if parents[i] in index_of:  # parents come before children, so one pass finds them all
            index_of[i] = len(kept_tokens)
            kept_tokens.append(tokens[i])
            kept_parents.append(index_of[parents[i]])
            kept_probabilities.append(min(1.0, probabilities[i] / reached) if reached > 0 else probabilities[i])
    return kept_tokens, kept_parents, kept_probabilities


def within_depth(
    tokens: Sequence[int], parents: Sequence[int], probabilities: Sequence[float], max_depth: int
) -> tuple[list[int], list[int], list[float]]:
    """The nodes at most `max_depth` below the root (a node's parent is shallower, so kept too).

    >>> within_depth([5, 6, 7, 8], [-1, 0, 1, -1], [0.9, 0.8, 0.7, 0.1], 2)
    ([5, 6, 8], [-1, 0, -1], [0.9, 0.8, 0.1])
    """
    depth_of: dict[int, int] = {-1: 0}
    index_of: dict[int, int] = {-1: -1}
    kept: tuple[list[int], list[int], list[float]] = ([], [], [])
    for i, parent in enumerate(parents):
        depth_of[i] = depth_of[parent] + 1
        if depth_of[i] <= max_depth:
            index_of[i] = len(kept[0])
            kept[0].append(tokens[i])
            kept[1].append(index_of[parent])
            kept[2].append(probabilities[i])
    return kept


def overlap_applies(choice: str, verifier_device: str, plugin_type: str, dynamic_algo: bool) -> bool:
    """Whether a session drafts ahead: `choice` "on", or "auto" with the verifier on an
    accelerator; memory_decoding without dynamic_algo only (lookahead advances its window with
    the verifier's argmax of the tree it drafted last, and dynamic_algo sizes its next tree by
    the depth verified of it: both read a step-by-step exchange that drafting ahead breaks).

    >>> overlap_applies("auto", "cuda:0", "memory_decoding", False), overlap_applies("auto", "cpu", "memory_decoding", False)
    (True, False)
    >>> overlap_applies("on", "cpu", "la", False), overlap_applies("auto", "", "memory_decoding", False)
    (False, False)
    """
    if choice not in OVERLAP_CHOICES:
        raise ValueError(f"overlap_drafting must be one of {OVERLAP_CHOICES}, got {choice!r}")
    if plugin_type != "memory_decoding" or dynamic_algo or choice == "off":
        return False
    return choice == "on" or (bool(verifier_device) and not verifier_device.startswith("cpu"))
