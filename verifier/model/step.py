"""One forward's plan: which rows belong to which session, and how their attention runs.

Everything but attention runs on all rows packed together. Attention runs per session (own
cache, own tree mask), and that is what an extra session costs a step: attention over its own
cache. On CPU one call of the fp32 kernel (native_attention.py) per layer covers every session
of the forward, reading the pool in place through each session's slots; the plan builds what it
reads (segments, slots, each row's ancestors) once per forward. The fp64 fallback (attention.py)
runs one call per session per layer; the step's keys and values of all pooled sessions are still
written by one index_copy_ per layer, queries become fp64 once per layer for all rows, and
outputs are joined once. Without fp64 (an Ascend NPU) attention is fixed_order.py's fp32, one
call per session per layer over each row's compact key sequence (built once per forward).

Padding small steps of several sessions into one batched attention was tried (masked keys
contribute exact zeros; logits stayed bit-identical) and measured slower, for 16 sessions of 1
token and of 16 tokens alike (docs/benchmarks.md) -- MKL runs a batched GEMM of tiny matrices one
matrix at a time, so batching saved no GEMM overhead and the padded gather cost extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pardec.verifier.model.attention import attend, step_mask
from pardec.verifier.model.fixed_order import VisibleKeys, attend as attend_in_fixed_order
from pardec.verifier.model.kv_contiguous import KVCache
from pardec.verifier.model.kvcache import KVPool, PagedCache
from pardec.verifier.kernels.native_attention import Layout, NativeAttention, Storage


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
    rows: slice  # this session's rows in the packed step
    mask: torch.Tensor | None  # step_mask [T, start + T] (fp64 attention only)
    visible: VisibleKeys | None = None  # each row's key sequence (fixed-order attention only)

    @property
    def offset(self) -> int:
        return self.rows.start

    @property
    def steps(self) -> int:
        return self.rows.stop - self.rows.start


@dataclass
class StepPlan:
    segments: list[Segment]
    # The shared pool and every row's slot in it, when all sessions live there (the engine's
    # case): then one op stores the whole step's keys and values per layer.
    pool: KVPool | None = None
    pool_slots: torch.Tensor | None = None
    # The CPU kernel (native_attention.py) and what it reads, when the caches are on CPU in its dtype.
    native: NativeAttention | None = None
    layout: Layout | None = None
    fixed_order: bool = False  # attention by fixed_order.py in fp32, no fp64 tensor anywhere

    @classmethod
    def build(cls, items: list[StepInput], native: NativeAttention | None = None,
              fixed_order: bool = False) -> "StepPlan":
        segments, offset = [], 0
        for item in items:
            steps = item.tokens.shape[0]
            if item.depths.shape != (steps,) or item.ancestors.shape != (steps, steps):
                raise ValueError(f"depths must be [{steps}] and ancestors [{steps}, {steps}]")
            if not bool(item.ancestors.diagonal().all()) or bool(item.ancestors.triu(1).any()):
                raise ValueError("ancestors must be lower-triangular with a True diagonal (parents come first)")
            start = item.cache.length
            item.cache.begin_step(steps)  # raises unless reserved
            rows = slice(offset, offset + steps)
            if fixed_order:
                segments.append(Segment(item.cache, start, rows, None, VisibleKeys.build(item.ancestors, start)))
            else:
                segments.append(Segment(item.cache, start, rows, step_mask(item.ancestors, start)))
            offset += steps
        pools = {id(s.cache.pool) if isinstance(s.cache, PagedCache) else None for s in segments}
        if len(pools) == 1 and None not in pools:
            slots = [s.cache.step_slots for s in segments]
            plan = cls(segments, segments[0].cache.pool, slots[0] if len(slots) == 1 else torch.cat(slots))
        else:
            plan = cls(segments)
        plan.fixed_order = fixed_order
        readable = [_native_readable(s.cache, native.kv_dtype) for s in segments] if native is not None else []
        if any(readable) and not all(readable):
            # One path for the whole forward, or a session's rows would depend on its neighbours' caches.
            raise ValueError(f"a forward mixes caches the {native.kv_dtype} attention kernel reads with others")
        if native is not None and not fixed_order and all(readable):
            plan.native = native
            plan.layout = Layout.build(
                [s.start for s in segments], [item.ancestors for item in items],
                [_position_slots(s.cache, s.start + s.steps) for s in segments],
            )
        return plan

    def attention(self, layer: int, queries: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Stores the step's keys and values in every session's cache and returns the attention
        output [N, n_heads * head_dim] of all packed rows: fp64, or fp32 from the native kernel
        or fixed_order.py.

        queries [N, n_heads, head_dim] fp32 (rotated); kv [N, 2 * n_kv_heads, head_dim]."""
        if self.pool is not None:
            self.pool.store(layer, self.pool_slots, kv)
        else:
            for segment in self.segments:
                segment.cache.store(layer, kv[segment.rows])
        rows, n_heads, head_dim = queries.shape
        if self.native is not None:
            return self._native_attention(layer, queries, kv.shape[1] // 2)
        if self.fixed_order:
            parts = []
            for segment in self.segments:
                keys, values = segment.cache.load(layer, segment.start + segment.steps, queries.dtype)
                parts.append(attend_in_fixed_order(queries[segment.rows], keys[0], values[0], segment.visible))
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        heads_first = queries.double().transpose(0, 1)[None]  # [1, n_heads, N, head_dim]
        outputs = []
        for segment in self.segments:
            keys, values = segment.cache.load(layer, segment.start + segment.steps)
            outputs.append(attend(heads_first[:, :, segment.rows], keys, values, segment.mask, segment.start))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
        return out[0].transpose(0, 1).reshape(rows, n_heads * head_dim)

    def _native_attention(self, layer: int, queries: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
        if self.pool is not None:
            return self.native.attend(queries, _storage(self.pool, layer), self.layout, n_kv_heads)
        # Sessions with caches of their own: one kernel call each, into one output.
        out = None
        for index, segment in enumerate(self.segments):
            part = self.layout.segment(index)
            owner = segment.cache.pool if isinstance(segment.cache, PagedCache) else segment.cache
            out = self.native.attend(queries, _storage(owner, layer), part, n_kv_heads, out)
        return out


def _native_readable(cache: KVCache | PagedCache, kv_dtype: torch.dtype) -> bool:
    tensor = cache.pool.kv if isinstance(cache, PagedCache) else cache.k
    return tensor.device.type == "cpu" and tensor.dtype == kv_dtype


def _position_slots(cache: KVCache | PagedCache, end: int) -> torch.Tensor:
    return cache.slots[:end] if isinstance(cache, PagedCache) else torch.arange(end)


def _storage(owner: KVPool | KVCache, layer: int) -> Storage:
    if isinstance(owner, KVPool):
        kv = owner.kv[layer]  # [2, n_kv_heads, slots, head_dim]
        return Storage(kv[0], kv[1], kv.stride(1), kv.stride(2))
    keys = owner.k[layer]  # [capacity, n_kv_heads, head_dim]
    return Storage(keys, owner.v[layer], keys.stride(1), keys.stride(0))
