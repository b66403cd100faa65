"""The acceptance module's pure functions on literal arrays: its worked examples, the argmax of a
step's rows on either path (numpy on CPU fp32, torch elsewhere) with ties and NaNs, and a tree's
layout against its definition (a row's ancestors are its parent's plus itself)."""

import doctest

import torch

from pardec.verifier.engine import acceptance
from pardec.verifier.engine.acceptance import argmax_rows, tree_layout


def test_the_worked_examples():
    assert doctest.testmod(acceptance).failed == 0


def test_argmax_rows_is_torchs_on_both_paths():
    nan = float("nan")
    logits = torch.tensor([[0.0, 2.0, 2.0], [nan, 1.0, nan], [1.0, nan, 3.0], [-1.0, -1.0, -2.0]])
    expected = logits.argmax(dim=-1).tolist()
    assert expected == [1, 0, 1, 0]
    assert argmax_rows(logits) == expected  # numpy
    assert argmax_rows(logits.double()) == expected  # torch
    generator = torch.Generator().manual_seed(0)
    block = torch.randn(17, 4096, generator=generator).round(decimals=1)  # many ties
    assert argmax_rows(block) == block.argmax(dim=-1).tolist()


def test_a_trees_layout_follows_its_definition():
    tokens, parents = [5, 6, 9, 4, 8, 5], [-1, 0, -1, 1, 2, 0]
    layout = tree_layout(7, tokens, parents, vocab_size=10)
    rows = len(tokens) + 1
    expected = torch.zeros(rows, rows, dtype=torch.bool)
    expected[0, 0] = True
    for node, parent in enumerate(parents):
        expected[node + 1] = expected[parent + 1]
        expected[node + 1, node + 1] = True
    assert torch.equal(layout.ancestors, expected) and layout.ancestors.dtype == torch.bool
    assert layout.depths.tolist() == [0, 1, 2, 1, 3, 2, 2]
    assert layout.children == ({5: 1, 9: 3}, {6: 2, 5: 6}, {4: 4}, {8: 5}, {}, {}, {})
    assert tree_layout(7, [], [], vocab_size=10).ancestors.tolist() == [[True]]
