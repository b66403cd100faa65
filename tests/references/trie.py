"""memory_decoding in pure Python: the trie's tree (drafter/trie.py describes it) and the copy
chain, the reference memory_decoding.lua is held to."""

from __future__ import annotations

import heapq
import itertools
import math

from pardec.runtime.trees import merge_trees
from pardec.drafter.trie import COPY_PRIOR, COPY_WINDOW, PROMPT_WEIGHT


class ReferenceNode:
    def __init__(self):
        self.children: dict[int, ReferenceNode] = {}
        self.prompt = 0
        self.output = 0

    @property
    def weight(self) -> int:
        return self.prompt * PROMPT_WEIGHT + self.output


def reference_trie(tokens, prompt_length, branch_length) -> ReferenceNode:
    """Inserts the whole sequence at once: every path t[i..i+branch_length], counted by the kind
    of each node's last token."""
    root = ReferenceNode()
    for start in range(len(tokens)):
        node = root
        for end in range(start, min(start + branch_length + 1, len(tokens))):
            node = node.children.setdefault(tokens[end], ReferenceNode())
            if end < prompt_length:
                node.prompt += 1
            else:
                node.output += 1
    return root


def reference_propose(tokens, prompt_length, branch_length, max_nodes, max_depth, with_scores=False):
    """Best-first search with a global heap ordered by (-score, push order); children are pushed
    by (-weight, token). A different mechanism from the Lua script's per-group fronts. A
    child's score: its parent's times the escape total / (total + siblings), times weight /
    total (the same operations in the same order as the script, so the same bits)."""
    root = reference_trie(tokens, prompt_length, branch_length)
    if not tokens or max_nodes == 0 or max_depth == 0:
        return ([], [], []) if with_scores else ([], [])
    query = root.children[tokens[-1]]
    if len(tokens) >= 2:
        pair = root.children[tokens[-2]].children.get(tokens[-1])
        if pair is not None and pair.children:
            query = pair
    heap, push_order = [], itertools.count()

    def push_children(node, depth, score, parent_index):
        if not node.children:
            return
        total = sum(child.weight for child in node.children.values())
        scale = score * total / (total + len(node.children))
        for token, child in sorted(node.children.items(), key=lambda item: (-item[1].weight, item[0])):
            child_score = scale * child.weight / total
            heapq.heappush(heap, (-child_score, next(push_order), token, child, depth + 1, parent_index))

    out_tokens, out_parents, out_scores = [], [], []
    push_children(query, 0, 1, -1)
    while heap and len(out_tokens) < max_nodes:
        negative_score, _, token, node, depth, parent_index = heapq.heappop(heap)
        out_tokens.append(token)
        out_parents.append(parent_index)
        out_scores.append(-negative_score)
        if depth < max_depth:
            push_children(node, depth, -negative_score, len(out_tokens) - 1)
    return (out_tokens, out_parents, out_scores) if with_scores else (out_tokens, out_parents)


class ReferenceCopy:
    """The copy pointer, from the sequence itself (the script reads stored positions instead):
    followed token by token until its first miss, then moved behind the latest earlier
    occurrence of the longest suffix (at most branch_length tokens) that went on before, unless
    the pointer follows a match at least that long."""

    def __init__(self, branch_length):
        self.branch_length = branch_length
        self.at, self.run, self.hits, self.trials = -1, 0, 0, 0

    def step(self, committed, new_tokens):
        """`committed` includes `new_tokens`, at its end."""
        if self.at >= 0:
            for token in new_tokens:
                self.trials += 1
                if committed[self.at] != token:
                    self.at, self.run = -1, 0
                    break
                self.at, self.run, self.hits = self.at + 1, self.run + 1, self.hits + 1
        while self.trials >= COPY_WINDOW:
            self.hits, self.trials = self.hits // 2, self.trials // 2
        n = len(committed)
        for length in range(min(self.branch_length, n), self.run, -1):
            suffix = committed[n - length :]
            latest = next((end for end in range(n - 1, length - 1, -1) if committed[end - length : end] == suffix), None)
            if latest is not None:
                self.at, self.run = latest, length
                return

    def chain(self, committed, max_nodes, max_depth):
        """The pointer's chain, periodic past the end of `committed`, scored in millionths as the
        script does: r^depth."""
        if self.at < 0:
            return [], [], []
        source = committed[self.at :]
        tokens = [source[k % len(source)] for k in range(min(max_nodes, max_depth))]
        rate = (self.hits + COPY_PRIOR[0]) / (self.trials + COPY_PRIOR[1])
        scores, score = [], 1.0
        for _ in tokens:
            score *= rate
            scores.append(math.floor(score * 1_000_000))
        return tokens, list(range(-1, len(tokens) - 1)), scores


def reference_step(copy, committed, new_tokens, prompt_length, max_nodes, max_depth, with_scores=False):
    """One propose: the trie's tree and the copy chain merged (scores in millionths, as the
    script ranks them)."""
    copy.step(committed, new_tokens)
    tokens, parents, scores = reference_propose(
        committed, prompt_length, copy.branch_length, max_nodes, max_depth, with_scores=True
    )
    scores = [math.floor(score * 1_000_000) for score in scores]
    if committed and max_nodes and max_depth:
        chain = copy.chain(committed, max_nodes, max_depth)
        if chain[0]:
            tokens, parents, scores = merge_trees((tokens, parents, scores), chain, max_nodes, keep_order=False)
    scores = [score / 1_000_000 for score in scores]
    return (tokens, parents, scores) if with_scores else (tokens, parents)
