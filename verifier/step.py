"""One forward's plan: which rows belong to which session, and how their attention runs.

Everything but attention runs on all rows packed together. Attention runs per session (own
cache, own tree mask), ~20 small ops per session and layer, which is most of what an extra
session costs a step (measured, 1 thread: 4 sessions x 1 token 56 ms vs 1 session x 4 tokens
41 ms). Padding small steps of several sessions into one batched attention was tried (masked
keys contribute exact zeros; logits stayed bit-identical) and measured slower: 180 ms vs 149 ms
for 16 sessions x 1 token, 625 vs 546 ms for 16 x 16 -- MKL runs a batched GEMM of tiny matrices
one matrix at a time, so batching saved no GEMM overhead and the padded gather cost extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier.attention import attend, step_mask
from verifier.kvcache import KVCache, PagedCache


@dataclass
class StepInput:
    """One session's part of a forward: its step tokens, their tree, its cache, the rows to score."""

    tokens: torch.Tensor  # int64 [T]: the root, then the tree nodes (or a chunk of prompt)
    depths: torch.Tensor  # int64 [T]: position = cache.length + depth
    ancestors: torch.Tensor  # bool [T, T]: row i attends to column j of the step where True
    cache: KVCache | PagedCache
    output_rows: torch.Tensor | None = None  # rows whose logits are wanted; None = all


@dataclass
class Segment:
    cache: KVCache | PagedCache
    start: int  # committed positions before the step
    offset: int  # first row of this session in the packed step
    steps: int
    mask: torch.Tensor | None  # step_mask [T, start + T]


@dataclass
class StepPlan:
    segments: list[Segment]

    @classmethod
    def build(cls, items: list[StepInput]) -> "StepPlan":
        segments, offset = [], 0
        for item in items:
            steps = item.tokens.shape[0]
            if item.depths.shape != (steps,) or item.ancestors.shape != (steps, steps):
                raise ValueError(f"depths must be [{steps}] and ancestors [{steps}, {steps}]")
            if not bool(item.ancestors.diagonal().all()) or bool(item.ancestors.triu(1).any()):
                raise ValueError("ancestors must be lower-triangular with a True diagonal (parents come first)")
            start = item.cache.length
            item.cache.begin_step(steps)  # raises unless reserved
            segments.append(Segment(item.cache, start, offset, steps, step_mask(item.ancestors, start)))
            offset += steps
        return cls(segments)

    def attention(self, layer: int, queries: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Stores the step's keys and values in every session's cache and returns the fp64
        attention output [N, n_heads * head_dim] of all packed rows."""
        outputs = []
        for segment in self.segments:
            part = slice(segment.offset, segment.offset + segment.steps)
            segment.cache.store(layer, kv[part])
            keys, values = segment.cache.load(layer, segment.start + segment.steps)
            outputs.append(attend(queries[part], keys, values, segment.mask, segment.start))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
